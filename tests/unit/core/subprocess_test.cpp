#include "hpctrial/core/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <fstream>

#include "../../support/temp_dir.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"

namespace hpctrial::core {
namespace {

using namespace std::chrono_literals;
using testing::HasSubstr;

TEST(RunProcess, CapturesStdoutStderrAndExitCode) {
  const RunResult r = run_process({"sh", "-c", "echo out; echo err >&2; exit 3"});
  EXPECT_EQ(r.out, "out\n");
  EXPECT_EQ(r.err, "err\n");
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(r.signal, 0);
  EXPECT_FALSE(r.timed_out);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.describe(), "'sh -c 'echo out; echo err >&2; exit 3'' exited with code 3: err");
}

TEST(RunProcess, ArgumentsReachTheProgramUnchanged) {
  const std::vector<std::string> args = {"printf", "%s|", "a b", "$(x)", "'q'", "", "*"};
  const RunResult r = run_process(args);
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_EQ(r.out, "a b|$(x)|'q'||*|");
}

TEST(RunProcess, FeedsStdin) {
  std::string big(1 << 20, 'x');  // larger than a pipe buffer: needs the non-blocking writer
  RunOptions options;
  options.stdin_data = big;
  const RunResult r = run_process({"wc", "-c"}, options);
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_EQ(std::stoul(r.out), big.size());
}

TEST(RunProcess, AChildThatIgnoresItsInputDoesNotHurtUs) {
  RunOptions options;
  options.stdin_data = std::string(1 << 20, 'x');
  const RunResult r = run_process({"true"}, options);
  EXPECT_TRUE(r.ok()) << r.describe();
}

TEST(RunProcess, ReportsTheSignalThatKilledTheChild) {
  const RunResult r = run_process({"sh", "-c", "kill -9 $$"});
  EXPECT_EQ(r.signal, SIGKILL);
  EXPECT_THAT(r.describe(), HasSubstr("was killed by signal 9 (Killed)"));
}

// A signal blocked from the start waits, pending, for the child to unblock it; the same signal
// ends a child that does not block it.
TEST(SpawnProcess, BlockedSignalsStayPendingInsteadOfKillingTheChild) {
  for (const bool blocked : {true, false}) {
    SpawnOptions options;
    options.capture_output = false;
    if (blocked) options.blocked_signals = {SIGUSR2};
    const Child child = spawn_process({"sleep", "0.5"}, options);
    ASSERT_EQ(::kill(child.pid, SIGUSR2), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(child.pid, &status, 0), child.pid);
    if (blocked) {
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
    } else {
      EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGUSR2) << "status " << status;
    }
  }
}

TEST(RunProcess, TimeoutTerminatesTheWholeProcessGroup) {
  testing_support::TempDir dir;
  const std::string marker = (dir.path() / "survived").string();
  RunOptions options;
  options.timeout = 300ms;
  options.kill_grace = 500ms;
  // A grandchild that would write the marker if it outlived the time-out.
  const RunResult r = run_process(
      {"sh", "-c", "(sleep 2; touch " + marker + ") & sleep 30"}, options);
  EXPECT_TRUE(r.timed_out);
  EXPECT_FALSE(r.ok());
  EXPECT_LT(r.elapsed, 5s);
  EXPECT_THAT(r.describe(), HasSubstr("timed out after"));
  ::sleep(3);
  EXPECT_NE(::access(marker.c_str(), F_OK), 0) << "a grandchild survived the time-out";
}

TEST(RunProcess, TimeoutEscalatesToSigkill) {
  RunOptions options;
  options.timeout = 200ms;
  options.kill_grace = 300ms;
  const RunResult r = run_process({"sh", "-c", "trap '' TERM; sleep 30"}, options);
  EXPECT_TRUE(r.timed_out);
  EXPECT_EQ(r.signal, SIGKILL);
  EXPECT_LT(r.elapsed, 5s);
}

TEST(RunProcess, EnvironmentAndWorkingDirectory) {
  testing_support::TempDir dir;
  RunOptions options;
  options.env_set = {{"HPCTRIAL_TEST_VALUE", "a b"}};
  options.env_unset = {"HOME"};
  options.working_dir = dir.path().string();
  const RunResult r =
      run_process({"sh", "-c", "printf '%s|%s|%s' \"$HPCTRIAL_TEST_VALUE\" \"${HOME-unset}\" \"$PWD\""},
                  options);
  EXPECT_EQ(r.out, "a b|unset|" + dir.path().string());
}

TEST(RunProcess, AMissingProgramIsAnIoErrorNamingIt) {
  try {
    run_process({"hpctrial-no-such-program", "x"});
    FAIL();
  } catch (const IoError& e) {
    EXPECT_EQ(std::string(e.what()),
              "cannot run 'hpctrial-no-such-program': No such file or directory (is it installed "
              "and on PATH?)");
  }
}

TEST(RunProcess, OutputIsCappedNotUnbounded) {
  RunOptions options;
  options.max_output_bytes = 1000;
  const RunResult r = run_process({"sh", "-c", "head -c 100000 /dev/zero"}, options);
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_EQ(r.out.size(), 1000u);
  EXPECT_TRUE(r.truncated);
}

TEST(RunProcess, ADaemonHoldingThePipesDoesNotHangUs) {
  const RunResult r = run_process({"sh", "-c", "(setsid sleep 5 &) ; echo started"});
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_EQ(r.out, "started\n");
  EXPECT_LT(r.elapsed, std::chrono::seconds(3));
}

}  // namespace
}  // namespace hpctrial::core

namespace hpctrial::core {
namespace {

TEST(CpuList, RunsOfCpusAreRanges) {
  EXPECT_EQ(cpu_list_text({}), "");
  EXPECT_EQ(cpu_list_text({3}), "3");
  EXPECT_EQ(cpu_list_text({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(cpu_list_text({11, 10, 0, 8, 10, 1}), "0-1,8,10-11");
}

// The kernel's own list of the CPUs this process may run on says the same.
TEST(CpuList, TheAffinityIsTheKernelsCpusAllowedList) {
  std::ifstream status("/proc/self/status");
  std::string line, kernel;
  while (std::getline(status, line)) {
    if (line.rfind("Cpus_allowed_list:", 0) == 0) kernel = line.substr(line.find_first_not_of(" \t", 18));
  }
  ASSERT_FALSE(kernel.empty());
  EXPECT_EQ(cpu_affinity(), kernel);
}

}  // namespace
}  // namespace hpctrial::core
