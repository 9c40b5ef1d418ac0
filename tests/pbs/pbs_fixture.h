// The pbs tier's fixture: hpctrial against the real OpenPBS server that scripts/local-pbs.sh
// starts (server, scheduler, comm and MoM on this host, queue workq). PBS runs no job as root,
// so every hpctrial command runs as the ordinary user the script made (runuser), in an
// experiment directory that user owns; tests read PBS's own view with qstat.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <stdexcept>
#include <thread>

#include "../support/background_process.h"
#include "../support/read_file.h"
#include "../support/temp_dir.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial::pbs_tier {

using namespace std::chrono_literals;
using json = nlohmann::json;
using testing_support::processes_running;
using testing_support::read_file;
using testing_support::TempDir;
namespace fs = std::filesystem;

inline std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}

inline const std::string kPrefix = env_or("HPCTRIAL_PBS_PREFIX", "/opt/pbs");
inline const std::string kUser = env_or("HPCTRIAL_PBS_USER", "pbsuser");

inline core::RunResult run_as(const std::vector<std::string>& argv, std::chrono::seconds limit, bool as_user) {
  const passwd* pw = ::getpwnam(kUser.c_str());
  std::vector<std::string> full;
  if (as_user) {
    // A login's environment, as the user has it: PBS's commands on PATH, USER naming them.
    full = {"runuser", "-u", kUser, "--", "env", "-i", "HOME=" + std::string(pw != nullptr ? pw->pw_dir : "/"),
            "USER=" + kUser, "LOGNAME=" + kUser, "PATH=" + kPrefix + "/bin:/usr/local/bin:/usr/bin:/bin",
            "LANG=C.UTF-8"};
  } else {
    full = {"env", "PATH=" + kPrefix + "/bin:/usr/local/bin:/usr/bin:/bin", "OMPI_ALLOW_RUN_AS_ROOT=1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"};
  }
  full.insert(full.end(), argv.begin(), argv.end());
  core::RunOptions options;
  options.timeout = limit;
  return core::run_process(full, options);
}

// As the ordinary user.
inline core::RunResult user(const std::vector<std::string>& argv, std::chrono::seconds limit = 120s) {
  return run_as(argv, limit, true);
}

// PBS's record of a job, from `qstat -f -F json -x` (empty when the server does not know it).
inline json pbs_job(const std::string& id) {
  const auto r = run_as({"qstat", "-f", "-F", "json", "-x", id}, 30s, false);
  if (!r.ok()) return json::object();
  const json all = json::parse(r.out, nullptr, false);
  if (!all.is_object() || !all.contains("Jobs") || !all["Jobs"].contains(id)) return json::object();
  return all["Jobs"][id];
}

inline std::string state_of(const std::string& id) { return pbs_job(id).value("job_state", std::string()); }

// The state of every job the server knows, subjobs too, by id: one qstat on one connection.
// Each qstat connects from a reserved port, which stays taken a minute (TIME_WAIT): a wait that
// asked for each of several jobs three times a second left the host none, and PBS's own
// daemons and the jobs' qsub then failed.
inline std::map<std::string, std::string> job_states() {
  std::map<std::string, std::string> states;
  const auto r = run_as({"qstat", "-x", "-t", "-f", "-F", "json"}, 30s, false);
  const json all = json::parse(r.out, nullptr, false);
  if (!r.ok() || !all.is_object() || !all.contains("Jobs")) return states;
  for (const auto& [id, job] : all["Jobs"].items()) states[id] = job.value("job_state", std::string());
  return states;
}

inline int exit_status(const std::string& id) {
  const json job = pbs_job(id);
  return job.contains("Exit_status") && job["Exit_status"].is_number_integer() ? job["Exit_status"].get<int>() : -1000;
}

inline bool wait_for(const std::function<bool()>& done, std::chrono::seconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(1s);  // each qstat holds a reserved port for a minute (job_states)
  }
  return true;
}

inline bool wait_for_state(const std::string& id, const std::string& state, std::chrono::seconds limit) {
  return wait_for([&] { return state_of(id) == state; }, limit);
}

class PbsServer : public testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "the pbs tier runs its jobs as " << kUser << " and needs root to switch";
    const passwd* pw = ::getpwnam(kUser.c_str());
    if (pw == nullptr) GTEST_SKIP() << "no user " << kUser << ": scripts/local-pbs.sh start makes it";
    const auto ping = run_as({"qstat", "-B"}, 30s, false);
    if (!ping.ok()) {
      GTEST_SKIP() << "no local PBS server answers (scripts/local-pbs.sh start builds and starts one where its "
                      "source is available): " << ping.describe() << " " << ping.err;
    }
    // The user runs the build tree's programs: every folder above them must let others in.
    for (const char* program : {HPCTRIAL_CLI, HPCTRIAL_FAULTY_TRIAL}) {
      ASSERT_TRUE(user({"test", "-x", program}, 30s).ok())
          << kUser << " cannot run " << program << ": build with umask 022, or give others read and search "
          << "permission on the build tree";
    }
    // The experiment lives in a directory the user owns; the rest of dir_ stays root's.
    fs::create_directories(user_dir());
    ASSERT_EQ(::chown(user_dir().c_str(), pw->pw_uid, pw->pw_gid), 0);
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
  }
  void TearDown() override {
    if (HasFailure()) keep_evidence();
    // Nothing of this test's left in the queue for the next one.
    for (const std::string& id : submitted_) {
      if (const std::string s = state_of(id); !s.empty() && s != "F" && s != "X") run_as({"qdel", "-W", "force", id}, 30s, false);
    }
  }

  // A failed test's experiment directory, copied where the test's own removal leaves it, and
  // PBS's record of each of its jobs (exit status, times, paths), printed: what a failure that
  // happens only now and then needs to be understood.
  void keep_evidence() {
    if (fs::exists(experiment() + "/experiment.json")) recorded_jobs();
    const auto* test = testing::UnitTest::GetInstance()->current_test_info();
    const fs::path kept = fs::temp_directory_path() /
                          ("hpctrial-pbs-failed-" + std::string(test->name()) + "-" + std::to_string(::getpid()));
    std::error_code error;
    fs::copy(experiment(), kept, fs::copy_options::recursive, error);
    std::printf("the experiment directory is kept in %s%s\n", kept.c_str(),
                error ? (" (in part: " + error.message() + ")").c_str() : "");
    for (const std::string& id : submitted_) std::printf("qstat -xf %s: %s\n", id.c_str(), pbs_job(id).dump().c_str());
  }

  std::string user_dir() const { return (dir_.path() / "user").string(); }
  std::string experiment() const { return user_dir() + "/exp"; }
  std::string trial_dir(int trial = 0) const { return experiment() + "/trial-" + std::to_string(trial); }

  // `batch_ms` is a number, or a categorical range that makes the searcher a grid.
  std::string config(std::int64_t batches, const std::string& batch_ms, const std::string& scheduler, int slots = 2) {
    const bool grid = batch_ms.find('{') != std::string::npos;
    return dir_.write("exp.yaml",
        "name: pbs-real\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
        "searcher: {name: " + (grid ? "grid" : "single") + ", metric: validation_loss, "
        "max_length: {batches: " + std::to_string(batches) + "}}\n"
        "hyperparameters: {global_batch_size: 16, fail_rank: -1, fail_batch: 0, fail_mode: none, batch_ms: " +
        batch_ms + "}\n"
        "resources: {slots_per_trial: " + std::to_string(slots) + ", slots_per_node: " + std::to_string(slots) + "}\n"
        "min_checkpoint_period: {batches: 200}\n"
        "reproducibility: {experiment_seed: 11}\n"
        "scheduler: {type: pbs, queue: workq, " + scheduler + "}\n");
  }
  // The same experiment run uninterrupted on this machine, without the per-batch sleep (which
  // changes no number); returns its final checkpoint of `trial`.
  std::string straight_run(const std::string& config_path, std::int64_t batches, int trial = 0) {
    const std::string dir = (dir_.path() / "straight").string();
    if (!fs::exists(dir)) {
      const auto r = run_as({HPCTRIAL_CLI, "run", config_path, "--set", "scheduler.type=local", "--set",
                             "hyperparameters.batch_ms=0", "--experiment", dir}, 300s, false);
      EXPECT_TRUE(r.ok()) << r.describe() << r.err;
    }
    return dir + "/trial-" + std::to_string(trial) + "/checkpoints/ckpt-" + std::to_string(batches) + ".h5";
  }
  std::string submit(const std::string& config_path) {
    const auto r = user({HPCTRIAL_CLI, "submit", config_path, "--experiment", experiment()});
    EXPECT_TRUE(r.ok()) << r.describe() << "\n" << r.out << r.err;
    std::smatch m;
    if (!std::regex_search(r.out, m, std::regex(R"(submitted pbs job (\S+))"))) return "";
    submitted_.push_back(m[1].str());
    return m[1].str();
  }
  // The jobs recorded in experiment.json, oldest first.
  std::vector<std::string> recorded_jobs() {
    std::vector<std::string> ids;
    const json state = json::parse(read_file(experiment() + "/experiment.json"), nullptr, false);
    if (state.is_object() && state.contains("jobs")) {
      for (const auto& j : state["jobs"]) ids.push_back(j.value("id", std::string()));
    }
    for (const auto& id : ids) {
      if (std::find(submitted_.begin(), submitted_.end(), id) == submitted_.end()) submitted_.push_back(id);
    }
    return ids;
  }
  std::string job_output(const std::string& id) const { return read_file(experiment() + "/pbs-" + id + ".out"); }
  long long heartbeat(int trial = 0) const {
    std::ifstream in(trial_dir(trial) + "/launch/heartbeat/rank-0");
    std::string word;
    long long step = -1;
    in >> word >> step;
    return step;
  }
  void wait_for_training(long long step) {
    ASSERT_TRUE(wait_for([&] { return heartbeat() >= step; }, 120s))
        << "no training seen; heartbeat " << heartbeat() << "\n" << read_file(experiment() + "/pbs-scheduler.out");
  }
  // Waits until the experiment's latest job ended other than stopped (75), each stopped one
  // followed by its successor; false when that takes `limit`, or a stopped job has no successor
  // 30 s after it ended. `jobs` gets the recorded jobs.
  bool wait_for_chain(std::vector<std::string>& jobs, std::chrono::seconds limit) {
    std::size_t count = 0;
    auto since = std::chrono::steady_clock::now();
    return wait_for([&] {
      jobs = recorded_jobs();
      if (jobs.size() != count) {
        count = jobs.size();
        since = std::chrono::steady_clock::now();
      }
      if (jobs.empty() || state_of(jobs.back()) != "F") return false;
      // An array job that ended, here, had a subjob stopped: its successor comes next.
      const bool stopped = exit_status(jobs.back()) == 75 || jobs.back().find("[]") != std::string::npos;
      if (!stopped) return true;
      if (std::chrono::steady_clock::now() - since > 30s) throw std::runtime_error("no successor of " + jobs.back());
      return false;
    }, limit);
  }
  // No process of PBS job `id` is left on this host.
  void expect_no_process_of(const std::string& id) {
    const std::string entry = "PBS_JOBID=" + id;
    EXPECT_TRUE(wait_for([&] { return processes_running(HPCTRIAL_FAULTY_TRIAL, entry).empty() &&
                                      processes_running("hpctrial", entry).empty(); }, 30s))
        << "a process of job " << id << " outlived it";
  }
  // Every file the user's jobs wrote into the experiment directory is the user's alone.
  void expect_private(const std::vector<std::string>& files) {
    for (const std::string& file : files) {
      struct stat st {};
      ASSERT_EQ(::stat((experiment() + "/" + file).c_str(), &st), 0) << file;
      EXPECT_EQ(st.st_mode & 0077, 0u) << file << " is readable by others";
      EXPECT_EQ(st.st_uid, ::getpwnam(kUser.c_str())->pw_uid) << file;
    }
  }

  TempDir dir_;
  std::vector<std::string> submitted_;
};

}  // namespace hpctrial::pbs_tier
