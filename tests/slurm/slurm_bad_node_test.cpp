// A node that keeps failing is left out, on the real local Slurm cluster's two-node partition
// `elastic`: the faulty trial fails on node hpctrial-b only (a bad node), on the chief and on the
// last rank, by throwing and by hanging (the collective watchdog names the rank that stopped).
// Its first run lands there (the other node is taken); the restart in the same job fails there
// again; the job goes back to the queue with the node in its ExcNodeList, resumes on the other
// node and finishes. The failure record and describe name the node.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstring>
#include <fstream>
#include <ostream>
#include <thread>

#include "../support/read_file.h"
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
using testing_support::TempDir;

constexpr const char* kBadNode = "hpctrial-b";

core::RunResult run(const std::vector<std::string>& argv) { return testing_support::run_command(argv); }

struct BadNodeCase {
  int rank;
  const char* mode;
};

void PrintTo(const BadNodeCase& c, std::ostream* os) { *os << "rank " << c.rank << " " << c.mode; }

class SlurmBadNode : public testing::TestWithParam<BadNodeCase> {
 protected:
  void SetUp() override {
    const auto list = run({"sinfo", "-h", "-p", "elastic", "-o", "%N"});
    if (!list.ok()) GTEST_SKIP() << "no local Slurm cluster answers (scripts/local-slurm.sh needs root)";
    const std::string nodes = list.out.substr(0, list.out.find('\n'));
    if (nodes.find(kBadNode) == std::string::npos || nodes.find(',') == std::string::npos) {
      GTEST_SKIP() << "the local cluster has no two-node partition `elastic` with " << kBadNode << ": " << nodes;
    }
    good_ = nodes.substr(0, nodes.find(',')) == kBadNode ? nodes.substr(nodes.find(',') + 1)
                                                          : nodes.substr(0, nodes.find(','));
  }
  void TearDown() override {
    if (!blocker_.empty()) run({"scancel", blocker_});
  }
  std::string experiment() const { return (dir_.path() / "exp").string(); }
  std::string good_;
  std::string blocker_;
  TempDir dir_;
};

TEST_P(SlurmBadNode, ANodeTheRanksFailedOnTwiceIsLeftOutAndTheTrialFinishesElsewhere) {
  const int fail_rank = GetParam().rank;
  // The good node is taken, so the first run lands on the bad one.
  const auto blocked = run({"sbatch", "--parsable", "-p", "elastic", "-w", good_, "--exclusive", "-o", "/dev/null",
                            "--wrap", "sleep 300"});
  ASSERT_TRUE(blocked.ok()) << blocked.describe() << blocked.err;
  blocker_ = blocked.out.substr(0, blocked.out.find_first_of(";\n"));
  ASSERT_TRUE(testing_support::wait_for_state(blocker_, "RUNNING", 60s)) << job_field(blocker_, "JobState");

  const std::string config = dir_.write("exp.yaml",
      "name: slurm-bad-node\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
      "searcher: {name: single, metric: validation_loss, max_length: {batches: 60}}\n"
      "hyperparameters: {global_batch_size: 16, fail_rank: " + std::to_string(fail_rank) + ", fail_batch: 30, "
      "fail_mode: " + GetParam().mode + ", fail_node: " + kBadNode + ", batch_ms: 5}\n"
      "resources: {slots_per_trial: 2, slots_per_node: 2}\n"
      "min_checkpoint_period: {batches: 10}\nmin_validation_period: {batches: 30}\nmax_restarts: 4\n"
      "optimizations: {collective_timeout: 5s}\n"
      "scheduler: {type: slurm, partition: elastic, time_limit: 30m, preemption_grace: 20s}\n");
  const auto submitted = run({HPCTRIAL_CLI, "submit", config, "--experiment", experiment()});
  ASSERT_TRUE(submitted.ok()) << submitted.describe() << submitted.err;
  const std::string job = testing_support::submitted_job(submitted.out);
  ASSERT_FALSE(job.empty()) << submitted.out;
  ASSERT_TRUE(testing_support::wait_for_state(job, "RUNNING", 60s)) << job_field(job, "JobState");
  EXPECT_EQ(job_field(job, "NodeList"), kBadNode);
  run({"scancel", blocker_});

  const std::string log_path = experiment() + "/slurm-" + job + ".err";
  ASSERT_TRUE(testing_support::wait_for_state(job, "COMPLETED", 240s))
      << "state " << job_field(job, "JobState") << " " << job_field(job, "Reason") << "\n" << read_file(log_path);
  EXPECT_EQ(job_field(job, "Restarts"), "1");
  EXPECT_EQ(job_field(job, "ExcNodeList"), kBadNode);
  EXPECT_EQ(job_field(job, "NodeList"), good_);
  const std::string log = read_file(log_path);
  EXPECT_THAT(log, HasSubstr("requeued without node " + std::string(kBadNode) + ", where the ranks failed in two attempts"));
  EXPECT_THAT(log, HasSubstr("slurm job " + job + " requeued after run 1 of this job without node(s) " + kBadNode));

  const auto failures = json_lines(experiment() + "/trial-0/failures.jsonl");
  ASSERT_EQ(failures.size(), 2u) << read_file(experiment() + "/trial-0/failures.jsonl");
  for (const auto& failure : failures) {
    EXPECT_EQ(failure["rank"], fail_rank);
    EXPECT_EQ(failure["host"], kBadNode);
  }
  EXPECT_FALSE(failures[0].contains("left_out_node"));
  EXPECT_EQ(failures[1]["left_out_node"], kBadNode);
  const auto runs = json_lines(experiment() + "/trial-0/runs.jsonl");
  ASSERT_FALSE(runs.empty());
  EXPECT_EQ(runs.back()["placement"][0]["host"], good_);
  EXPECT_EQ(runs.back()["placement"][1]["host"], good_);
  EXPECT_THAT(read_file(experiment() + "/trial-0/checkpoints/latest"), HasSubstr("ckpt-60.h5"));

  const auto describe = run({HPCTRIAL_CLI, "describe", experiment()});
  ASSERT_TRUE(describe.ok()) << describe.describe() << describe.err;
  EXPECT_THAT(describe.out, HasSubstr("  left out:    node " + std::string(kBadNode) + " (job " + job +
                                      "), the ranks having failed on it in two attempts"));
}

INSTANTIATE_TEST_SUITE_P(OnTheChiefAndTheLastRank, SlurmBadNode,
                         testing::Values(BadNodeCase{0, "throw"}, BadNodeCase{1, "throw"}, BadNodeCase{0, "hang"},
                                         BadNodeCase{1, "hang"}),
                         [](const testing::TestParamInfo<BadNodeCase>& info) {
                           return std::string(info.param.rank == 0 ? "chief_" : "last_rank_") + info.param.mode;
                         });

}  // namespace
}  // namespace hpctrial
