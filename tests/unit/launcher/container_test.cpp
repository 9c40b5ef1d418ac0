// environment.image: the config's keys and their errors, the mounts, and each runtime's command
// line as the launcher renders it (podman's is also run for real in the slurm tier:
// tests/slurm/slurm_container_test.cpp; apptainer's and singularity's are only rendered here).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "../../support/temp_dir.h"
#include "container.h"
#include "hpctrial/core/config_node.h"
#include "hpctrial/core/diagnostics.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/launcher/launcher.h"

namespace hpctrial::launcher {
namespace {

using testing::ElementsAre;
using testing::HasSubstr;

const char* const kHead = "name: t\nentrypoint: [/opt/trial, --fast]\n"
                          "searcher: {name: single, metric: loss, max_length: {batches: 10}}\n";

core::ExperimentConfig parse_text(const std::string& yaml, std::string* errors = nullptr) {
  core::Diagnostics d;
  const core::ConfigNode root = core::parse_config_text(yaml, "exp.yaml", d);
  core::ExperimentConfig config = core::parse_experiment_config(root, d);
  if (errors != nullptr) {
    *errors = d.to_string();
  } else {
    EXPECT_TRUE(d.empty()) << d.to_string();
  }
  return config;
}

core::ExperimentConfig parse(const std::string& extra, std::string* errors = nullptr) {
  return parse_text(kHead + extra, errors);
}

std::string errors_of(const std::string& extra) {
  std::string errors;
  parse(extra, &errors);
  return errors;
}

std::string joined_mounts(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& word : argv) out += word + " ";
  return out;
}

TEST(ContainerConfig, ImageRuntimeAndBindsAreSettingsNotVariables) {
  const auto c = parse("environment: {OMP_NUM_THREADS: \"4\", image: localhost/mine:1, container_runtime: podman, "
                       "bind: [/scratch//me/, \"/data/in:/in:ro\", /a:/b:rw]}\n");
  ASSERT_EQ(c.environment.size(), 1u) << "image, container_runtime and bind are no variables";
  EXPECT_EQ(c.environment[0].name, "OMP_NUM_THREADS");
  EXPECT_EQ(c.container.image, "localhost/mine:1");
  EXPECT_EQ(c.container.runtime, core::Container::Runtime::kPodman);
  EXPECT_THAT(c.container.binds, ElementsAre("/scratch/me/:/scratch/me/", "/data/in:/in:ro", "/a:/b:rw"));
  // Written into the experiment's config and read back the same.
  const auto again = parse_text(core::to_yaml(c));
  EXPECT_EQ(again.container.image, c.container.image);
  EXPECT_EQ(again.container.runtime, c.container.runtime);
  EXPECT_EQ(again.container.binds, c.container.binds);
  EXPECT_EQ(again.environment.size(), 1u);
  EXPECT_TRUE(parse("").container.image.empty());
}

TEST(ContainerConfig, MistakesAreLocatedAndSayWhatToWrite) {
  EXPECT_THAT(errors_of("environment: {image: a.sif}\n"),
              HasSubstr("exp.yaml:4:22: environment.image: needs environment.container_runtime: podman, apptainer, "
                        "singularity or enroot"));
  EXPECT_THAT(errors_of("environment: {image: a.sif, container_runtime: docker}\n"),
              HasSubstr("exp.yaml:4:48: environment.container_runtime: is \"docker\"; write podman, apptainer, "
                        "singularity or enroot"));
  EXPECT_THAT(errors_of("environment: {image: a.sqsh, container_runtime: enroot}\n"),
              HasSubstr("exp.yaml:4:49: environment.container_runtime: is enroot, whose containers Slurm's pyxis "
                        "plugin starts for srun (--container-image); set launcher.mpi: srun"));
  EXPECT_EQ(errors_of("environment: {image: a.sqsh, container_runtime: enroot}\nlauncher: {mpi: srun}\n"), "");
  EXPECT_THAT(errors_of("environment: {container_runtime: podman}\n"),
              HasSubstr("environment.container_runtime: has no image to run; set environment.image"));
  EXPECT_THAT(errors_of("environment: {image: i, container_runtime: podman, bind: [data:/data]}\n"),
              HasSubstr("environment.bind[0]: the host path \"data\" is not absolute"));
  EXPECT_THAT(errors_of("environment: {image: i, container_runtime: podman, bind: [/d:/e:rx]}\n"),
              HasSubstr("environment.bind[0]: is \"/d:/e:rx\"; write HOST, HOST:CONTAINER or HOST:CONTAINER:ro"));
  EXPECT_THAT(errors_of("environment: {image: i, container_runtime: podman, bind: /d}\n"),
              HasSubstr("environment.bind: must be a list of mounts"));
  EXPECT_THAT(errors_of("environment: {image: i, container_runtime: podman, bind: [\"~/d\"]}\n"),
              HasSubstr("environment.bind[0]: the host path \"~/d\" is not absolute"));
}

TEST(ContainerMounts, EachFolderTheRanksNeedOnceAndTheUsersBindsLast) {
  testing_support::TempDir dir;
  const std::string data = dir.write("work/data/train.h5", "x");
  const std::string work = (dir.path() / "work").string();
  const std::string outside = dir.write("elsewhere/val.h5", "x");
  const auto c = parse("checkpoint_storage: {host_path: /scratch/ckpt}\n"
                       "data: {train: data/train.h5, val: " + outside + ", gone: /no/such/file, name: x}\n"
                       "environment: {image: i, container_runtime: podman, bind: [/site:/local/tmp]}\n");
  const auto mounts = detail::container_mounts(c, "/scratch/exp", work, core::MapEnv(std::map<std::string, std::string>{{"TMPDIR", "/local/tmp"}}));
  // The working directory holds data/train.h5; $TMPDIR is replaced by the user's bind onto it.
  EXPECT_THAT(mounts, ElementsAre("/scratch/exp:/scratch/exp", work + ":" + work,
                                  "/scratch/ckpt:/scratch/ckpt", outside + ":" + outside, "/site:/local/tmp"));
  (void)data;
  // A mount cannot name a path with ':' in it.
  try {
    detail::container_mounts(c, "/scratch/exp:1", work, core::MapEnv(std::map<std::string, std::string>{{"TMPDIR", "/t"}}));
    ADD_FAILURE() << "an experiment directory with ':' was mounted";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("the ranks need /scratch/exp:1 in their container, but a mount cannot name a path "
                                    "with ':' in it"));
  }
}

TEST(ContainerCommand, PodmanSharesTheHostsNetworkIpcAndPidsAndPassesVariablesByName) {
  core::Container container{"localhost/mine:1", core::Container::Runtime::kPodman, {}};
  detail::ContainerCommandInput in;
  in.mounts = {"/exp:/exp", "/d:/data:ro"};
  in.passed = {"OMPI_*", "MY_TOKEN"};
  in.working_dir = "/work";
  in.rootless = true;
  EXPECT_THAT(detail::container_command(container, in),
              ElementsAre("podman", "run", "--rm", "--net=host", "--ipc=host", "--pid=host", "--ulimit", "host", "--security-opt",
                          "label=disable", "--userns=keep-id", "-v", "/exp:/exp", "-v", "/d:/data:ro", "-w", "/work",
                          "-e", "OMPI_*", "-e", "MY_TOKEN", "localhost/mine:1"));
  in.rootless = false;
  in.gpus = true;
  const auto rootful = detail::container_command(container, in);
  EXPECT_EQ(std::count(rootful.begin(), rootful.end(), "--userns=keep-id"), 0);
  EXPECT_THAT(rootful, testing::Contains("nvidia.com/gpu=all"));
}

TEST(ContainerCommand, ApptainerAndSingularityBindAndPassTheGpusWithNv) {
  detail::ContainerCommandInput in;
  in.mounts = {"/exp:/exp"};
  in.passed = {"OMPI_*"};
  in.working_dir = "/work";
  in.gpus = true;
  EXPECT_THAT(detail::container_command({"/images/t.sif", core::Container::Runtime::kApptainer, {}}, in),
              ElementsAre("apptainer", "exec", "--nv", "--bind", "/exp:/exp", "--pwd", "/work", "/images/t.sif"));
  in.gpus = false;
  EXPECT_THAT(detail::container_command({"docker://x/y:1", core::Container::Runtime::kSingularity, {}}, in),
              ElementsAre("singularity", "exec", "--bind", "/exp:/exp", "--pwd", "/work", "docker://x/y:1"));
  // --bind splits its value at ',': a data folder with one would become two broken binds.
  in.mounts = {"/exp:/exp", "/data/a,b:/data/a,b"};
  for (const auto runtime : {core::Container::Runtime::kApptainer, core::Container::Runtime::kSingularity}) {
    try {
      detail::container_command({"/images/t.sif", runtime, {}}, in);
      ADD_FAILURE() << "a mount with ',' was bound";
    } catch (const ConfigError& e) {
      EXPECT_THAT(e.what(), HasSubstr("the ranks need /data/a,b:/data/a,b in their container, but " +
                                      std::string(core::runtime_name(runtime)) + "'s --bind splits its mounts at ','"));
    }
  }
}

TEST(ContainerCommand, SitsBetweenTheRankParentAndTheProgramAndNoValueEntersArgv) {
  testing_support::TempDir dir;
  const std::string exp = (dir.path() / "exp").string();
  LaunchOptions o;
  o.experiment_dir = exp;
  o.working_dir = "/work/here";
  o.mpirun = "/usr/bin/mpirun";
  o.rank_parent = {"/opt/hpctrial/bin/hpctrial", "_rank", "--"};
  const auto config = parse("environment: {SECRET: \"${env:TOKEN}\", image: /i.sif, container_runtime: apptainer}\n");
  const auto c = build_mpirun_command(config, {}, o, 0, core::MapEnv(std::map<std::string, std::string>{{"TOKEN", "hunter2"}}));
  const auto parent = std::find(c.argv.begin(), c.argv.end(), "_rank");
  ASSERT_NE(parent, c.argv.end());
  EXPECT_THAT(std::vector<std::string>(parent + 2, parent + 4), ElementsAre("apptainer", "exec"));
  EXPECT_THAT(std::vector<std::string>(c.argv.end() - 3, c.argv.end()), ElementsAre("/i.sif", "/opt/trial", "--fast"));
  for (const auto& word : c.argv) EXPECT_EQ(word.find("hunter2"), std::string::npos) << word;
  // A library entrypoint runs the image's own hpctrial-worker.
  auto library = config;
  library.entrypoint.kind = core::Entrypoint::Kind::kLibrary;
  library.entrypoint.library = "/lib/libt.so";
  o.worker = "/opt/hpctrial/bin/hpctrial-worker";
  const auto l = build_mpirun_command(library, {}, o, 0, core::MapEnv(std::map<std::string, std::string>{{"TOKEN", "x"}}));
  EXPECT_THAT(std::vector<std::string>(l.argv.end() - 2, l.argv.end()), ElementsAre("/i.sif", "hpctrial-worker"));
  EXPECT_THAT(joined_mounts(l.argv), HasSubstr("--bind /lib:/lib"));
}

}  // namespace
}  // namespace hpctrial::launcher
