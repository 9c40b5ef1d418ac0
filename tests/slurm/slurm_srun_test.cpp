// launcher.mpi: srun on the real local Slurm cluster: `hpctrial run` inside salloc starts the
// ranks as one step of the job (`srun --mpi=pmix`), their parents children of slurmstepd rather
// than of the launcher. The launcher's fault tests - a throw, a SIGKILL and a hang at step 5, on
// the chief and on the last rank - end the run within seconds with the failing rank's own record,
// as under mpirun, and leave no task of the step behind.
#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <regex>
#include <tuple>

#include "../integration/launcher_fixture.h"
#include "../support/read_file.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial {
namespace {

using testing::HasSubstr;
using testing_launcher::Launcher;
using testing_support::read_file;
using nlohmann::json;
using namespace std::chrono_literals;

constexpr int kRanks = 2;
constexpr int kHangTimeout = 1, kCollectiveTimeout = 2;  // optimizations.collective_timeout, seconds

using Case = std::tuple<int, std::string>;  // rank, action

class SrunFault : public Launcher, public testing::WithParamInterface<Case> {
 protected:
  void SetUp() override {
    core::RunOptions options;
    options.timeout = 30s;
    const auto ping = core::run_process({"scontrol", "ping"}, options);
    if (!ping.ok() || ping.out.find("is UP") == std::string::npos) {
      GTEST_SKIP() << "no local Slurm cluster answers (scripts/local-slurm.sh needs root): " << ping.describe();
    }
    // One node: this host's two slurmds cannot wire one PMIx step up across each other.
    wrapper_ = {"salloc", "--quiet", "--partition=debug", "--ntasks=" + std::to_string(kRanks), "--time=10"};
  }
};

long long injected_at(const std::string& output) {
  std::smatch m;
  if (!std::regex_search(output, m, std::regex(R"(injected fault \S+ on rank [0-9]+ at step [0-9]+ \(unix ms ([0-9]+)\))"))) {
    return -1;
  }
  return std::stoll(m[1]);
}

TEST_P(SrunFault, EndsTheRunInSecondsWithTheFailingRanksOwnRecord) {
  const auto& [rank, action] = GetParam();
  const std::string fault = "rank" + std::to_string(rank) + ":step5:batch:" + action;
  const std::string exp = config("max_restarts: 0\n"
                                 "optimizations: {collective_timeout: " +
                                     std::to_string(action == "hang" ? kHangTimeout : kCollectiveTimeout) + "s}\n"
                                 "launcher: {mpi: srun, hang_timeout: 60s}\n",
                                 100000, kRanks);
  auto p = run(exp, fault, {}, 120s);
  const std::string out = p->output();
  const long long fault_ms = injected_at(out);
  ASSERT_GT(fault_ms, 0) << "the fault was never injected:\n" << out;
  const double after_fault = static_cast<double>(p->ended_unix_ms() - fault_ms) / 1000.0;
  std::printf("[ measured ] srun: %s on rank %d: hpctrial run ended %.1f s after the fault\n", action.c_str(), rank,
              after_fault);
  EXPECT_LT(after_fault, action == "hang" ? kHangTimeout + 10 : 10) << out;

  const int want_code = action == "sigkill" ? 128 + SIGKILL : 1;
  EXPECT_EQ(p->exit_code(), want_code) << out;
  const auto records = failures();
  ASSERT_EQ(records.size(), 1u) << out;
  const json& r = records[0];
  EXPECT_EQ(r.value("rank", -1), rank) << r.dump(1);
  EXPECT_EQ(r.value("phase", ""), "batch") << r.dump(1);
  if (action == "throw") {
    EXPECT_THAT(r.value("reason", ""), HasSubstr("failed and aborted the job with code 1")) << r.dump(1);
    EXPECT_THAT(r.value("message", ""), HasSubstr("injected fault " + fault)) << r.dump(1);
  } else if (action == "sigkill") {
    EXPECT_THAT(r.value("reason", ""), HasSubstr("was killed by signal 9")) << r.dump(1);
    EXPECT_EQ(r.value("signal", 0), SIGKILL) << r.dump(1);
  } else {
    EXPECT_THAT(r.value("reason", ""), HasSubstr("stopped answering (the collective watchdog found rank")) << r.dump(1);
    const json flight = r.value("flight", json::object());
    const std::string other = std::to_string(rank == 0 ? kRanks - 1 : 0);
    ASSERT_TRUE(flight.contains(other)) << r.dump(1);
    EXPECT_THAT(flight[other].get<std::string>(), HasSubstr(" not finished")) << r.dump(1);
  }
  EXPECT_THAT(out, HasSubstr("trial 0 failed: rank " + std::to_string(rank) + " "));
  // The ranks were a step of the job, not mpirun's: no hostfile, and srun's words in its log.
  EXPECT_FALSE(std::filesystem::exists(trial() + "/launch/hostfile")) << "mpirun ran the ranks";
  EXPECT_THAT(read_file(trial() + "/logs/mpirun.log"), HasSubstr("srun: ")) << out;
  expect_no_rank_left();
}

// Debian's Slurm has no pyxis: an enroot image is refused before any rank starts, saying so.
TEST_F(SrunFault, AnEnrootImageWithoutPyxisIsRefusedBeforeAnyRankStarts) {
  const std::string exp = config("launcher: {mpi: srun}\n"
                                 "environment: {image: \"nvcr.io#nvidia/pytorch:24.01\", container_runtime: enroot}\n",
                                 100, kRanks);
  auto p = run(exp, "", {}, 60s);
  EXPECT_EQ(p->exit_code(), 2) << p->output();
  EXPECT_THAT(p->output(), HasSubstr("environment.container_runtime: enroot needs Slurm's pyxis plugin, but `srun "
                                     "--help` on "));
  EXPECT_THAT(p->output(), HasSubstr(" offers no --container-image; ask the site whether pyxis is installed"));
  EXPECT_FALSE(std::filesystem::exists(trial() + "/launch/heartbeat/rank-0")) << "a rank started";
}

// As under mpirun, each task sees what torchrun would set, from Slurm's variables.
TEST_F(SrunFault, EachTaskSeesTorchsLaunchVariables) {
  const std::string exp = config("launcher: {mpi: srun}\n", 4, kRanks, 0, ", print_torch_env: true");
  auto p = run(exp, "", {}, 120s);
  ASSERT_EQ(p->exit_code(), 0) << p->output();
  std::string port;
  for (int rank = 0; rank < kRanks; ++rank) {
    const std::string log = read_file(trial() + "/logs/rank-" + std::to_string(rank) + ".log");
    std::smatch m;
    ASSERT_TRUE(std::regex_search(log, m, std::regex("torch env RANK=(\\d+) LOCAL_RANK=(\\d+) WORLD_SIZE=2 "
                                                     "LOCAL_WORLD_SIZE=2 MASTER_ADDR=(\\S+) MASTER_PORT=(\\d+)")))
        << log;
    EXPECT_EQ(m[1], std::to_string(rank));
    EXPECT_EQ(m[2], std::to_string(rank));
    EXPECT_NE(m[3], "unset");
    if (rank == 0) port = m[4];
    EXPECT_EQ(m[4], port) << "one port for all ranks";
  }
  EXPECT_FALSE(std::filesystem::exists(trial() + "/launch/hostfile")) << "mpirun ran the ranks";
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
  return "rank" + std::to_string(std::get<0>(info.param)) + "_" + std::get<1>(info.param);
}

INSTANTIATE_TEST_SUITE_P(ChiefAndLastRank, SrunFault,
                         testing::Combine(testing::Values(0, kRanks - 1), testing::Values(std::string("throw"), std::string("sigkill"), std::string("hang"))),
                         case_name);

}  // namespace
}  // namespace hpctrial
