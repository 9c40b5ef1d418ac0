// The real local Slurm cluster of the test tier (scripts/local-slurm.sh), checked for the
// behaviours hpctrial relies on: a batch job runs and sees its environment, and a requeued job
// runs again with SLURM_RESTART_COUNT=1, and a signal to a job with no batch shell to take it
// is answered at once.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "../support/read_file.h"
#include "../support/temp_dir.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/slurm/client.h"

namespace hpctrial {
namespace {

using namespace std::chrono_literals;
using testing::HasSubstr;
using testing_support::read_file;
using testing_support::TempDir;

core::RunResult slurm(const std::vector<std::string>& argv) {
  core::RunOptions options;
  options.timeout = 30s;
  return core::run_process(argv, options);
}

// The value of `field` in `scontrol show job ID`, e.g. "JobState".
std::string job_field(const std::string& job, const std::string& field) {
  const auto r = slurm({"scontrol", "-o", "show", "job", job});
  const std::size_t at = r.out.find(field + "=");
  if (at == std::string::npos) return "";
  const std::size_t start = at + field.size() + 1;
  return r.out.substr(start, r.out.find(' ', start) - start);
}

bool wait_for_state(const std::string& job, const std::string& state, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (job_field(job, "JobState") == state) return true;
    std::this_thread::sleep_for(200ms);
  }
  return false;
}

class SlurmCluster : public testing::Test {
 protected:
  void SetUp() override {
    const auto ping = slurm({"scontrol", "ping"});
    if (!ping.ok() || ping.out.find("is UP") == std::string::npos) {
      GTEST_SKIP() << "no local Slurm cluster answers (scripts/local-slurm.sh needs root): "
                   << ping.describe();
    }
  }
  std::string submit(const std::vector<std::string>& options, const std::string& script) {
    std::vector<std::string> argv = {"sbatch", "--parsable", "--chdir", dir_.path().string()};
    argv.insert(argv.end(), options.begin(), options.end());
    argv.push_back(dir_.write("job.sh", script));
    const auto r = slurm(argv);
    EXPECT_TRUE(r.ok()) << r.describe();
    std::string job = r.out.substr(0, r.out.find_first_of(";\n"));
    return job;
  }
  TempDir dir_;
};

TEST_F(SlurmCluster, ABatchJobRunsAndSeesItsEnvironment) {
  const std::string out = (dir_.path() / "out.txt").string();
  const std::string job = submit({"--output", out, "--job-name", "hpctrial-smoke"},
                                 "#!/bin/bash\necho \"job=$SLURM_JOB_ID name=$SLURM_JOB_NAME "
                                 "restart=${SLURM_RESTART_COUNT-unset}\"\n");
  ASSERT_FALSE(job.empty());
  ASSERT_TRUE(wait_for_state(job, "COMPLETED", 60s)) << "state " << job_field(job, "JobState");
  EXPECT_EQ(read_file(out), "job=" + job + " name=hpctrial-smoke restart=unset\n");
}

TEST_F(SlurmCluster, ARequeuedJobRunsAgainWithItsRestartCount) {
  const std::string out = (dir_.path() / "out.txt").string();
  // The first run waits to be requeued; the second finishes at once.
  const std::string job = submit(
      {"--output", out, "--open-mode=append", "--requeue"},
      "#!/bin/bash\necho \"run restart=${SLURM_RESTART_COUNT-unset}\"\n"
      "if [ -z \"${SLURM_RESTART_COUNT-}\" ]; then sleep 120; fi\n");
  ASSERT_TRUE(wait_for_state(job, "RUNNING", 60s)) << "state " << job_field(job, "JobState");
  // RUNNING comes before the script has run: requeue once its first line is out.
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (read_file(out).find("run restart=unset\n") == std::string::npos && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_THAT(read_file(out), HasSubstr("run restart=unset\n")) << "the first run never started its script";
  const auto requeue = slurm({"scontrol", "requeue", job});
  ASSERT_TRUE(requeue.ok()) << requeue.describe();
  // A requeued job waits cred_expire + 1 s (11 s here) before it may start again. (Moving its
  // StartTime to now let Slurm start it at once, and kill it: "Job credential revoked".)
  ASSERT_TRUE(wait_for_state(job, "COMPLETED", 90s)) << "state " << job_field(job, "JobState");
  EXPECT_EQ(job_field(job, "Restarts"), "1");
  EXPECT_THAT(read_file(out), HasSubstr("run restart=unset\n"));
  EXPECT_THAT(read_file(out), HasSubstr("run restart=1\n"));
}

// A job that left RUNNING between the listing and the signal (it read a pause request and
// requeued itself) has no batch shell: scancel alone asks again for 95 s, the client answers
// false at once. A running job takes the signal.
TEST_F(SlurmCluster, ASignalToAJobWithNoBatchShellIsAnsweredAtOnce) {
  const std::string out = (dir_.path() / "out.txt").string();
  const std::string held = submit({"--hold", "--output", out}, "#!/bin/bash\necho ran\n");
  ASSERT_FALSE(held.empty());
  const slurm::Client client;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(client.signal_batch(held, "USR2"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, slurm::Client::kSignalWait + 2s);
  EXPECT_EQ(job_field(held, "JobState"), "PENDING");
  slurm({"scancel", held});

  const std::string running = submit(
      {"--output", out, "--open-mode=append"},
      "#!/bin/bash\ntrap 'echo got USR2; exit 0' USR2\necho started\nwhile true; do sleep 0.1; done\n");
  ASSERT_TRUE(wait_for_state(running, "RUNNING", 60s)) << "state " << job_field(running, "JobState");
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (read_file(out).find("started\n") == std::string::npos && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_THAT(read_file(out), HasSubstr("started\n"));
  EXPECT_TRUE(client.signal_batch(running, "USR2"));
  ASSERT_TRUE(wait_for_state(running, "COMPLETED", 60s)) << "state " << job_field(running, "JobState");
  EXPECT_THAT(read_file(out), HasSubstr("got USR2\n"));
}

}  // namespace
}  // namespace hpctrial
