// `hpctrial job update` and the queue columns of `hpctrial jobs` on the real local Slurm cluster,
// run as an ordinary user (scripts/local-slurm.sh makes one): what Slurm lets a user do (lower a
// job's priority through Nice, move a pending job to another partition) is done and seen in
// `scontrol show job`; what it does not (raise a priority, `scontrol top` where the site has not
// allowed users it, place a job ahead of another) is refused with Slurm's words or the reason.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <pwd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "hpctrial/core/subprocess.h"
#include "hpctrial/core/text.h"

namespace hpctrial {
namespace {

using testing::HasSubstr;
using namespace std::chrono_literals;

constexpr const char* kUser = "pbsuser";  // scripts/local-slurm.sh's ordinary user

class SlurmQueue : public testing::Test {
 protected:
  void SetUp() override {
    core::RunOptions options;
    options.timeout = 30s;
    const auto ping = core::run_process({"scontrol", "ping"}, options);
    if (!ping.ok() || ping.out.find("is UP") == std::string::npos) {
      GTEST_SKIP() << "no local Slurm cluster answers (scripts/local-slurm.sh needs root): " << ping.describe();
    }
    ASSERT_NE(::getpwnam(kUser), nullptr) << "scripts/local-slurm.sh start makes the user " << kUser;
  }
  void TearDown() override {
    for (const auto& id : jobs_) user({"scancel", id});
  }
  // `argv` as the ordinary user, with the cluster's config.
  core::RunResult user(const std::vector<std::string>& argv) const {
    std::vector<std::string> full = {"runuser", "-u", kUser, "--", "env", "SLURM_CONF=" + std::string(std::getenv("SLURM_CONF"))};
    full.insert(full.end(), argv.begin(), argv.end());
    core::RunOptions options;
    options.timeout = 60s;
    options.working_dir = "/tmp";
    return core::run_process(full, options);
  }
  // A job of the user's that waits an hour for its start time (or, `held`, for a release).
  std::string waiting_job(bool held = false) {
    const auto r = user({"sbatch", "--parsable", held ? "--hold" : "--begin=now+1hour", "--partition=debug",
                         "--ntasks=2", "--output=/dev/null", "--wrap", "sleep 1"});
    EXPECT_TRUE(r.ok()) << r.describe() << r.err;
    jobs_.push_back(core::trim(r.out));
    return jobs_.back();
  }
  std::string field(const std::string& job, const std::string& key) const {
    const auto r = core::run_process({"scontrol", "-o", "show", "job", job});
    const auto at = r.out.find(" " + key + "=");
    return at == std::string::npos ? "" : r.out.substr(at + key.size() + 2, r.out.find(' ', at + 1) - at - key.size() - 2);
  }
  std::vector<std::string> jobs_;
};

TEST_F(SlurmQueue, AUserLowersAPriorityMovesAPartitionAndIsRefusedTheRestWithSlurmsWords) {
  const std::string first = waiting_job(), second = waiting_job();
  auto r = user({HPCTRIAL_CLI, "job", "update", second, "--priority", "-5"});
  ASSERT_TRUE(r.ok()) << r.describe() << r.err;
  EXPECT_EQ(r.out, "slurm job " + second + ": Nice=5 (priority -5)\n");
  EXPECT_EQ(field(second, "Nice"), "5");

  r = user({HPCTRIAL_CLI, "job", "update", second, "--priority", "5"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("slurm refused to change job " + second + ": "));
  EXPECT_THAT(r.err, HasSubstr("Access/permission denied"));
  EXPECT_THAT(r.err, HasSubstr("Slurm lets users lower a job's priority, --priority 0 or less"));
  EXPECT_EQ(field(second, "Nice"), "5") << "unchanged";

  r = user({HPCTRIAL_CLI, "job", "update", second, "--partition", "elastic"});
  ASSERT_TRUE(r.ok()) << r.describe() << r.err;
  EXPECT_EQ(field(second, "Partition"), "elastic");

  r = user({HPCTRIAL_CLI, "job", "update", second, "--top"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("Access/permission denied"));
  EXPECT_THAT(r.err, HasSubstr("SchedulerParameters=enable_user_top"));
  r = user({HPCTRIAL_CLI, "job", "update", second, "--ahead-of", first});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("Slurm orders a user's waiting jobs only by putting one first among them"));

  // The batch form, in order; and the queue columns of `hpctrial jobs`, text and JSON.
  r = user({HPCTRIAL_CLI, "job", "update-batch", first + ".priority=-3", second + ".partition=debug"});
  ASSERT_TRUE(r.ok()) << r.describe() << r.err;
  EXPECT_EQ(field(first, "Nice"), "3");
  EXPECT_EQ(field(second, "Partition"), "debug");
  r = user({HPCTRIAL_CLI, "jobs", "--all", "--scheduler", "slurm", "--partition", "debug", "--json"});
  ASSERT_TRUE(r.ok()) << r.describe() << r.err;
  const auto listed = nlohmann::json::parse(r.out);
  int seen = 0;
  for (const auto& job : listed["jobs"]) {
    if (job["id"] != first && job["id"] != second) continue;
    ++seen;
    EXPECT_EQ(job["queue"], "debug");
    EXPECT_EQ(job["slots_needed"], 2);
    EXPECT_EQ(job["slots_acquired"], 0);
    EXPECT_EQ(job["held"], false);
    EXPECT_EQ(job["priority"], field(job["id"], "Priority"));
  }
  EXPECT_EQ(seen, 2) << r.out;
  r = user({HPCTRIAL_CLI, "jobs", "--all", "--scheduler", "slurm"});
  ASSERT_TRUE(r.ok()) << r.err;
  EXPECT_THAT(r.out, testing::ContainsRegex("\n" + first + " +wrap +PENDING +[0-9]+ +debug +0/2 "));

  // A held job's priority is refused: a new Nice would let it start (a hold is a priority of 0).
  const std::string held = waiting_job(true);
  r = user({HPCTRIAL_CLI, "job", "update", held, "--priority", "-1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("slurm job " + held + " is held, and Slurm lets a held job start as soon as its Nice "
                               "changes; release it first"));
  EXPECT_EQ(field(held, "Reason"), "JobHeldUser");
  EXPECT_EQ(field(held, "Nice"), "0");
}

// `hpctrial jobs` asks `squeue --json` (Slurm 22.05 prints every user's jobs whatever the filter,
// so the user's are picked out) and lists every user's with --all-users, each with its user.
TEST_F(SlurmQueue, JobsListsTheUsersOwnOrEveryUsersFromSqueuesJson) {
  const std::string mine = waiting_job();
  core::RunOptions options;
  options.timeout = 60s;
  options.working_dir = "/tmp";
  const auto submitted = core::run_process({"sbatch", "--parsable", "--begin=now+1hour", "--partition=debug",
                                            "--output=/dev/null", "--job-name=theirs", "--wrap", "sleep 1"},
                                           options);
  ASSERT_TRUE(submitted.ok()) << submitted.describe() << submitted.err;
  const std::string theirs = core::trim(submitted.out);
  struct Cancel {
    std::string job;
    ~Cancel() { core::run_process({"scancel", job}); }
  } cancel{theirs};

  auto r = user({HPCTRIAL_CLI, "jobs", "--all", "--scheduler", "slurm", "--verbose"});
  ASSERT_TRUE(r.ok()) << r.describe() << r.err;
  EXPECT_THAT(r.err, HasSubstr("job(s) from `squeue --json --states=all --me`"));
  EXPECT_THAT(r.out, testing::ContainsRegex("\n" + mine + " +wrap +PENDING "));
  EXPECT_THAT(r.out, testing::Not(HasSubstr("theirs"))) << "another user's job";

  r = user({HPCTRIAL_CLI, "jobs", "--all", "--all-users", "--scheduler", "slurm", "--json"});
  ASSERT_TRUE(r.ok()) << r.describe() << r.err;
  const auto answer = nlohmann::json::parse(r.out);
  std::map<std::string, nlohmann::json> listed;
  for (const auto& job : answer["jobs"]) listed[job["id"].get<std::string>()] = job;
  ASSERT_EQ(listed.count(mine), 1u) << r.out;
  ASSERT_EQ(listed.count(theirs), 1u) << r.out;
  EXPECT_EQ(listed[mine]["user"], kUser);
  EXPECT_EQ(listed[theirs]["user"], "root");
  EXPECT_EQ(listed[theirs]["name"], "theirs");
  // As `scontrol show job` says.
  for (const std::string& job : {mine, theirs}) {
    EXPECT_EQ(listed[job]["native_state"], field(job, "JobState"));
    EXPECT_EQ(listed[job]["priority"], field(job, "Priority"));
    EXPECT_EQ(listed[job]["elapsed"], field(job, "RunTime"));
    EXPECT_EQ(listed[job]["queue"], field(job, "Partition"));
  }
  r = user({HPCTRIAL_CLI, "jobs", "--all", "--all-users", "--scheduler", "slurm"});
  ASSERT_TRUE(r.ok()) << r.err;
  EXPECT_THAT(r.out, testing::StartsWith("JOB "));
  EXPECT_THAT(r.out, testing::ContainsRegex("^JOB +USER +NAME +STATE "));
  EXPECT_THAT(r.out, testing::ContainsRegex("\n" + theirs + " +root +theirs +PENDING "));
  EXPECT_THAT(r.out, testing::ContainsRegex("\n" + mine + " +" + kUser + " +wrap +PENDING "));
}

}  // namespace
}  // namespace hpctrial
