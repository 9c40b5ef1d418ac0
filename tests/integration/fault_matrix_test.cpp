// Every way a rank can fail, in every phase, on the chief and on the last rank: `hpctrial run`
// ends within seconds of the fault (a hang: within the collective timeout and seconds), exits
// with the failing rank's own code, records the rank, its phase and its exit code or signal, and
// leaves no process of the trial. Also: the experiment directory removed under a running trial,
// and a full disk under its metrics and heartbeat files.
#include <sys/mount.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <tuple>

#include "launcher_fixture.h"

namespace hpctrial {
namespace fault_matrix_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using testing_launcher::Launcher;
using testing_support::BackgroundProcess;
using nlohmann::json;
using namespace std::chrono_literals;

constexpr int kRanks = 2;
// optimizations.collective_timeout in seconds: the hang cases' (the least there is: the watchdog
// is what ends them), and the others'.
constexpr int kHangTimeout = 1, kCollectiveTimeout = 2;

// Every batch validates and checkpoints, so that each phase comes at step 5.
std::string every_phase_at_step5(const std::string& action) {
  return "max_restarts: 0\n"
         "optimizations: {collective_timeout: " + std::to_string(action == "hang" ? kHangTimeout : kCollectiveTimeout) +
         "s}\n"
         "launcher: {hang_timeout: 60s}\n"
         "min_validation_period: {batches: 5}\n"
         "min_checkpoint_period: {batches: 5}\n";
}

struct Expected {
  int exit_code;
  int signal;  // 0: none
  const char* how;
};

Expected expected(const std::string& action) {
  if (action == "throw") return {1, 0, "failed and aborted the job with code 1"};
  if (action == "exit3") return {3, 0, "exited with code 3"};
  if (action == "segv") return {128 + SIGSEGV, SIGSEGV, "was killed by signal 11"};
  if (action == "abort") return {128 + SIGABRT, SIGABRT, "was killed by signal 6"};
  if (action == "sigkill") return {128 + SIGKILL, SIGKILL, "was killed by signal 9"};
  return {1, 0, "stopped answering (the collective watchdog found rank"};  // hang
}

// The wall-clock time the fault was injected at, as the fault hook printed it.
long long injected_at(const std::string& output) {
  std::smatch m;
  if (!std::regex_search(output, m, std::regex(R"(injected fault \S+ on rank [0-9]+ at step [0-9]+ \(unix ms ([0-9]+)\))"))) {
    return -1;
  }
  return std::stoll(m[1]);
}

using Case = std::tuple<int, const char*, const char*>;  // rank, phase, action

class FaultMatrix : public Launcher, public testing::WithParamInterface<Case> {};

TEST_P(FaultMatrix, EndsTheRunInSecondsWithTheFailingRanksOwnRecord) {
  const auto [rank, phase_name, action_name] = GetParam();
  const std::string phase = phase_name, action = action_name;
  const std::string fault = "rank" + std::to_string(rank) + ":" + (phase == "startup" ? "" : "step5:") + phase + ":" +
                            action;
  const std::string exp = config(every_phase_at_step5(action), 100000, kRanks, 0,
                                 phase == "evaluate" ? ", full_validation: true" : "");
  auto p = run(exp, fault, {}, std::chrono::seconds(90));
  const std::string out = p->output();
  const Expected want = expected(action);

  const long long fault_ms = injected_at(out);
  ASSERT_GT(fault_ms, 0) << "the fault was never injected:\n" << out;
  const double after_fault = static_cast<double>(p->ended_unix_ms() - fault_ms) / 1000.0;
  const double limit = action == "hang" ? kHangTimeout + 10 : 10;
  std::printf("[ measured ] %s on rank %d in %s: hpctrial run ended %.1f s after the fault\n", action.c_str(), rank,
              phase.c_str(), after_fault);
  EXPECT_LT(after_fault, limit) << out;
  EXPECT_EQ(p->exit_code(), want.exit_code) << out;

  const auto records = failures();
  ASSERT_EQ(records.size(), 1u) << out;
  const json& r = records[0];
  EXPECT_EQ(r.value("rank", -1), rank) << r.dump(1);
  EXPECT_EQ(r.value("phase", ""), phase) << r.dump(1);
  EXPECT_THAT(r.value("reason", ""), HasSubstr(want.how)) << r.dump(1);
  if (want.signal != 0) {
    EXPECT_EQ(r.value("signal", 0), want.signal) << r.dump(1);
  } else if (action != "hang") {
    EXPECT_EQ(r.value("exit_code", 0), want.exit_code) << r.dump(1);
  }
  if (action == "throw") {
    EXPECT_THAT(r.value("message", ""), HasSubstr("injected fault " + fault));
  }
  if (action == "hang") {
    // The watchdog's flight recorder: where every rank was when it ended the job - the other rank
    // waiting in an operation the hung one never joined - in the record and in `describe`.
    const json flight = r.value("flight", json::object());
    const std::string other = std::to_string(rank == 0 ? kRanks - 1 : 0);
    ASSERT_TRUE(flight.contains("0") && flight.contains(std::to_string(kRanks - 1))) << r.dump(1);
    EXPECT_THAT(flight[other].get<std::string>(), HasSubstr(" not finished")) << r.dump(1);
    BackgroundProcess describe({HPCTRIAL_CLI, "describe", experiment()}, env(), (dir_.path() / "describe.txt").string());
    ASSERT_TRUE(describe.wait(30s).has_value());
    EXPECT_THAT(describe.output(), HasSubstr("    rank " + other + " last: " + flight[other].get<std::string>() + "\n"))
        << describe.output();
  }
  EXPECT_THAT(out, HasSubstr("trial 0 failed: rank " + std::to_string(rank) + " "));
  expect_no_rank_left();
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
  return "rank" + std::to_string(std::get<0>(info.param)) + "_" + std::get<1>(info.param) + "_" +
         std::get<2>(info.param);
}

INSTANTIATE_TEST_SUITE_P(EveryPhaseAndAction, FaultMatrix,
                         testing::Combine(testing::Values(0, kRanks - 1),
                                          testing::Values("startup", "batch", "agreement", "validation", "evaluate",
                                                          "checkpoint"),
                                          testing::Values("throw", "exit3", "segv", "abort", "sigkill", "hang")),
                         case_name);

// The experiment directory removed under a running trial: the chief cannot write its next
// checkpoint, says which path, and the job ends; nothing waits. The ranks' records went with
// the directory (and under load the launcher may never have read one): the launcher sees the
// chief's end in its process, a zombie of mpirun's, whose exit code says how.
TEST_F(Launcher, TheExperimentDirectoryRemovedEndsTheRunWithThePath) {
  const std::string exp = config("max_restarts: 0\nmin_checkpoint_period: {batches: 200}\n", 100000, kRanks, 1);
  auto p = start(exp);
  wait_for_step(20);
  std::filesystem::remove_all(experiment());
  const auto removed = std::chrono::steady_clock::now();
  ASSERT_TRUE(p->wait(60s).has_value()) << p->output();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - removed).count();
  std::printf("[ measured ] experiment directory removed: hpctrial run ended %.1f s later\n", seconds);
  const std::string out = p->output();
  EXPECT_EQ(p->exit_code(), 1) << "the chief's own code" << out;
  EXPECT_THAT(out, HasSubstr("cannot create " + trial() + "/checkpoints/")) << "the message names the path";
  EXPECT_THAT(out, HasSubstr("No such file or directory"));
  EXPECT_THAT(out, testing::ContainsRegex("trial 0 failed: rank 0 [^\n]*\\. Its directory " + trial() +
                                          " was removed while it ran"));
  EXPECT_LT(seconds, 10) << out;  // a checkpoint comes every 200 batches of ~1 ms
  expect_no_rank_left();
}

// metrics.jsonl on a full disk (/dev/full answers every write with ENOSPC).
TEST_F(Launcher, AFullDiskUnderTheMetricsEndsTheRunWithThePath) {
  const std::string exp = config("max_restarts: 0\n", 100000, kRanks);
  std::filesystem::create_directories(trial());
  ASSERT_EQ(::symlink("/dev/full", (trial() + "/metrics.jsonl").c_str()), 0);
  auto p = run(exp, "", {}, 60s);
  const std::string out = p->output();
  EXPECT_EQ(p->exit_code(), 1) << out;
  const auto records = failures();
  ASSERT_EQ(records.size(), 1u) << out;
  EXPECT_EQ(records[0].value("rank", -1), 0) << "the chief writes the metrics";
  EXPECT_THAT(records[0].value("message", ""), HasSubstr(trial() + "/metrics.jsonl: No space left on device"));
  EXPECT_LT(p->seconds(), 30) << out;  // the first report comes after 100 batches
  expect_no_rank_left();
}

// A full filesystem under the heartbeat files (a tmpfs filled to the last byte; needs root to
// mount it): every rank stops at start-up with the path, and the job ends.
TEST_F(Launcher, AFullDiskUnderTheHeartbeatsEndsTheRunWithThePath) {
  const std::string launch_dir = trial() + "/launch";
  std::filesystem::create_directories(launch_dir);
  if (::mount("tmpfs", launch_dir.c_str(), "tmpfs", 0, "size=64k,mode=0700") != 0) {
    GTEST_SKIP() << "cannot mount a small tmpfs here (" << std::strerror(errno) << "); needs root";
  }
  struct Unmount {
    std::string dir;
    ~Unmount() { ::umount2(dir.c_str(), MNT_DETACH); }
  } unmount{launch_dir};
  {
    std::ofstream filler(launch_dir + "/filler", std::ios::binary);
    const std::string block(4096, 'x');
    for (int i = 0; i < 64 && filler.write(block.data(), block.size()); ++i) {
    }
  }
  const std::string exp = config("max_restarts: 0\n", 100000, kRanks);
  auto p = run(exp, "", {}, 60s);
  const std::string out = p->output();
  EXPECT_EQ(p->exit_code(), 1) << out;
  EXPECT_THAT(out, HasSubstr("cannot write the heartbeat file " + launch_dir + "/heartbeat/rank-"));
  EXPECT_THAT(out, HasSubstr("No space left on device"));
  EXPECT_LT(p->seconds(), 30) << out;
  expect_no_rank_left();
}

}  // namespace fault_matrix_test
}  // namespace hpctrial
