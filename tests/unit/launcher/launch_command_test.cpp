// The launcher's mpirun command, on a workstation and inside a job, from a parsed config and an
// allocation; no process is started.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <thread>

#include "../../support/temp_dir.h"
#include "hpctrial/core/config_node.h"
#include "hpctrial/core/diagnostics.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/launcher/launcher.h"
#include "two_node_job.h"

namespace hpctrial::launcher {
namespace {

using testing::ElementsAre;
using testing::HasSubstr;
using testing::Not;

core::ExperimentConfig parse(const std::string& extra) {
  const std::string yaml = R"(name: t
entrypoint: [/opt/trial, --fast]
searcher: {name: single, metric: loss, max_length: {batches: 10}}
)" + extra;
  core::Diagnostics d;
  const core::ConfigNode root = core::parse_config_text(yaml, "exp.yaml", d);
  core::ExperimentConfig config = core::parse_experiment_config(root, d);
  EXPECT_TRUE(d.empty()) << d.to_string();
  return config;
}

LaunchOptions options(const std::string& dir) {
  LaunchOptions o;
  o.experiment_dir = dir;
  o.working_dir = "/work/here";
  o.mpirun = "/usr/bin/mpirun";
  return o;
}

core::Allocation slurm_job() { return testing_launcher::two_node_job(); }

// The value after `flag` in argv ("" when absent).
std::string after(const std::vector<std::string>& argv, const std::string& flag) {
  const auto it = std::find(argv.begin(), argv.end(), flag);
  return it == argv.end() || it + 1 == argv.end() ? "" : *(it + 1);
}

bool has(const std::vector<std::string>& argv, const std::string& word) {
  return std::find(argv.begin(), argv.end(), word) != argv.end();
}

std::string joined(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& word : argv) out += word + " ";
  return out;
}

TEST(MpirunCommand, OnAWorkstationMapsBySlotWithoutBindingOrHostfile) {
  const auto c = build_mpirun_command(parse("resources: {slots_per_trial: 1}\n"), {}, options("/exp"), 0, core::MapEnv{});
  EXPECT_EQ(c.argv.front(), "/usr/bin/mpirun");
  EXPECT_EQ(after(c.argv, "-np"), "1");
  EXPECT_EQ(after(c.argv, "--map-by"), "slot");
  EXPECT_EQ(after(c.argv, "--bind-to"), "none");
  EXPECT_FALSE(has(c.argv, "--hostfile"));
  EXPECT_FALSE(has(c.argv, "--oversubscribe"));
  EXPECT_TRUE(has(c.argv, "--tag-output"));
  EXPECT_TRUE(c.hostfile_path.empty());
  EXPECT_EQ(c.np, 1);
  EXPECT_EQ(c.working_dir, "/work/here");
  // The trial's own command comes last, as configured.
  EXPECT_THAT(std::vector<std::string>(c.argv.end() - 2, c.argv.end()), ElementsAre("/opt/trial", "--fast"));
}

// The transport layer after `--mca` (empty when not chosen).
std::string pml(const std::vector<std::string>& argv) {
  for (std::size_t i = 0; i + 2 < argv.size(); ++i) {
    if (argv[i] == "--mca" && argv[i + 1] == "pml") return argv[i + 2];
  }
  return "";
}

TEST(MpirunCommand, OnAWorkstationTheSharedMemoryLayerIsChosenUnlessTheUserChoseOne) {
  EXPECT_EQ(pml(build_mpirun_command(parse(""), {}, options("/exp"), 0, core::MapEnv{}).argv), "ob1");
  const auto chosen = build_mpirun_command(parse("launcher: {mpirun_args: [--mca, pml, ucx]}\n"), {}, options("/exp"),
                                           0, core::MapEnv{});
  EXPECT_EQ(std::count(chosen.argv.begin(), chosen.argv.end(), "pml"), 1) << joined(chosen.argv);
  EXPECT_EQ(pml(chosen.argv), "ucx");
  core::MapEnv env;
  env.set("OMPI_MCA_pml", "ucx");
  EXPECT_EQ(pml(build_mpirun_command(parse(""), {}, options("/exp"), 0, env).argv), "");
  EXPECT_EQ(pml(build_mpirun_command(parse(""), slurm_job(), options("/exp"), 0, core::MapEnv{}).argv), "")
      << "in a job, the site's MPI chooses for its network";
}

TEST(MpirunCommand, MoreRanksThanCoresNeedOversubscribeOnAWorkstation) {
  const int too_many = static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) + 1;
  auto o = options("/exp");
  o.np = too_many;
  try {
    build_mpirun_command(parse(""), {}, o, 0, core::MapEnv{});
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr(std::to_string(too_many) + " ranks were asked for"));
    EXPECT_THAT(e.what(), HasSubstr("--oversubscribe"));
  }
  o.oversubscribe = true;
  const auto c = build_mpirun_command(parse(""), {}, o, 0, core::MapEnv{});
  EXPECT_EQ(after(c.argv, "-np"), std::to_string(too_many));
  EXPECT_TRUE(has(c.argv, "--oversubscribe"));
}

TEST(MpirunCommand, InAJobUsesAHostfileAndMapsAndBindsPerConfig) {
  const auto config = parse("resources: {slots_per_trial: 8, slots_per_node: 4, cpus_per_slot: 3}\n");
  const auto c = build_mpirun_command(config, slurm_job(), options("/exp"), 2, core::MapEnv{});
  EXPECT_EQ(after(c.argv, "-np"), "8");
  EXPECT_EQ(after(c.argv, "--hostfile"), "/exp/trial-0/launch/hostfile");
  EXPECT_EQ(c.hostfile_path, "/exp/trial-0/launch/hostfile");
  EXPECT_EQ(c.hostfile, "node1 slots=4\nnode2 slots=4\n");
  EXPECT_EQ(after(c.argv, "--map-by"), "ppr:4:node:PE=3");
  EXPECT_EQ(after(c.argv, "--bind-to"), "core");
  EXPECT_FALSE(has(c.argv, "--oversubscribe"));
}

// An elastic job runs slots_per_node ranks on each node it was granted, however Slurm spread its
// tasks, up to slots_per_trial; fewer nodes than min_slots_per_trial needs is an error.
TEST(MpirunCommand, AnElasticJobStartsAsManyRanksAsItsNodesHold) {
  const auto config = parse("resources: {slots_per_trial: 6, slots_per_node: 2, min_slots_per_trial: 2}\n");
  core::Allocation one = slurm_job();
  one.hosts = {{"node1", 6}};  // the six tasks packed on the one node granted
  auto c = build_mpirun_command(config, one, options("/exp"), 0, core::MapEnv{});
  EXPECT_EQ(after(c.argv, "-np"), "2");
  EXPECT_EQ(c.hostfile, "node1 slots=2\n");
  EXPECT_EQ(after(c.argv, "--map-by"), "ppr:2:node:PE=1");
  core::Allocation three = slurm_job();
  three.hosts = {{"node1", 2}, {"node2", 2}, {"node3", 2}};
  c = build_mpirun_command(config, three, options("/exp"), 0, core::MapEnv{});
  EXPECT_EQ(after(c.argv, "-np"), "6");
  auto workstation = options("/exp");
  workstation.oversubscribe = true;
  const auto outside = build_mpirun_command(config, core::Allocation{}, workstation, 0, core::MapEnv{});
  EXPECT_EQ(after(outside.argv, "-np"), "6") << "on a workstation: slots_per_trial";
  const auto too_few = parse("resources: {slots_per_trial: 6, slots_per_node: 2, min_slots_per_trial: 4}\n");
  try {
    build_mpirun_command(too_few, one, options("/exp"), 0, core::MapEnv{});
    FAIL() << "expected a SchedulerError";
  } catch (const SchedulerError& e) {
    EXPECT_THAT(e.what(), HasSubstr("slurm job 4242 has 2 slots on 1 node(s), fewer than "
                                    "resources.min_slots_per_trial (4)"));
  }
}

TEST(MpirunCommand, InAJobMoreRanksThanSlotsIsAnErrorNamingTheJob) {
  auto o = options("/exp");
  o.np = 9;
  try {
    build_mpirun_command(parse(""), slurm_job(), o, 0, core::MapEnv{});
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("slurm job 4242 has 8 slots on 2 node(s)"));
  }
}

TEST(MpirunCommand, TheGraceBecomesMpirunsSigkillTimeout) {
  const auto c = build_mpirun_command(parse("scheduler: {preemption_grace: 2m}\n"), {}, options("/exp"), 0,
                                      core::MapEnv{});
  const auto it = std::find(c.argv.begin(), c.argv.end(), "odls_base_sigkill_timeout");
  ASSERT_NE(it, c.argv.end());
  EXPECT_EQ(*(it - 1), "--mca");
  EXPECT_EQ(*(it + 1), "120");
}

// optimizations.network_interface: Open MPI's TCP transports and NCCL's sockets on it; one this
// host does not have is refused with the ones it has.
TEST(MpirunCommand, TheNetworkInterfaceSetsOpenMpisAndNcclsTransports) {
  const auto c = build_mpirun_command(parse("optimizations: {network_interface: lo}\n"), {}, options("/exp"), 0,
                                      core::MapEnv{});
  EXPECT_THAT(joined(c.argv), HasSubstr("--mca btl_tcp_if_include lo --mca oob_tcp_if_include lo "));
  const std::map<std::string, std::string> values(c.env.begin(), c.env.end());
  EXPECT_EQ(values.at("NCCL_SOCKET_IFNAME"), "lo");
  const auto named = std::find(c.argv.begin(), c.argv.end(), "NCCL_SOCKET_IFNAME");
  ASSERT_NE(named, c.argv.end());
  EXPECT_EQ(*(named - 1), "-x") << "passed by name, as every variable";
  const auto plain = build_mpirun_command(parse(""), {}, options("/exp"), 0, core::MapEnv{});
  EXPECT_FALSE(has(plain.argv, "btl_tcp_if_include"));
  try {
    build_mpirun_command(parse("optimizations: {network_interface: nosuch0}\n"), {}, options("/exp"), 0, core::MapEnv{});
    ADD_FAILURE() << "an interface this host lacks was taken";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("optimizations.network_interface is 'nosuch0', which " + core::host_name() +
                                    " does not have (it has: lo"));
  }
}

// optimizations.huge_pages (on unless set false): glibc's malloc is told to use transparent huge
// pages for the ranks, after the tunables the user set; a hugetlb of the user's own is kept.
TEST(MpirunCommand, HugePagesAreAskedOfGlibcAfterTheUsersTunables) {
  const auto tunables = [](const std::string& extra, const core::MapEnv& env) -> std::optional<std::string> {
    const auto c = build_mpirun_command(parse(extra), {}, options("/exp"), 0, env);
    for (const auto& [name, value] : c.env) {
      if (name == "GLIBC_TUNABLES") {
        EXPECT_TRUE(has(c.argv, "GLIBC_TUNABLES")) << "passed by name";
        return value;
      }
    }
    return std::nullopt;
  };
  EXPECT_EQ(tunables("", core::MapEnv{}), "glibc.malloc.hugetlb=1");
  EXPECT_EQ(tunables("", core::MapEnv(std::map<std::string, std::string>{{"GLIBC_TUNABLES", "glibc.malloc.arena_max=2"}})),
            "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1");
  EXPECT_EQ(tunables("", core::MapEnv(std::map<std::string, std::string>{{"GLIBC_TUNABLES", "glibc.malloc.hugetlb=0"}})), std::nullopt)
      << "the user's choice stays as the launcher's environment has it";
  EXPECT_EQ(tunables("optimizations: {huge_pages: false}\n", core::MapEnv{}), std::nullopt);
}

TEST(MpirunCommand, TheContractAndTheConfigEnvironmentTravelByNameOnly) {
  core::MapEnv env({{"MY_TOKEN", "s3cr3t-value"}, {"HPCTRIAL_FAULT", "rank1:step7:sigkill"}, {"UNRELATED", "x"}});
  const auto config = parse("environment: {TOKEN: '${env:MY_TOKEN}', OMP_NUM_THREADS: 6}\n");
  const auto c = build_mpirun_command(config, slurm_job(), options("/exp"), 3, env);
  std::map<std::string, std::string> values(c.env.begin(), c.env.end());
  EXPECT_EQ(values["HPCTRIAL_EXPERIMENT_DIR"], "/exp");
  EXPECT_EQ(values["HPCTRIAL_CONFIG"], "/exp/trial-0/launcher-config.yaml");
  EXPECT_EQ(values["HPCTRIAL_TRIAL_ID"], "0");
  EXPECT_EQ(values["HPCTRIAL_TRIAL_DIR"], "/exp/trial-0");
  EXPECT_EQ(values["HPCTRIAL_RESTART_COUNT"], "3");
  EXPECT_EQ(values["HPCTRIAL_SCHEDULER"], "slurm");
  EXPECT_EQ(values["HPCTRIAL_JOB_ID"], "4242");
  EXPECT_EQ(values["HPCTRIAL_STOP_FILE"], "/exp/trial-0/stop-request");
  EXPECT_EQ(values["HPCTRIAL_HEARTBEAT_DIR"], "/exp/trial-0/launch/heartbeat");
  EXPECT_EQ(values["HPCTRIAL_ABORT_FILE"], "/exp/trial-0/launch/abort-3") << "one per attempt";
  EXPECT_EQ(values["HPCTRIAL_FAULT"], "rank1:step7:sigkill");
  EXPECT_EQ(values["TOKEN"], "s3cr3t-value");
  EXPECT_EQ(values["OMP_NUM_THREADS"], "6");
  EXPECT_EQ(values.count("UNRELATED"), 0u) << "only the contract and the config's environment are passed";
  for (const auto& [name, value] : c.env) {
    const auto it = std::find(c.argv.begin(), c.argv.end(), name);
    ASSERT_NE(it, c.argv.end()) << name;
    EXPECT_EQ(*(it - 1), "-x") << name;
  }
  EXPECT_THAT(joined(c.argv), Not(HasSubstr("s3cr3t-value")));
}

TEST(MpirunCommand, AMissingEnvReferenceNamesTheKey) {
  const auto config = parse("environment: {TOKEN: '${env:NOT_SET_ANYWHERE}'}\n");
  try {
    build_mpirun_command(config, {}, options("/exp"), 0, core::MapEnv{});
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("environment.TOKEN"));
    EXPECT_THAT(e.what(), HasSubstr("NOT_SET_ANYWHERE"));
  }
}

TEST(MpirunCommand, ExtraArgumentsThenPrefixThenTheProgram) {
  const auto config = parse("launcher: {mpirun_args: [--mca, btl, '^openib'], prefix: [numactl, --interleave=all]}\n");
  const auto c = build_mpirun_command(config, {}, options("/exp"), 0, core::MapEnv{});
  const auto tail = std::vector<std::string>(c.argv.end() - 7, c.argv.end());
  EXPECT_THAT(tail, ElementsAre("--mca", "btl", "^openib", "numactl", "--interleave=all", "/opt/trial", "--fast"));
}

TEST(MpirunCommand, ATrialLibraryRunsInTheWorker) {
  const std::string yaml = R"(name: t
entrypoint: /opt/libtrial.so:MyTrial
searcher: {name: single, metric: loss, max_length: {batches: 10}}
)";
  core::Diagnostics d;
  auto config = core::parse_experiment_config(core::parse_config_text(yaml, "exp.yaml", d), d);
  ASSERT_TRUE(d.empty()) << d.to_string();
  auto o = options("/exp");
  EXPECT_THROW(build_mpirun_command(config, {}, o, 0, core::MapEnv{}), ConfigError) << "no worker known";
  o.worker = "/opt/hpctrial/bin/hpctrial-worker";
  const auto c = build_mpirun_command(config, {}, o, 0, core::MapEnv{});
  EXPECT_EQ(c.argv.back(), "/opt/hpctrial/bin/hpctrial-worker");
}

TEST(MpirunCommand, HpctrialMpirunChoosesTheProgramWhenNoneIsGiven) {
  auto o = options("/exp");
  o.mpirun.clear();
  EXPECT_EQ(build_mpirun_command(parse(""), {}, o, 0, core::MapEnv{}).argv.front(), "mpirun");
  core::MapEnv env;
  env.set("HPCTRIAL_MPIRUN", "/opt/ompi/bin/mpirun");
  EXPECT_EQ(build_mpirun_command(parse(""), {}, o, 0, env).argv.front(), "/opt/ompi/bin/mpirun");
}

TEST(ExpandEnvReferences, ReplacesEachReferenceAndLeavesOtherDollarsAlone) {
  core::MapEnv env({{"A", "1"}, {"B", "two"}});
  EXPECT_EQ(core::expand_env_references("${env:A}-${env:B}/$HOME/${other}", env, "k"), "1-two/$HOME/${other}");
  EXPECT_EQ(core::expand_env_references("", env, "k"), "");
  EXPECT_EQ(core::expand_env_references("plain", env, "k"), "plain");
}

}  // namespace
}  // namespace hpctrial::launcher
