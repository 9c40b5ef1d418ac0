// An elastic job on the real local Slurm cluster (scripts/local-slurm.sh): submitted with a range
// of nodes to the two-node partition `elastic`, it runs on both; the partition is then cut to one
// node and the job requeued, and it resumes on the one node it is granted and finishes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "../support/slurm_jobs.h"
#include "../support/json_lines.h"
#include "../support/temp_dir.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial {
namespace {

using namespace std::chrono_literals;
using testing::HasSubstr;
using testing_support::json_lines;
using testing_support::TempDir;

using testing_support::job_field;
core::RunResult run(const std::vector<std::string>& argv) { return testing_support::run_command(argv); }
bool wait_for(const std::string& job, const std::string& state, std::chrono::seconds limit) {
  return testing_support::wait_for_state(job, state, limit);
}

class SlurmElastic : public testing::Test {
 protected:
  void SetUp() override {
    const auto nodes = run({"sinfo", "-h", "-p", "elastic", "-o", "%D"});
    if (!nodes.ok()) GTEST_SKIP() << "no local Slurm cluster answers (scripts/local-slurm.sh needs root)";
    if (nodes.out.find('2') == std::string::npos) GTEST_SKIP() << "the local cluster has no two-node partition `elastic`";
    const auto list = run({"sinfo", "-h", "-p", "elastic", "-o", "%N"});
    nodes_ = list.out.substr(0, list.out.find('\n'));
    const auto hostname = run({"hostname", "-s"});
    host_ = hostname.out.substr(0, hostname.out.find('\n'));
  }
  void TearDown() override {
    if (!nodes_.empty()) run({"scontrol", "update", "partitionname=elastic", "nodes=" + nodes_});
  }
  std::string nodes_;
  std::string host_;
  TempDir dir_;
};

TEST_F(SlurmElastic, AJobWithANodeRangeResumesOnTheNodesItIsGrantedAfterARequeue) {
  const std::string config = dir_.write("exp.yaml",
      "name: slurm-elastic\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
      "searcher: {name: single, metric: validation_loss, max_length: {batches: 3000}}\n"
      "hyperparameters: {global_batch_size: 16, fail_rank: -1, fail_batch: 0, fail_mode: none, batch_ms: 2}\n"
      "resources: {slots_per_trial: 2, slots_per_node: 1, min_slots_per_trial: 1}\n"
      "min_checkpoint_period: {batches: 200}\n"
      "scheduler: {type: slurm, partition: elastic, time_limit: 30m, preemption_grace: 20s}\n");
  const std::string experiment = (dir_.path() / "exp").string();
  const auto submitted = run({HPCTRIAL_CLI, "submit", config, "--experiment", experiment});
  ASSERT_TRUE(submitted.ok()) << submitted.describe() << submitted.err;
  const auto at = submitted.out.find("submitted slurm job ");
  ASSERT_NE(at, std::string::npos) << submitted.out;
  const std::size_t start = at + std::strlen("submitted slurm job ");
  const std::string job = submitted.out.substr(start, submitted.out.find('\n', start) - start);
  ASSERT_TRUE(wait_for(job, "RUNNING", 60s)) << job_field(job, "JobState");
  EXPECT_EQ(job_field(job, "NumNodes"), "2");

  // Trained a while on 2 ranks, then the partition shrinks and the job is requeued.
  const std::string runs = experiment + "/trial-0/runs.jsonl";
  const auto until = std::chrono::steady_clock::now() + 90s;
  while (std::chrono::steady_clock::now() < until) {
    std::ifstream latest(experiment + "/trial-0/checkpoints/latest");
    if (latest.good() && json_lines(runs).size() == 1) break;
    std::this_thread::sleep_for(200ms);
  }
  ASSERT_EQ(json_lines(runs).size(), 1u);
  const auto shrink = run({"scontrol", "update", "partitionname=elastic", "nodes=" + host_});
  ASSERT_TRUE(shrink.ok()) << shrink.describe() << shrink.err;
  const auto requeue = run({"scontrol", "requeue", job});
  ASSERT_TRUE(requeue.ok()) << requeue.describe() << requeue.err;
  ASSERT_TRUE(wait_for(job, "COMPLETED", 240s)) << "state " << job_field(job, "JobState");
  EXPECT_EQ(job_field(job, "NumNodes"), "1");
  // The first run's launcher saw its ranks' stop through, though Open MPI's finalize waits on a
  // daemon that the requeue's SIGTERM also reached (Slurm would SIGKILL it at KillWait).
  std::ifstream err_in(experiment + "/slurm-" + job + ".err");
  const std::string err((std::istreambuf_iterator<char>(err_in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(err, HasSubstr("trial 0 stopped (terminate) after a durable checkpoint")) << err;

  const auto lines = json_lines(runs);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["ranks"], 2);
  EXPECT_EQ(lines[0]["batches"], 0);
  EXPECT_EQ(lines[1]["ranks"], 1);
  EXPECT_GT(lines[1]["batches"].get<std::int64_t>(), 0) << "the second run started afresh";
  EXPECT_EQ(lines[1]["batch"], 16);
  std::ifstream latest(experiment + "/trial-0/checkpoints/latest");
  std::string published((std::istreambuf_iterator<char>(latest)), std::istreambuf_iterator<char>());
  EXPECT_THAT(published, HasSubstr("ckpt-3000.h5"));
  const auto describe = run({HPCTRIAL_CLI, "describe", experiment});
  ASSERT_TRUE(describe.ok()) << describe.describe() << describe.err;
  EXPECT_THAT(describe.out, HasSubstr("resources:   1 to 2 slot(s) per trial on 1 to 2 node(s)"));
  EXPECT_THAT(describe.out, HasSubstr("run 1:       2 rank(s), batch 16 (8 x 1 x 2), from batch 0"));
  EXPECT_THAT(describe.out, HasSubstr("run 2:       1 rank(s), batch 16 (16 x 1 x 1), from batch "));
}

}  // namespace
}  // namespace hpctrial
