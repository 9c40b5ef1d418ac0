// hpctrial report, opened in a real browser (Debian's chromium, headless): for a single trial, a
// grid search, an adaptive search and a failed trial, the page loads with no console message,
// its tables and charts are in the DOM the browser built, and a screenshot is taken (kept in the
// test's directory as HPCTRIAL_REPORT_SHOTS says, to be looked at).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <regex>
#include <string>

#include "../support/read_file.h"
#include "hpctrial/core/subprocess.h"
#include "launcher_fixture.h"

namespace hpctrial {
namespace report_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using testing::Not;
using testing_launcher::Launcher;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

constexpr const char* kChromium = "/usr/bin/chromium";

class Report : public Launcher {
 protected:
  void SetUp() override {
    if (!fs::exists(kChromium)) GTEST_SKIP() << "no " << kChromium << " (scripts/install-deps.sh installs it)";
  }

  // The report of the experiment in `dir`, as chromium builds its DOM; its console on stderr.
  struct Opened {
    std::string dom, console;
  };
  Opened open_report(const std::string& dir, const std::string& name) {
    const std::string page = (dir_.path() / (name + ".html")).string();
    const auto wrote = core::run_process({HPCTRIAL_CLI, "report", dir, "-o", page});
    EXPECT_EQ(wrote.exit_code, 0) << wrote.err;
    EXPECT_EQ(wrote.out, "wrote " + page + "\n");
    EXPECT_EQ(fs::status(page).permissions() & fs::perms::others_read, fs::perms::none) << "private";
    core::RunOptions options;
    options.timeout = 120s;
    options.env_set = {{"HOME", (dir_.path() / "home").string()}};
    const std::vector<std::string> browser = {kChromium, "--headless", "--no-sandbox", "--disable-gpu",
                                              "--disable-dev-shm-usage", "--no-first-run", "--enable-logging=stderr",
                                              "--v=0", "--user-data-dir=" + (dir_.path() / ("profile-" + name)).string()};
    auto dump = browser;
    dump.insert(dump.end(), {"--dump-dom", "file://" + page});
    const auto dom = core::run_process(dump, options);
    EXPECT_EQ(dom.exit_code, 0) << dom.err;
    const char* shots = std::getenv("HPCTRIAL_REPORT_SHOTS");
    const std::string shot = (shots != nullptr ? std::string(shots) : dir_.path().string()) + "/" + name + ".png";
    auto screenshot = browser;
    screenshot.insert(screenshot.end(), {"--screenshot=" + shot, "--window-size=1280,1600", "file://" + page});
    const auto taken = core::run_process(screenshot, options);
    EXPECT_EQ(taken.exit_code, 0) << taken.err;
    EXPECT_GT(fs::exists(shot) ? fs::file_size(shot) : 0, 10000u) << "a screenshot of the page";
    return {dom.out, dom.err};
  }

  static void expect_loaded(const Opened& o) {
    EXPECT_THAT(o.dom, HasSubstr("<table id=\"ranking\">"));
    EXPECT_THAT(o.dom, HasSubstr("<pre id=\"config\">"));
    // Chromium prints each console message as "CONSOLE(line)" or "Console" in its log.
    EXPECT_THAT(o.console, Not(testing::ContainsRegex("CONSOLE|Uncaught|console")));
  }

  static int count(const std::string& text, const std::string& what) {
    int n = 0;
    for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  }
};

TEST_F(Report, ASingleTrialAndAFailedTrial) {
  auto p = run(config("", 60, 1));
  ASSERT_EQ(p->exit_code(), 0) << p->output();
  Opened o = open_report(experiment(), "single");
  expect_loaded(o);
  EXPECT_EQ(count(o.dom, "<section class=\"trial\""), 1);
  EXPECT_GE(count(o.dom, "<svg class=\"chart\""), 2) << "training and validation metrics";
  EXPECT_THAT(o.dom, HasSubstr("training: loss"));
  EXPECT_THAT(o.dom, HasSubstr("<table id=\"runs-0\">"));
  EXPECT_THAT(o.dom, Not(HasSubstr("id=\"failures-0\"")));

  fs::remove_all(experiment());
  p = run(config("max_restarts: 0\n", 60, 2, 0, ""), "rank1:step5:throw");
  ASSERT_NE(p->exit_code(), 0) << p->output();
  o = open_report(experiment(), "failed");
  expect_loaded(o);
  EXPECT_THAT(o.dom, HasSubstr("<table id=\"failures-0\">"));
  EXPECT_THAT(o.dom, HasSubstr("injected fault rank1:step5:throw"));
}

TEST_F(Report, AGridAndAnAdaptiveSearch) {
  const std::string grid = dir_.write("grid.yaml",
      "name: grid\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
      "searcher: {name: grid, metric: validation_loss, max_length: {batches: 40}}\n"
      "hyperparameters: {global_batch_size: 16, fail_rank: -1, fail_batch: 0, fail_mode: none,\n"
      "                  lr: {type: categorical, vals: [0.5, 0.25, 0.125]}}\n"
      "resources: {slots_per_trial: 1}\nreproducibility: {experiment_seed: 7}\n");
  auto p = run(grid);
  ASSERT_EQ(p->exit_code(), 0) << p->output();
  Opened o = open_report(experiment(), "grid");
  expect_loaded(o);
  EXPECT_EQ(count(o.dom, "<section class=\"trial\""), 3);
  EXPECT_EQ(count(o.dom, "<a href=\"#t-"), 3) << "each trial ranked, linked to its section";
  EXPECT_THAT(o.dom, HasSubstr("lr=0.125"));

  const std::string asha = dir_.write("asha.yaml",
      "name: asha\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
      "searcher: {name: adaptive_asha, metric: validation_loss, max_length: {batches: 64}, max_trials: 6,\n"
      "           max_rungs: 2, divisor: 4, max_concurrent_trials: 1}\n"
      "hyperparameters: {global_batch_size: 16, fail_rank: -1, fail_batch: 0, fail_mode: none,\n"
      "                  lr: {type: log, base: 10, minval: -3, maxval: -1}}\n"
      "min_validation_period: {batches: 100000}\n"
      "resources: {slots_per_trial: 1}\nreproducibility: {experiment_seed: 7}\n");
  const std::string searched = (dir_.path() / "asha").string();
  p = run(asha, "", {"--experiment", searched}, 300s);
  ASSERT_EQ(p->exit_code(), 0) << p->output();
  o = open_report(searched, "asha");
  expect_loaded(o);
  EXPECT_THAT(o.dom, HasSubstr("<table id=\"search\">"));
  EXPECT_GE(count(o.dom, "<td>rung</td>"), 6) << "each trial reached its first rung";
  EXPECT_GE(count(o.dom, "<section class=\"trial\""), 6);
}

}  // namespace report_test
}  // namespace hpctrial
