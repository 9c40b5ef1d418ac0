// What people look at, from a real grid under `hpctrial run` on 2 ranks: each trial's
// TensorBoard event files, read back by an independent reader, and `hpctrial plot`'s PNG and SVG
// of the grid and of one trial.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include <nlohmann/json.hpp>

#include "../support/event_files.h"
#include "../support/read_file.h"
#include "../support/temp_dir.h"
#include "hpctrial/build_config.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial {
namespace {

using testing::HasSubstr;
using testing_support::read_file;
using testing_support::TempDir;
namespace fs = std::filesystem;

// PLplot's SVG writes each character of a text as a reference (&#x74;): the text as read.
std::string svg_text(const std::string& svg) {
  std::string out;
  const std::regex reference("&#x([0-9a-fA-F]+);");
  std::size_t at = 0;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), reference); it != std::sregex_iterator(); ++it) {
    out.append(svg, at, static_cast<std::size_t>(it->position()) - at);
    out += static_cast<char>(std::stoi((*it)[1].str(), nullptr, 16));
    at = static_cast<std::size_t>(it->position() + it->length());
  }
  out.append(svg, at, std::string::npos);
  return out;
}

// The PNG's width and height from its IHDR chunk; {0, 0} when it is not a PNG.
std::pair<int, int> png_size(const std::string& bytes) {
  if (bytes.size() < 24 || bytes.compare(0, 8, std::string("\x89PNG\r\n\x1a\n", 8)) != 0 ||
      bytes.compare(12, 4, "IHDR") != 0) {
    return {0, 0};
  }
  const auto be32 = [&](std::size_t at) {
    return (static_cast<unsigned char>(bytes[at]) << 24) | (static_cast<unsigned char>(bytes[at + 1]) << 16) |
           (static_cast<unsigned char>(bytes[at + 2]) << 8) | static_cast<unsigned char>(bytes[at + 3]);
  };
  return {be32(16), be32(20)};
}

class GridViews : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir;
    experiment_ = (dir_->path() / "grid").string();
    core::RunOptions options;
    options.timeout = std::chrono::seconds(400);
    options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
    run_ = new core::RunResult(core::run_process(
        {HPCTRIAL_CLI, "run", HPCTRIAL_SOURCE_DIR "/examples/sequence/experiment-grid.yaml", "--set",
         std::string("entrypoint=") + HPCTRIAL_SEQUENCE, "--experiment", experiment_, "--oversubscribe"},
        options));
  }
  static void TearDownTestSuite() {
    delete run_;
    delete dir_;
  }
  static core::RunResult plot(std::vector<std::string> args) {
    args.insert(args.begin(), {HPCTRIAL_CLI, "plot"});
    core::RunOptions options;
    options.timeout = std::chrono::seconds(60);
    return core::run_process(args, options);
  }

  static TempDir* dir_;
  static std::string experiment_;
  static core::RunResult* run_;
};
TempDir* GridViews::dir_ = nullptr;
std::string GridViews::experiment_;
core::RunResult* GridViews::run_ = nullptr;

TEST_F(GridViews, EachTrialsEventFilesHoldItsMetrics) {
  ASSERT_TRUE(run_->ok()) << run_->describe() << "\n" << run_->out << run_->err;
  for (int trial = 0; trial < 2; ++trial) {
    const std::string trial_dir = experiment_ + "/trial-" + std::to_string(trial);
    const auto files = testing_support::event_files(trial_dir + "/tensorboard");
    ASSERT_EQ(files.size(), 1u) << trial_dir;
    EXPECT_EQ(fs::status(files[0]).permissions() & fs::perms::all, fs::perms::owner_read | fs::perms::owner_write);
    const auto read = testing_support::read_events(files);
    ASSERT_TRUE(read.ok) << read.error;
    std::vector<std::pair<std::int64_t, double>> logged;
    std::ifstream in(trial_dir + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j["kind"] == "validation") logged.emplace_back(j["batches"], j["metrics"]["accuracy"].get<double>());
    }
    ASSERT_FALSE(logged.empty());
    const auto accuracy = testing_support::scalars(read.events, "validation/accuracy");
    ASSERT_EQ(accuracy.size(), logged.size()) << trial_dir;
    for (std::size_t i = 0; i < logged.size(); ++i) {
      EXPECT_EQ(accuracy[i].first, logged[i].first);
      EXPECT_FLOAT_EQ(static_cast<float>(accuracy[i].second), static_cast<float>(logged[i].second));
    }
    EXPECT_FALSE(testing_support::scalars(read.events, "training/loss").empty());
    EXPECT_FALSE(testing_support::scalars(read.events, "timings/train_batch_ms").empty());
  }
}

TEST_F(GridViews, PlotDrawsTheGridAndOneTrialAsPngAndSvg) {
  if (!HPCTRIAL_WITH_PLOT) GTEST_SKIP() << "built with -DHPCTRIAL_PLOT=OFF";
  ASSERT_TRUE(run_->ok()) << run_->describe();
  const std::string png = dir_->path() / "grid.png", svg = dir_->path() / "grid.svg";
  const auto r = plot({experiment_, "-o", png, "-o", svg});
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr(png));
  const auto [width, height] = png_size(read_file(png));
  EXPECT_EQ(width, 1200);
  EXPECT_GT(height, 400) << "a panel per metric";
  EXPECT_GT(fs::file_size(png), 10000u);
  EXPECT_EQ(fs::status(png).permissions() & fs::perms::all, fs::perms::owner_read | fs::perms::owner_write);
  const std::string text = svg_text(read_file(svg));
  EXPECT_THAT(text, HasSubstr("<svg"));
  EXPECT_THAT(text, HasSubstr("trial 0: "));
  EXPECT_THAT(text, HasSubstr("stop_at_accuracy=0.9"));
  EXPECT_THAT(text, HasSubstr("trial 1: "));
  EXPECT_THAT(text, HasSubstr("stop_at_accuracy=1.1"));
  EXPECT_THAT(text, HasSubstr("loss (training)"));
  EXPECT_THAT(text, HasSubstr("accuracy (validation)"));

  // One trial, one metric; the default file is EXPDIR/plot.png.
  const auto one = plot({experiment_, "--trial", "1", "--metric", "accuracy", "-o", svg});
  ASSERT_TRUE(one.ok()) << one.describe() << "\n" << one.err;
  const std::string single = svg_text(read_file(svg));
  EXPECT_THAT(single, HasSubstr("trial 1: "));
  EXPECT_THAT(single, testing::Not(HasSubstr("trial 0")));
  EXPECT_THAT(single, testing::Not(HasSubstr("loss (training)")));
  const auto default_file = plot({experiment_, "--trial", "0"});
  ASSERT_TRUE(default_file.ok()) << default_file.describe() << "\n" << default_file.err;
  EXPECT_EQ(png_size(read_file(experiment_ + "/plot.png")).first, 1200);
}

TEST_F(GridViews, PlotNamesWhatIsWrong) {
  if (!HPCTRIAL_WITH_PLOT) GTEST_SKIP() << "built with -DHPCTRIAL_PLOT=OFF";
  ASSERT_TRUE(run_->ok()) << run_->describe();
  const auto metric = plot({experiment_, "--metric", "perplexity"});
  EXPECT_EQ(metric.exit_code, 2);
  EXPECT_THAT(metric.err, HasSubstr("no trial reported the metric 'perplexity'"));
  EXPECT_THAT(metric.err, HasSubstr("validation/accuracy"));
  const auto format = plot({experiment_, "-o", (dir_->path() / "grid.jpg").string()});
  EXPECT_EQ(format.exit_code, 2);
  EXPECT_THAT(format.err, HasSubstr("use .png or .svg"));
  const auto trial = plot({experiment_, "--trial", "5"});
  EXPECT_EQ(trial.exit_code, 2);
  EXPECT_THAT(trial.err, HasSubstr("has 2 trial(s)"));
  const auto where = plot({experiment_, "-o", "/nonexistent-dir/x.png"});
  EXPECT_EQ(where.exit_code, 1);
  EXPECT_THAT(where.err, HasSubstr("/nonexistent-dir/x.png"));
}

// A build without PLplot has no plot verb, and says so.
TEST(PlotVerb, ABuildWithoutPlplotSaysItHasNone) {
  if (HPCTRIAL_WITH_PLOT) GTEST_SKIP() << "built with PLplot";
  const auto r = core::run_process({HPCTRIAL_CLI, "plot", "somewhere"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("built without PLplot (-DHPCTRIAL_PLOT=OFF)"));
  EXPECT_THAT(r.err, HasSubstr("tensorboard --logdir EXPDIR"));
}

}  // namespace
}  // namespace hpctrial
