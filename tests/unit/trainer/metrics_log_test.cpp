// The trainer's internals that users see: metrics.jsonl lines, progress lines, phase timings,
// and the prefetcher's order and errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <fstream>
#include <thread>

#include <torch/torch.h>

#include "observe/metrics_log.h"
#include "hpctrial/trainer/data.h"
#include "../../support/temp_dir.h"
#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {
namespace metrics_log_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using testing::MatchesRegex;
using testing_support::TempDir;

TEST(MetricsLog, OnePrivateJsonObjectPerLine) {
  TempDir dir;
  const std::string path = (dir.path() / "metrics.jsonl").string();
  {
    MetricsLog log(path);
    log.write("training", 100, 1, 6400, {{"loss", 0.25}});
    log.write("validation", 100, 1, 6400, {{"accuracy", 0.9}, {"bad", std::nan("")}});
    log.write("timings", 100, 1, 6400, {}, {{"timings", {{"train_batch", {{"total_s", 1.5}}}}}});
  }
  std::ifstream in(path);
  std::vector<nlohmann::json> lines;
  std::string line;
  while (std::getline(in, line)) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0]["kind"], "training");
  EXPECT_EQ(lines[0]["batches"], 100);
  EXPECT_EQ(lines[0]["epoch"], 1);
  EXPECT_EQ(lines[0]["records"], 6400);
  EXPECT_EQ(lines[0]["metrics"]["loss"], 0.25);
  EXPECT_THAT(lines[0]["time"].get<std::string>(), MatchesRegex("[0-9-]+T[0-9:.]+Z"));
  EXPECT_EQ(lines[1]["metrics"]["bad"], "NaN");
  EXPECT_EQ(lines[2]["timings"]["train_batch"]["total_s"], 1.5);
  struct stat info {};
  ASSERT_EQ(::stat(path.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0600u);
  // Appending continues the file.
  MetricsLog(path).write("training", 200, 2, 12800, {});
  std::ifstream again(path);
  int count = 0;
  while (std::getline(again, line)) ++count;
  EXPECT_EQ(count, 4);
}

// Every value a metric can take, written as metrics.jsonl writes it and read back: NaN and the
// infinities alone and inside arrays and objects.
TEST(MetricValue, EveryValueRoundTripsThroughItsJson) {
  const double nan = std::nan(""), inf = std::numeric_limits<double>::infinity();
  const MetricValue number(0.25), not_a_number(nan);
  const MetricValue vector(std::vector<double>{1.0, nan, -inf});
  const MetricValue matrix(nlohmann::json{{"tp", {{1, 2}, {3, 4}}}, {"note", "text"}});
  EXPECT_TRUE(number.is_number());
  EXPECT_EQ(static_cast<double>(number), 0.25);
  EXPECT_EQ(number.to_json(), 0.25);
  EXPECT_EQ(not_a_number.to_json(), "NaN");
  EXPECT_TRUE(std::isnan(MetricValue(not_a_number.to_json()).number()));
  EXPECT_FALSE(vector.is_number());
  EXPECT_EQ(vector.to_json(), nlohmann::json::parse(R"([1.0, "NaN", "-Infinity"])"));
  const MetricValue back(vector.to_json());
  ASSERT_EQ(back.value().size(), 3u);
  EXPECT_TRUE(std::isnan(back.value()[1].get<double>()));
  EXPECT_EQ(back.value()[2].get<double>(), -inf);
  EXPECT_EQ(MetricValue(matrix.to_json()).value(), matrix.value());
  EXPECT_TRUE(std::isnan(MetricValue(nlohmann::json()).number())) << "null: how NaN was once written";
  try {
    static_cast<void>(static_cast<double>(vector));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr(R"(the metric value [1.0,"NaN","-Infinity"] is not a single number)"));
  }
}

TEST(MetricsLog, MetricsOfSeveralNumbersAreArraysInTheFile) {
  TempDir dir;
  const std::string path = (dir.path() / "metrics.jsonl").string();
  MetricsLog(path).write("validation", 10, 0, 80,
                         {{"per_class", std::vector<double>{0.5, std::nan("")}}, {"loss", 1.5}});
  std::ifstream in(path);
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  EXPECT_EQ(nlohmann::json::parse(line)["metrics"], nlohmann::json::parse(R"({"loss": 1.5, "per_class": [0.5, "NaN"]})"));
}

TEST(MetricsLog, AnUnwritableDirectoryNamesThePath) {
  try {
    MetricsLog log("/nonexistent/dir/metrics.jsonl");
    FAIL();
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot open the metrics file /nonexistent/dir/metrics.jsonl: No such file"));
  }
}

TEST(PhaseTimings, TotalsMeansAndCountsInOrder) {
  PhaseTimings timings;
  timings.add("dataloader_next", std::chrono::milliseconds(2));
  timings.add("train_batch", std::chrono::milliseconds(10));
  timings.add("dataloader_next", std::chrono::milliseconds(4));
  const auto summary = timings.summary();
  EXPECT_NEAR(summary["dataloader_next"]["total_s"].get<double>(), 0.006, 1e-9);
  EXPECT_NEAR(summary["dataloader_next"]["mean_ms"].get<double>(), 3.0, 1e-9);
  EXPECT_EQ(summary["dataloader_next"]["count"], 2);
  const std::string table = timings.table();
  EXPECT_LT(table.find("dataloader_next"), table.find("train_batch"));
  { PhaseTimings::Scope scope(timings, "validation"); }
  EXPECT_EQ(timings.summary()["validation"]["count"], 1);
}

TEST(Progress, PlainLinesWhenNotATerminal) {
  // The test's stderr is captured, not a terminal: one line per report, no carriage return.
  testing::internal::CaptureStderr();
  Progress progress(400, 64, /*interval_s=*/0, /*enabled=*/true);
  progress.update(100, 0, 0.5, true);
  progress.update(200, 1, std::nan(""), true);
  progress.finish();
  const std::string out = testing::internal::GetCapturedStderr();
  EXPECT_EQ(out.find('\r'), std::string::npos);
  EXPECT_THAT(out, HasSubstr("batch 100/400 (25%) | epoch 0 | "));
  EXPECT_THAT(out, HasSubstr(" samples/s | loss 0.5000 | ETA "));
  EXPECT_THAT(out, HasSubstr("batch 200/400 (50%) | epoch 1 | "));
  EXPECT_THAT(out, HasSubstr("loss - |"));
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 2);
}

TEST(Progress, RateLimitedAndSilentWhenDisabled) {
  testing::internal::CaptureStderr();
  Progress limited(10, 1, /*interval_s=*/3600, true);
  Progress silent(10, 1, 0, /*enabled=*/false);
  limited.update(1, 0, 1.0);
  limited.update(2, 0, 1.0);
  silent.update(1, 0, 1.0, true);
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

}  // namespace metrics_log_test
}  // namespace hpctrial::trainer::detail
