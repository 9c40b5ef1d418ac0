// launcher.mpi: srun - the launcher's srun command inside a Slurm job, its labelled output split
// per rank, and srun's words about the first task that failed (texts as Slurm 22.05 prints them).
// No process is started.
#include <fcntl.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "../../support/read_file.h"
#include "../../support/temp_dir.h"
#include "hpctrial/core/config_node.h"
#include "hpctrial/core/diagnostics.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/scheduler.h"
#include "hpctrial/launcher/launcher.h"
#include "two_node_job.h"
#include "hpctrial/launcher/schedulers.h"
#include "launcher_internal.h"

namespace hpctrial::launcher {
namespace {

using testing::ElementsAre;
using testing::HasSubstr;
using testing::Not;
using testing_support::read_file;
using testing_support::TempDir;

core::ExperimentConfig parse(const std::string& extra) {
  const std::string yaml = std::string("name: t\nentrypoint: [/opt/trial, --fast]\n"
                           "searcher: {name: single, metric: loss, max_length: {batches: 10}}\n") +
                           (extra.find("launcher:") == std::string::npos ? "launcher: {mpi: srun}\n" : "") + extra;
  core::Diagnostics d;
  core::ExperimentConfig config = core::parse_experiment_config(core::parse_config_text(yaml, "exp.yaml", d), d);
  EXPECT_TRUE(d.empty()) << d.to_string();
  return config;
}

LaunchOptions options() {
  LaunchOptions o;
  o.experiment_dir = "/exp";
  o.working_dir = "/work/here";
  o.rank_parent = {"/usr/bin/hpctrial", "_rank", "--"};
  return o;
}

core::Allocation slurm_job() { return testing_launcher::two_node_job(); }

bool has(const std::vector<std::string>& argv, const std::string& word) {
  return std::find(argv.begin(), argv.end(), word) != argv.end();
}

TEST(SrunCommand, OneStepOfTheJobATaskARankWiredUpByPmix) {
  const auto config = parse("resources: {slots_per_trial: 8, slots_per_node: 4, cpus_per_slot: 3}\n"
                            "launcher: {mpi: srun, srun_args: [--network=sn_single], prefix: [numactl, -l]}\n");
  const auto c = build_mpirun_command(config, slurm_job(), options(), 1, core::MapEnv{});
  EXPECT_TRUE(c.srun);
  EXPECT_EQ(c.np, 8);
  EXPECT_TRUE(c.hostfile_path.empty()) << "Slurm places the tasks";
  EXPECT_THAT(c.argv, ElementsAre("srun", "--mpi=pmix", "--ntasks=8", "--nodes=2", "--ntasks-per-node=4",
                                  "--cpus-per-task=3", "--cpu-bind=cores", "--kill-on-bad-exit=0", "--label",
                                  "--export=ALL", "--network=sn_single", "/usr/bin/hpctrial", "_rank", "--", "numactl",
                                  "-l", "/opt/trial", "--fast"));
  // The contract travels in srun's environment (--export=ALL), never in argv.
  const auto abort_file = std::find_if(c.env.begin(), c.env.end(), [](const auto& v) {
    return v.first == core::kEnvAbortFile;
  });
  ASSERT_NE(abort_file, c.env.end());
  EXPECT_EQ(abort_file->second, "/exp/trial-0/launch/abort-1");
  for (const auto& word : c.argv) EXPECT_THAT(word, Not(HasSubstr("/exp/"))) << "no value of the contract in argv";
}

TEST(SrunCommand, OversubscribedTasksShareCoresUnbound) {
  const auto config = parse("resources: {slots_per_trial: 2}\n");
  auto o = options();
  o.oversubscribe = true;
  core::Allocation one = slurm_job();
  one.hosts = {{"vm", 1}};
  core::MapEnv env;
  env.set("HPCTRIAL_SRUN", "/opt/slurm/bin/srun");
  const auto c = build_mpirun_command(config, one, o, 0, env);
  EXPECT_EQ(c.argv.front(), "/opt/slurm/bin/srun");
  EXPECT_TRUE(has(c.argv, "--cpu-bind=none"));
  EXPECT_TRUE(has(c.argv, "--overcommit"));
  EXPECT_TRUE(has(c.argv, "--nodes=1"));
}

TEST(SrunCommand, OutsideASlurmJobIsAnErrorSayingWhatToDo) {
  const auto config = parse("");
  try {
    build_mpirun_command(config, {}, options(), 0, core::MapEnv{});
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "launcher.mpi is srun, which starts the ranks as a step of a Slurm job, but this run is in "
                           "no job (SLURM_JOB_ID is not set); submit it with scheduler.type: slurm, run it inside "
                           "salloc, or set launcher.mpi: mpirun");
  }
  core::Allocation pbs = slurm_job();
  pbs.scheduler = "pbs";
  EXPECT_THROW(build_mpirun_command(config, pbs, options(), 0, core::MapEnv{}), ConfigError);
  auto too_many = options();
  too_many.np = 9;
  try {
    build_mpirun_command(config, slurm_job(), too_many, 0, core::MapEnv{});
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("9 ranks were asked for but slurm job 4242 has 8 slots on 2 node(s)"));
  }
}

TEST(SrunCommand, APbsConfigIsRefusedAtTheLineOfItsScheduler) {
  core::Diagnostics d;
  const std::string yaml = "name: t\nentrypoint: /opt/trial\nsearcher: {name: single, metric: loss, max_length: "
                           "{batches: 10}}\nlauncher: {mpi: srun}\nscheduler: {type: pbs}\n";
  const auto config = core::parse_experiment_config(core::parse_config_text(yaml, "exp.yaml", d), d);
  ASSERT_TRUE(d.empty()) << d.to_string();
  core::check_scheduler_config(config, schedulers(), d);
  EXPECT_EQ(d.to_string(), "exp.yaml:5:19: scheduler.type: is pbs, whose jobs do not start ranks with srun, but "
                           "launcher.mpi is srun; set launcher.mpi: mpirun");
  for (const char* type : {"slurm", "local"}) {
    core::Diagnostics fine;
    core::check_scheduler_config(parse(std::string("scheduler: {type: ") + type + "}\n"), schedulers(), fine);
    EXPECT_TRUE(fine.empty()) << type << ": " << fine.to_string();
  }
}

TEST(SrunCommand, TheNetworkInterfaceGoesToOpenMpiThroughTheEnvironment) {
  const auto config = parse("optimizations: {network_interface: lo}\n"
                            "environment: {OMPI_MCA_btl_tcp_if_include: lo}\n");
  const auto c = build_mpirun_command(config, slurm_job(), options(), 0, core::MapEnv{});
  std::vector<std::string> tcp;
  for (const auto& [name, value] : c.env) {
    if (name == "OMPI_MCA_btl_tcp_if_include") tcp.push_back(value);
  }
  EXPECT_THAT(tcp, ElementsAre("lo", "lo")) << "the config's environment comes last, and has the last word";
  EXPECT_FALSE(has(c.argv, "--mca"));
}

// environment.container_runtime: enroot, as rendered text only (pyxis is not in Debian): pyxis
// starts each task in the image, the rank's parent included, which is then the image's hpctrial.
TEST(SrunCommand, AnEnrootImageIsPyxisOptionsAndTheImagesHpctrialIsTheRanksParent) {
  const auto config = parse("launcher: {mpi: srun}\nenvironment: {image: \"nvcr.io#nvidia/pytorch:24.01\", "
                            "container_runtime: enroot, bind: [/scratch/data:/data:ro]}\n");
  const auto c = build_mpirun_command(config, slurm_job(), options(), 0, core::MapEnv{});
  const auto from = std::find(c.argv.begin(), c.argv.end(), "--export=ALL") + 1;
  EXPECT_THAT(std::vector<std::string>(from, c.argv.end()),
              ElementsAre("--container-image=nvcr.io#nvidia/pytorch:24.01",
                          "--container-mounts=/exp:/exp,/work/here:/work/here,/tmp:/tmp,/scratch/data:/data:ro",
                          "--container-workdir=/work/here", "hpctrial", "_rank", "--", "/opt/trial", "--fast"));
  for (const auto& [name, value] : c.env) {
    EXPECT_NE(name, "HPCTRIAL_RANK_CONTAINER") << "the rank's parent sees the rank's own end, not a runtime's";
  }
  auto comma = options();
  comma.experiment_dir = "/scratch/a,b";
  try {
    build_mpirun_command(config, slurm_job(), comma, 0, core::MapEnv{});
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("/scratch/a,b:/scratch/a,b in their container, but pyxis' --container-mounts "
                                    "splits its mounts at ',' and cannot name a path with ','"));
  }
}

TEST(SrunOutput, LabelledLinesAreShownWithTheirRankAndSrunsOwnWordsAreKept) {
  TempDir dir;
  const std::string out_path = (dir.path() / "out").string(), err_path = (dir.path() / "err").string();
  const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  {
    detail::RankOutput output(core::TrialLayout{dir.path().string()}, out, err, true);
    const std::string text = " 0: loss 0.5\n11: [rank 11] INFO ready\n";
    output.feed(text.data(), text.size(), false);
    const std::string words = "srun: error: vm: task 1: Killed\n 1: warning: slow\n";
    output.feed(words.data(), words.size(), true);
    EXPECT_THAT(output.tail(0), ElementsAre("loss 0.5"));
    EXPECT_THAT(output.tail(1), ElementsAre("warning: slow"));
    EXPECT_EQ(output.mpirun_text(), "srun: error: vm: task 1: Killed\n");
  }
  ::close(out);
  ::close(err);
  EXPECT_EQ(read_file(out_path), "[rank 0] loss 0.5\n[rank 11] INFO ready\n");
  EXPECT_EQ(read_file(err_path), "srun: error: vm: task 1: Killed\n[rank 1] warning: slow\n");
  EXPECT_EQ(read_file((dir.path() / "logs" / "rank-11.log").string()), "[rank 11] INFO ready\n");
}

TEST(ParseSrunFailure, TheFirstTaskReportedWithItsCodeOrSignal) {
  auto f = detail::parse_mpirun_failure("srun: error: cn7: task 1: Exited with exit code 3\n");
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.host, "cn7");
  EXPECT_EQ(f.exit_code, 3);
  EXPECT_EQ(f.how, "exited with code 3");
  f = detail::parse_mpirun_failure("srun: error: vm: tasks 2-3: Killed\nsrun: error: vm: task 0: Exited with exit code 1\n");
  EXPECT_EQ(f.rank, 2);
  EXPECT_EQ(f.signal, 9);
  EXPECT_EQ(f.how, "was killed by signal 9 (Killed)");
  f = detail::parse_mpirun_failure("srun: error: vm: task 0: Segmentation fault (core dumped)\n");
  EXPECT_EQ(f.rank, 0);
  EXPECT_EQ(f.signal, 11);
  EXPECT_EQ(f.how, "was killed by signal 11 (Segmentation fault)");
  f = detail::parse_mpirun_failure("srun: error: vm: task 3: Out Of Memory\n");
  EXPECT_EQ(f.rank, 3);
  EXPECT_FALSE(f.signal || f.exit_code);
  EXPECT_EQ(f.how, "ended: Out Of Memory (srun's words)");
}

TEST(ParseSrunFailure, RanksThatStoppedOnRequestOrFinishedAreNoFailure) {
  EXPECT_EQ(detail::parse_mpirun_failure("srun: error: vm: tasks 0-1: Exited with exit code 75\n").rank, -1);
  EXPECT_EQ(detail::parse_mpirun_failure("srun: error: vm: tasks 0,2: Exited with exit code 75\n"
                                         "srun: error: vm: task 1: Exited with exit code 2\n")
                .rank,
            1);
}

// LOCAL_WORLD_SIZE under srun: each node's count in SLURM_STEP_TASKS_PER_NODE.
TEST(SrunTasksPerNode, EachNodesCountAsSlurmWritesThem) {
  EXPECT_EQ(detail::tasks_on_node("4", 0), "4");
  EXPECT_EQ(detail::tasks_on_node("2(x3),1", 0), "2");
  EXPECT_EQ(detail::tasks_on_node("2(x3),1", 2), "2");
  EXPECT_EQ(detail::tasks_on_node("2(x3),1", 3), "1");
  EXPECT_EQ(detail::tasks_on_node("2(x3),1", 4), std::nullopt);
  EXPECT_EQ(detail::tasks_on_node("3,1(x2)", 2), "1");
  EXPECT_EQ(detail::tasks_on_node("2(x3", 0), std::nullopt);
  EXPECT_EQ(detail::tasks_on_node("", 0), std::nullopt);
  EXPECT_EQ(detail::tasks_on_node("x", 0), std::nullopt);
}

}  // namespace
}  // namespace hpctrial::launcher
