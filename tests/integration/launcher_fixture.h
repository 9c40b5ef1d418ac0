// The fixture of the launcher's integration tests: `hpctrial run` of the faulty trial (which
// fails only through HPCTRIAL_FAULT) in a temporary directory, with its output, failure records
// and heartbeats at hand.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../support/background_process.h"
#include "../support/temp_dir.h"

namespace hpctrial::testing_launcher {

using nlohmann::json;
using testing_support::BackgroundProcess;
using testing_support::processes_running;
using testing_support::TempDir;
using namespace std::chrono_literals;

class Launcher : public testing::Test {
 protected:
  // An experiment of the faulty trial (which only fails through HPCTRIAL_FAULT here).
  // `hparams`: more hyperparameters, e.g. ", full_validation: true".
  std::string config(const std::string& extra, std::int64_t batches = 100000, int ranks = 2, int batch_ms = 0,
                     const std::string& hparams = "") {
    return dir_.write("exp.yaml",
        "name: launched\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
        "searcher: {name: single, metric: validation_loss, max_length: {batches: " + std::to_string(batches) + "}}\n"
        "hyperparameters: {global_batch_size: 16, fail_rank: -1, fail_batch: 0, fail_mode: none, batch_ms: " +
        std::to_string(batch_ms) + hparams + "}\n"
        "resources: {slots_per_trial: " + std::to_string(ranks) + "}\n"
        "reproducibility: {experiment_seed: 7}\n" + extra);
  }
  std::string experiment() const { return (dir_.path() / "exp").string(); }
  std::string trial() const { return experiment() + "/trial-0"; }

  std::vector<std::pair<std::string, std::string>> env(const std::string& fault = "") const {
    // A TMPDIR of the test's own: Open MPI's session directories (expect_no_rank_left).
    std::filesystem::create_directories(dir_.path() / "tmp");
    std::vector<std::pair<std::string, std::string>> e = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"},
                                                          {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
                                                          {"TMPDIR", (dir_.path() / "tmp").string()}};
    if (!fault.empty()) e.emplace_back("HPCTRIAL_FAULT", fault);
    e.insert(e.end(), extra_env_.begin(), extra_env_.end());
    return e;
  }

  std::unique_ptr<BackgroundProcess> start(const std::string& config_path, const std::string& fault = "",
                                           std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = wrapper_;
    argv.insert(argv.end(), {HPCTRIAL_CLI, "run", config_path, "--oversubscribe"});
    if (std::find(extra.begin(), extra.end(), "--experiment") == extra.end()) {
      argv.insert(argv.end(), {"--experiment", experiment()});
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<BackgroundProcess>(argv, env(fault),
                                               (dir_.path() / ("out-" + std::to_string(++runs_) + ".txt")).string());
  }

  // Runs to the end (at most `limit`) and returns the process.
  std::unique_ptr<BackgroundProcess> run(const std::string& config_path, const std::string& fault = "",
                                         std::vector<std::string> extra = {}, std::chrono::seconds limit = 120s) {
    auto p = start(config_path, fault, std::move(extra));
    EXPECT_TRUE(p->wait(limit).has_value()) << "hpctrial run did not end within " << limit.count() << " s:\n"
                                            << p->output();
    return p;
  }

  std::vector<json> failures() const {
    std::vector<json> out;
    std::ifstream in(trial() + "/failures.jsonl");
    for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
    return out;
  }

  // The last step a rank reported, or -1.
  long long heartbeat(int rank) const {
    std::ifstream in(trial() + "/launch/heartbeat/rank-" + std::to_string(rank));
    std::string word;
    long long step = -1;
    if (in >> word >> step) return step;
    return -1;
  }
  void wait_for_step(long long step, int rank = 0) const {
    const auto until = std::chrono::steady_clock::now() + 60s;
    while (heartbeat(rank) < step && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(20ms);
    ASSERT_GE(heartbeat(rank), step) << "the ranks never reached step " << step;
  }

  // No rank of this test's trial may outlive the launcher (ranks of other tests may run).
  void expect_no_rank_left(bool session_dirs = true) const {
    const std::string mine = "HPCTRIAL_EXPERIMENT_DIR=" + experiment();
    const auto until = std::chrono::steady_clock::now() + 1s;
    while (!processes_running(HPCTRIAL_FAULTY_TRIAL, mine).empty() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(20ms);
    }
    EXPECT_TRUE(processes_running(HPCTRIAL_FAULTY_TRIAL, mine).empty()) << "a rank outlived the launcher";
    // Nor an mpirun's session directory (<TMPDIR>/ompi.<host>.<uid>/pid.<pid>), which a killed
    // mpirun leaves: the launcher removes it.
    std::error_code ec;
    if (!session_dirs) return;
    for (const auto& top : std::filesystem::directory_iterator(dir_.path() / "tmp", ec)) {
      for (const auto& session : std::filesystem::directory_iterator(top.path(), ec)) {
        ADD_FAILURE() << "an Open MPI session directory was left: " << session.path();
      }
    }
  }

  TempDir dir_;
  int runs_ = 0;
  std::vector<std::pair<std::string, std::string>> extra_env_;  // for every run of the test
  std::vector<std::string> wrapper_;  // what runs `hpctrial run`, e.g. salloc; empty: nothing
};

}  // namespace hpctrial::testing_launcher
