// checkpoint_levels.partner on the real local Slurm cluster: a job on the two nodes of the
// partition `elastic` (two slurmds on this host: Open MPI starts a daemon on each, and the ranks
// of each are a node of their own), one rank a node, copies every 10 batches, each also kept by
// the rank on the other node. The node of the chief, and then of the last rank, is lost at batch
// 35 (`nodeloss`: its rank's node memory removed, then SIGKILL); the launcher restarts the ranks
// inside the same job, the rank that lost its copies gets the newest from its partner, and the
// trial ends with the weights of an uninterrupted run. The run records it, and describe says it.
// With resources.spare_nodes, on the three-node partition `spare`: the lost node's rank restarts
// on the spare inside the job; with no spare left, the job goes back to the queue held, without
// the node.
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

#include "../support/read_file.h"
#include "../support/same_weights.h"
#include "../support/slurm_jobs.h"
#include "../support/json_lines.h"
#include "../support/temp_dir.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial {
namespace {

using namespace std::chrono_literals;
using testing::HasSubstr;
using testing_support::json_lines;
using testing_support::job_field;
using testing_support::read_file;
using testing_support::run_command;
using testing_support::TempDir;
namespace fs = std::filesystem;

constexpr std::int64_t kBatches = 120;

class NodeLost : public testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    const auto nodes = run_command({"sinfo", "-h", "-p", "elastic", "-o", "%D"});
    if (!nodes.ok()) GTEST_SKIP() << "no local Slurm cluster answers (scripts/local-slurm.sh needs root)";
    if (nodes.out.find('2') == std::string::npos) GTEST_SKIP() << "the local cluster has no two-node partition `elastic`";
    std::string pattern = "/dev/shm/hpctrial-partner-test-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    shm_ = pattern;
  }
  void TearDown() override {
    if (!job_.empty()) run_command({"scancel", job_});
    std::error_code ec;
    if (!shm_.empty()) fs::remove_all(shm_, ec);
  }
  std::string config(const std::string& name, const std::string& scheduler,
                     const std::string& resources = "{slots_per_trial: 2, slots_per_node: 1}") {
    return dir_.write(name,
        "name: partner\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
        "searcher: {name: single, metric: validation_loss, max_length: {batches: " + std::to_string(kBatches) + "}}\n"
        "hyperparameters: {global_batch_size: 16, fail_rank: -1, fail_batch: 0, fail_mode: none, batch_ms: 5}\n"
        "resources: " + resources + "\n"
        "reproducibility: {experiment_seed: 7}\nmax_restarts: 1\n"
        "min_checkpoint_period: {batches: 100000}\n"
        "checkpoint_levels: {memory: {period: {batches: 10}, dir: " + shm_ + "}, partner: true}\n" + scheduler);
  }
  std::string shm_;
  std::string job_;
  TempDir dir_;
};

TEST_P(NodeLost, ItsRankResumesFromThePartnersCopyInsideTheJob) {
  const int lost = GetParam();
  const int partner = 1 - lost;
  const std::string experiment = (dir_.path() / "exp").string();
  core::RunOptions options;
  options.timeout = 60s;
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
                     {"HPCTRIAL_FAULT", "rank" + std::to_string(lost) + ":step35:restart0:nodeloss"}};
  const auto submitted = core::run_process(
      {HPCTRIAL_CLI, "submit", config("exp.yaml", "scheduler: {type: slurm, partition: elastic, time_limit: 10m}\n"),
       "--experiment", experiment}, options);
  ASSERT_TRUE(submitted.ok()) << submitted.describe() << submitted.err;
  job_ = testing_support::submitted_job(submitted.out);
  ASSERT_FALSE(job_.empty()) << submitted.out;
  const std::string log = experiment + "/slurm-" + job_ + ".err";
  ASSERT_TRUE(testing_support::wait_for_state(job_, "COMPLETED", 240s))
      << "state " << job_field(job_, "JobState") << "\n" << read_file(log);
  EXPECT_EQ(job_field(job_, "NumNodes"), "2");
  EXPECT_EQ(job_field(job_, "Restarts"), "0") << "recovered inside the job, not requeued";
  const std::string out = read_file(log);
  EXPECT_THAT(out, HasSubstr("checkpoint_levels.partner: each rank's copies also go to a rank on the next of the 2 "
                             "nodes (rank 0's to rank 1)"));
  // Batch 30's copy, or 20's when the rank died before its copy of 30 reached the partner (the
  // exchange runs beside training: batch 35 may come first).
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("checkpoint_levels\\.partner: the copies of batch (\\d+) of 1 rank\\(s\\) "
                                                   "came from their partners \\(rank " + std::to_string(lost) +
                                                   "'s from rank " + std::to_string(partner) + "\\)")))
      << out;
  const std::string batch = m[1];
  EXPECT_TRUE(batch == "30" || batch == "20") << batch;
  EXPECT_THAT(out, HasSubstr("after " + batch + " batches"));
  // The run records the level it resumed from and which rank's copy came from which partner.
  const auto lines = json_lines(experiment + "/trial-0/runs.jsonl");
  ASSERT_EQ(lines.size(), 2u) << out;
  EXPECT_EQ(lines[1]["resumed_from"]["level"], "partner");
  EXPECT_EQ(lines[1]["resumed_from"]["from_partners"],
            nlohmann::json::parse("[{\"rank\": " + std::to_string(lost) + ", \"partner\": " + std::to_string(partner) + "}]"));
  const auto described = run_command({HPCTRIAL_CLI, "describe", experiment});
  EXPECT_THAT(described.out, HasSubstr("from batch " + batch + " (its copies in node memory, some from the partners of "
                                       "ranks that lost theirs)")) << described.out << described.err;
  // The trial ended: its copies, its own and its partners', went with it.
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(shm_, ec)) {
    EXPECT_FALSE(e.path().filename().string().rfind("slot-", 0) == 0) << e.path();
  }

  // The same trial uninterrupted, on this machine.
  const std::string straight = (dir_.path() / "straight").string();
  const auto plain = run_command({HPCTRIAL_CLI, "run", config("plain.yaml", "scheduler: {type: local}\n"),
                                  "--experiment", straight}, 300s);
  ASSERT_TRUE(plain.ok()) << plain.describe() << plain.err;
  testing_support::expect_same_weights(straight + "/trial-0/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5",
                                       experiment + "/trial-0/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5");
}

INSTANTIATE_TEST_SUITE_P(ChiefAndLastRank, NodeLost, testing::Values(0, 1),
                         [](const testing::TestParamInfo<int>& info) { return "rank" + std::to_string(info.param); });

// resources.spare_nodes on the three-node partition `spare`.
class SpareNode : public NodeLost {
 protected:
  void SetUp() override {
    const auto nodes = run_command({"sinfo", "-h", "-p", "spare", "-o", "%D"});
    if (!nodes.ok()) GTEST_SKIP() << "no local Slurm cluster answers (scripts/local-slurm.sh needs root)";
    if (nodes.out.find('3') == std::string::npos) GTEST_SKIP() << "the local cluster has no three-node partition `spare`";
    NodeLost::SetUp();
  }
  std::string submit(const std::string& config_path, const std::string& fault) {
    core::RunOptions options;
    options.timeout = 60s;
    options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
                       {"HPCTRIAL_FAULT", fault}};
    const auto submitted = core::run_process({HPCTRIAL_CLI, "submit", config_path, "--experiment", experiment()}, options);
    EXPECT_TRUE(submitted.ok()) << submitted.describe() << submitted.err;
    job_ = testing_support::submitted_job(submitted.out);
    return job_;
  }
  std::string experiment() const { return (dir_.path() / "exp").string(); }
};

// Two ranks on two nodes and a spare: the node of the chief, then of the last rank, is lost; the
// spare takes its rank inside the job (no requeue), the rank gets its copies from its partner,
// and the trial ends as an uninterrupted run. The failure record, the log and describe name the
// node and the spare.
TEST_P(SpareNode, TakesTheRanksOfALostNodeInsideTheJob) {
  const int lost = GetParam();
  const std::string exp = config("exp.yaml", "scheduler: {type: slurm, partition: spare, time_limit: 10m}\n",
                                 "{slots_per_trial: 2, slots_per_node: 1, spare_nodes: 1}");
  ASSERT_FALSE(submit(exp, "rank" + std::to_string(lost) + ":step35:restart0:nodeloss").empty());
  const std::string log = experiment() + "/slurm-" + job_ + ".err";
  ASSERT_TRUE(testing_support::wait_for_state(job_, "COMPLETED", 240s))
      << "state " << job_field(job_, "JobState") << "\n" << read_file(log);
  EXPECT_EQ(job_field(job_, "NumNodes"), "3");
  EXPECT_EQ(job_field(job_, "Restarts"), "0") << "recovered inside the job, not requeued";
  const auto records = json_lines(experiment() + "/trial-0/failures.jsonl");
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0]["rank"], lost);
  const std::string node = records[0].value("left_out_node", "");
  const std::string spare = records[0].value("spare_node", "");
  EXPECT_EQ(records[0].value("node", ""), node);
  ASSERT_FALSE(node.empty());
  ASSERT_FALSE(spare.empty());
  EXPECT_NE(node, spare);
  const std::string out = read_file(log);
  EXPECT_THAT(out, HasSubstr("the ranks failed on node " + node + ": spare node " + spare + " takes its ranks inside job " +
                             job_ + " (0 spare node(s) left)"));
  EXPECT_THAT(out, HasSubstr("came from their partners (rank " + std::to_string(lost) + "'s from rank " +
                             std::to_string(1 - lost) + ")"));
  const auto runs = json_lines(experiment() + "/trial-0/runs.jsonl");
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[1]["resumed_from"]["level"], "partner");
  const auto described = run_command({HPCTRIAL_CLI, "describe", experiment()});
  EXPECT_THAT(described.out, HasSubstr("spare node:  " + spare + " took the ranks of node " + node + " in job " + job_))
      << described.out;

  const std::string straight = (dir_.path() / "straight").string();
  const auto plain = run_command({HPCTRIAL_CLI, "run", config("plain.yaml", "scheduler: {type: local}\n"),
                                  "--experiment", straight}, 300s);
  ASSERT_TRUE(plain.ok()) << plain.describe() << plain.err;
  testing_support::expect_same_weights(straight + "/trial-0/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5",
                                       experiment() + "/trial-0/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5");
}

INSTANTIATE_TEST_SUITE_P(ChiefAndLastRank, SpareNode, testing::Values(0, 1),
                         [](const testing::TestParamInfo<int>& info) { return "rank" + std::to_string(info.param); });

// One rank a node and one spare: the rank's node fails, the spare takes it; the spare's node
// fails too, and with no spare left the job goes back to the queue (requeued held, the node put
// in its ExcNodeList, released), resumes on the nodes left and finishes.
TEST_F(SpareNode, WithNoSpareLeftTheJobIsRequeuedHeldWithoutTheNode) {
  const std::string exp = dir_.write("one.yaml",
      "name: spare\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
      "searcher: {name: single, metric: validation_loss, max_length: {batches: " + std::to_string(kBatches) + "}}\n"
      "hyperparameters: {global_batch_size: 16, fail_rank: -1, fail_batch: 0, fail_mode: none, batch_ms: 5}\n"
      "resources: {slots_per_trial: 1, slots_per_node: 1, spare_nodes: 1}\n"
      "max_restarts: 3\nmin_checkpoint_period: {batches: 10}\n"
      "scheduler: {type: slurm, partition: spare, time_limit: 10m}\n");
  ASSERT_FALSE(submit(exp, "rank0:step35:restart0:sigkill,rank0:step35:restart1:sigkill").empty());
  const std::string log = experiment() + "/slurm-" + job_ + ".err";
  ASSERT_TRUE(testing_support::wait_for_state(job_, "RUNNING", 60s)) << job_field(job_, "JobState");
  const std::string failures = experiment() + "/trial-0/failures.jsonl";
  const auto until = std::chrono::steady_clock::now() + 240s;
  // The hand-over requeues the job held, then sets its ExcNodeList, then releases it: the test
  // waits for the last of these, not the first.
  const auto handed_over = [&] {
    const std::string excluded = job_field(job_, "ExcNodeList");
    return json_lines(failures).size() >= 2 && job_field(job_, "Restarts") == "1" && !excluded.empty() &&
           excluded != "(null)";
  };
  while (!handed_over() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(300ms);
  }
  ASSERT_EQ(job_field(job_, "Restarts"), "1") << "requeued once\n" << read_file(log);
  const auto records = json_lines(failures);
  ASSERT_EQ(records.size(), 2u) << read_file(log);
  const std::string spare = records[0].value("spare_node", "");
  ASSERT_FALSE(spare.empty()) << records[0].dump();
  EXPECT_EQ(records[1].value("node", ""), spare);
  EXPECT_EQ(records[1].value("left_out_node", ""), spare);
  EXPECT_FALSE(records[1].contains("spare_node"));
  EXPECT_EQ(job_field(job_, "ExcNodeList"), spare);
  const auto described = run_command({HPCTRIAL_CLI, "describe", experiment()});
  EXPECT_THAT(described.out, HasSubstr("left out:    node " + spare + " (job " + job_ +
                                       "), the ranks having failed on it with no spare node left"))
      << described.out;
  ASSERT_TRUE(testing_support::wait_for_state(job_, "COMPLETED", 240s))
      << "state " << job_field(job_, "JobState") << "\n" << read_file(log);
  EXPECT_EQ(read_file(experiment() + "/trial-0/checkpoints/latest").find("ckpt-" + std::to_string(kBatches) + ".h5") !=
                std::string::npos,
            true);
}

}  // namespace
}  // namespace hpctrial
