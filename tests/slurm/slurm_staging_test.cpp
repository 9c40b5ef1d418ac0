// data.stage on the real local Slurm cluster's two-node partition `elastic`, one rank a node: the
// data is copied once on each node by that node's rank, each rank reads its own node's copy, a
// pause and activate (the same job requeued) reuses both copies, and the complete trial leaves
// none.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <thread>

#include "../support/read_file.h"
#include "../support/slurm_jobs.h"
#include "../support/inference_files.h"
#include "../support/temp_dir.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using testing::HasSubstr;
using testing_support::job_field;
using testing_support::read_file;
using testing_support::TempDir;

core::RunResult run(const std::vector<std::string>& argv) { return testing_support::run_command(argv); }

int count_of(const std::string& text, const std::string& needle) {
  int n = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

class SlurmStaging : public testing::Test {
 protected:
  void SetUp() override {
    const auto list = run({"sinfo", "-h", "-p", "elastic", "-o", "%N"});
    if (!list.ok()) GTEST_SKIP() << "no local Slurm cluster answers (scripts/local-slurm.sh needs root)";
    const std::string nodes = list.out.substr(0, list.out.find('\n'));
    const auto comma = nodes.find(',');
    if (comma == std::string::npos) GTEST_SKIP() << "the local cluster has no two-node partition `elastic`: " << nodes;
    nodes_ = {nodes.substr(0, comma), nodes.substr(comma + 1)};
    fs::create_directories(dir_.path() / "data" / "set");
    std::ofstream(dir_.path() / "data" / "table.txt") << "the source's first line\n";
    std::ofstream(dir_.path() / "data" / "set" / "a.bin") << std::string(1 << 20, 'a');
    fs::create_directories(local());
  }
  std::string experiment() const { return (dir_.path() / "exp").string(); }
  fs::path local() const { return dir_.path() / "local"; }
  long long heartbeat() const {
    std::ifstream in(experiment() + "/trial-0/launch/heartbeat/rank-0");
    std::string word;
    long long step = -1;
    if (in >> word >> step) return step;
    return -1;
  }
  std::vector<std::string> nodes_;
  TempDir dir_;
};

TEST_F(SlurmStaging, EachNodeCopiesOnceItsRankReadsItAndTheRequeuedJobReusesIt) {
  const std::string data = (dir_.path() / "data").string();
  const std::string config = dir_.write("exp.yaml",
      "name: slurm-staging\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
      "searcher: {name: single, metric: validation_loss, max_length: {batches: 2000}}\n"
      "hyperparameters: {global_batch_size: 16, fail_rank: -1, fail_batch: 0, fail_mode: none, batch_ms: 5}\n"
      "resources: {slots_per_trial: 2, slots_per_node: 1}\n"
      "min_checkpoint_period: {batches: 100}\n"
      "data: {table: " + data + "/table.txt, set: " + data + "/set, stage: {to: " + local().string() + "}}\n"
      "scheduler: {type: slurm, partition: elastic, time_limit: 30m}\n");
  const auto submitted = run({HPCTRIAL_CLI, "submit", config, "--experiment", experiment()});
  ASSERT_TRUE(submitted.ok()) << submitted.describe() << submitted.err;
  const std::string job = testing_support::submitted_job(submitted.out);
  ASSERT_FALSE(job.empty()) << submitted.out;
  const std::string log_path = experiment() + "/slurm-" + job + ".err";
  ASSERT_TRUE(testing_support::wait_for_state(job, "RUNNING", 60s)) << job_field(job, "JobState");
  const auto until = std::chrono::steady_clock::now() + 90s;
  while (heartbeat() < 150 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(100ms);
  ASSERT_GE(heartbeat(), 150) << read_file(log_path);

  const auto pause = run({HPCTRIAL_CLI, "pause", job});
  ASSERT_TRUE(pause.ok()) << pause.describe() << pause.err;
  ASSERT_TRUE(testing_support::wait_for_state(job, "PENDING", 60s)) << job_field(job, "JobState");
  const std::string first = read_file(log_path);
  // One copy on each of MPI's nodes, by one rank there. Here both slurmds run on this host, and
  // the ranks that Open MPI starts beside it on "its" node carry the batch node's Slurm name, so
  // the two nodes may go by one name: the folders then add MPI's node index.
  const std::regex copied("data\\.stage: node (\\S+): data\\.table copied to (\\S+)/data/table/table\\.txt");
  std::vector<std::string> labels;
  std::set<fs::path> folders;
  for (auto it = std::sregex_iterator(first.begin(), first.end(), copied); it != std::sregex_iterator(); ++it) {
    labels.push_back((*it)[1]);
    const fs::path folder = (*it)[2].str();
    folders.insert(folder);
    EXPECT_EQ(folder.parent_path(), local());
    const std::string name = folder.filename().string();
    EXPECT_EQ(name.substr(name.size() - labels.back().size()), labels.back()) << name;
    EXPECT_THAT(labels.back(), testing::AnyOf(testing::StartsWith(nodes_[0]), testing::StartsWith(nodes_[1])));
    EXPECT_TRUE(fs::exists(folder / "data" / "set" / "set" / "a.bin"));
  }
  EXPECT_EQ(labels.size(), 2u) << "one copy a node:\n" << first;
  EXPECT_EQ(folders.size(), 2u) << first;
  std::set<std::string> read;
  const std::regex reads("rank [01] reads (\\S+)/data/table/table\\.txt: the source's first line");
  const std::string out = read_file(experiment() + "/slurm-" + job + ".out");  // the ranks' stdout
  for (auto it = std::sregex_iterator(out.begin(), out.end(), reads); it != std::sregex_iterator(); ++it) {
    read.insert((*it)[1]);
  }
  EXPECT_EQ(read, (std::set<std::string>(folders.begin(), folders.end()))) << "each rank reads its own node's copy";

  const auto activate = run({HPCTRIAL_CLI, "activate", experiment()});
  ASSERT_TRUE(activate.ok()) << activate.describe() << activate.err;
  ASSERT_TRUE(testing_support::wait_for_state(job, "COMPLETED", 180s))
      << "state " << job_field(job, "JobState") << "\n" << read_file(log_path);
  const std::string all = read_file(log_path);
  EXPECT_EQ(count_of(all, ": data.table copied to "), 2) << all;
  for (const auto& label : labels) {
    EXPECT_EQ(count_of(all, "data.stage: node " + label + ": data.table reused "), 1) << all;
    EXPECT_EQ(count_of(all, "data.stage: node " + label + ": data.set reused "), 1) << all;
  }
  EXPECT_THAT(all, HasSubstr("resumed from "));
  for (const auto& folder : folders) EXPECT_FALSE(fs::exists(folder)) << "the complete trial leaves no copies";
}

// launcher.startup_hook on the two-node partition: it runs once on each node, before the ranks,
// its output in the job's log marked with the node; a hook that fails ends the job with its
// status (Slurm's ExitCode), reported as the hook's, and no rank starts.
TEST_F(SlurmStaging, AStartupHookRunsOnceOnEachNodeAndItsFailureIsItsOwn) {
  const auto config = [&](const std::string& name, const std::string& hook) {
    return dir_.write(name + ".yaml",
        "name: " + name + "\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
        "searcher: {name: single, metric: validation_loss, max_length: {batches: 20}}\n"
        "hyperparameters: {global_batch_size: 16, fail_rank: -1, fail_batch: 0, fail_mode: none, batch_ms: 0}\n"
        "resources: {slots_per_trial: 2, slots_per_node: 1}\n"
        "launcher: {startup_hook: '" + hook + "'}\n"
        "scheduler: {type: slurm, partition: elastic, time_limit: 10m}\n");
  };
  const auto submit = [&](const std::string& path, const std::string& dir) {
    const auto submitted = run({HPCTRIAL_CLI, "submit", path, "--experiment", dir});
    EXPECT_TRUE(submitted.ok()) << submitted.describe() << submitted.err;
    return testing_support::submitted_job(submitted.out);
  };
  const std::string good = (dir_.path() / "good").string();
  const std::string job = submit(config("hook-good", "echo hook task $OMPI_COMM_WORLD_RANK of $OMPI_COMM_WORLD_SIZE"), good);
  ASSERT_FALSE(job.empty());
  ASSERT_TRUE(testing_support::wait_for_state(job, "COMPLETED", 180s)) << job_field(job, "JobState");
  const std::string log = read_file(good + "/slurm-" + job + ".err");
  EXPECT_THAT(log, HasSubstr("startup hook on 2 node(s)"));
  EXPECT_EQ(count_of(log, "] hook task "), 2) << log;
  EXPECT_THAT(log, HasSubstr("[startup hook on " + nodes_[0] + "] hook task 0 of 2")) << log;
  EXPECT_THAT(log, HasSubstr("[startup hook on " + nodes_[1] + "] hook task 1 of 2")) << log;
  EXPECT_LT(log.find("] hook task "), log.find("starting 2 rank(s)")) << log;

  const std::string bad = (dir_.path() / "bad").string();
  const std::string failed = submit(config("hook-bad", "echo no scratch on this node >&2; exit 5"), bad);
  ASSERT_FALSE(failed.empty());
  ASSERT_TRUE(testing_support::wait_for_state(failed, "FAILED", 180s)) << job_field(failed, "JobState");
  EXPECT_EQ(job_field(failed, "ExitCode"), "5:0");
  const std::string failed_log = read_file(bad + "/slurm-" + failed + ".err");
  EXPECT_THAT(failed_log, HasSubstr("exited with status 5; the ranks were not started and the trial is not retried"));
  EXPECT_THAT(failed_log, HasSubstr("  no scratch on this node"));
  EXPECT_THAT(failed_log, testing::Not(HasSubstr("starting 2 rank(s)")));
}

// Batch inference submitted to the two-node partition: a rank on each node, each writing its rows
// into the one result file, which equals a run's on this machine byte for byte.
TEST_F(SlurmStaging, BatchInferenceOnTwoNodesWritesWhatARunHereWrites) {
  const std::string data = (dir_.path() / "mlp-data").string();
  ASSERT_TRUE(run({HPCTRIAL_MLP_MAKE_DATASET, data}).ok());
  const std::string trained = (dir_.path() / "trained").string();
  const auto training = testing_support::run_command(
      {HPCTRIAL_CLI, "run", dir_.write("train.yaml", testing_support::mlp_training_yaml("mlp", HPCTRIAL_MLP, data, 60)),
       "--experiment", trained, "--oversubscribe"}, 300s);
  ASSERT_TRUE(training.ok()) << training.describe() << training.err;
  const auto config = [&](const std::string& name, const std::string& extra) {
    return dir_.write(name + ".yaml", testing_support::mlp_inference_yaml(name, HPCTRIAL_MLP, data, trained, extra));
  };
  const std::string here = (dir_.path() / "here").string();
  const auto local = testing_support::run_command(
      {HPCTRIAL_CLI, "run", config("here", "resources: {slots_per_trial: 2}\n"), "--experiment", here,
       "--oversubscribe"}, 300s);
  ASSERT_TRUE(local.ok()) << local.describe() << local.err;

  const std::string there = (dir_.path() / "slurm").string();
  const auto submitted = run({HPCTRIAL_CLI, "submit",
                              config("slurm", "resources: {slots_per_trial: 2, slots_per_node: 1}\n"
                                              "scheduler: {type: slurm, partition: elastic, time_limit: 10m}\n"),
                              "--experiment", there});
  ASSERT_TRUE(submitted.ok()) << submitted.describe() << submitted.err;
  const std::string job = testing_support::submitted_job(submitted.out);
  ASSERT_FALSE(job.empty()) << submitted.out;
  ASSERT_TRUE(testing_support::wait_for_state(job, "COMPLETED", 180s))
      << job_field(job, "JobState") << "\n" << read_file(there + "/slurm-" + job + ".err");
  EXPECT_THAT(read_file(there + "/slurm-" + job + ".err"), HasSubstr("2048 records predicted in this run"));
  testing_support::expect_same_predictions(there + "/trial-0/predictions.h5", here + "/trial-0/predictions.h5");
}

}  // namespace
}  // namespace hpctrial
