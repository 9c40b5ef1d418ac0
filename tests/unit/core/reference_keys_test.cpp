// The keys of Determined's experiment config that hpctrial takes: each read as hpctrial's own
// spelling of it (the same config, the same YAML from `config show`), a key set both ways to
// different values refused at both places, and the keys it does not take refused by name.
#include <fstream>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "hpctrial/core/experiment_config.h"

namespace hpctrial::core {
namespace {

using testing::ElementsAre;
using testing::HasSubstr;

// The registry's names, whose sections of Determined's config a config may hold.
const std::vector<std::string> kSchedulers = {"local", "slurm", "pbs"};

const char* kBase = R"(name: t
entrypoint: ./trial
searcher: {name: single, metric: loss, max_length: {batches: 10}}
)";

std::vector<std::string> errors_of(const std::string& yaml) {
  Diagnostics d;
  const ConfigNode root = parse_config_text(yaml, "exp.yaml", d);
  if (d.empty()) parse_experiment_config(root, d, kSchedulers);
  std::vector<std::string> out;
  for (const auto& item : d.items()) out.push_back(item.to_string());
  return out;
}

ExperimentConfig parse_ok(const std::string& yaml) {
  Diagnostics d;
  const ConfigNode root = parse_config_text(yaml, "exp.yaml", d);
  ExperimentConfig config = parse_experiment_config(root, d, kSchedulers);
  EXPECT_TRUE(d.empty()) << d.to_string();
  return config;
}

std::string file(const char* name) {
  std::ifstream in(std::string(HPCTRIAL_SOURCE_DIR "/tests/unit/core/data/") + name);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Determined's spelling and hpctrial's give the same config, and config show's YAML of it.
TEST(ReferenceKeys, AreReadAsHpctrialsOwnSpelling) {
  const ExperimentConfig theirs = parse_ok(file("every_key_determined.yaml"));
  const ExperimentConfig ours = parse_ok(R"(name: determined-keys
entrypoint: ./trial
searcher: {name: single, metric: loss, max_length: {batches: 10}}
resources: {slots_per_trial: 8, gpus_per_slot: 1, slots_per_node: 4}
scheduler: {type: slurm, partition: gpu, gpu_type: a100, extra_directives: [--mail-type=END]}
environment:
  image: docker://nvcr.io/nvidia/pytorch:24.01-py3
  container_runtime: apptainer
  bind: [/scratch/data:/data:ro, /opt/site:/opt/site]
  NCCL_DEBUG: INFO
  EMPTY: ""
  WITH_EQUALS: a=b
)");
  EXPECT_EQ(to_yaml(theirs), to_yaml(ours));
  EXPECT_EQ(theirs.resources.slots_per_node, 4);
  EXPECT_THAT(theirs.scheduler.extra_directives, ElementsAre("--mail-type=END")) << "pbs's are PBS's only";
  EXPECT_EQ(theirs.scheduler.option("gpu_type"), "a100");
  EXPECT_THAT(theirs.container.binds, ElementsAre("/scratch/data:/data:ro", "/opt/site:/opt/site"));
  ASSERT_EQ(theirs.environment.size(), 3u) << "cuda's list, as gpus_per_slot is 1";
  EXPECT_EQ(theirs.environment[2].name, "WITH_EQUALS");
  EXPECT_EQ(theirs.environment[2].value, "a=b");
  // The shown config reads back as itself, with none of Determined's keys in it.
  const std::string shown = to_yaml(theirs);
  EXPECT_THAT(shown, testing::Not(HasSubstr("sbatch_args")));
  EXPECT_THAT(shown, testing::Not(HasSubstr("bind_mounts")));
  EXPECT_EQ(to_yaml(parse_ok(shown)), shown);
}

TEST(ReferenceKeys, EachSchedulersSectionCountsUnderItOnly) {
  const std::string sections = "slurm: {sbatch_args: [--exclusive], gpu_type: h100}\n"
                               "pbs: {pbsbatch_args: [\"-l place=scatter\"]}\n";
  EXPECT_THAT(parse_ok(std::string(kBase) + "scheduler: {type: pbs}\n" + sections).scheduler.extra_directives,
              ElementsAre("-l place=scatter"));
  const ExperimentConfig slurm = parse_ok(std::string(kBase) + "scheduler: {type: slurm}\n" + sections);
  EXPECT_THAT(slurm.scheduler.extra_directives, ElementsAre("--exclusive"));
  EXPECT_EQ(slurm.scheduler.option("gpu_type"), "h100");
  const ExperimentConfig local = parse_ok(std::string(kBase) + sections);
  EXPECT_TRUE(local.scheduler.extra_directives.empty());
  // Appended to hpctrial's own directives; the cpu list where no GPU is asked for.
  const ExperimentConfig both = parse_ok(std::string(kBase) +
                                         "scheduler: {type: slurm, extra_directives: [--exclusive]}\n"
                                         "slurm: {sbatch_args: [--mail-type=END]}\n"
                                         "environment: {environment_variables: {cpu: [A=1], cuda: [A=2]}}\n");
  EXPECT_THAT(both.scheduler.extra_directives, ElementsAre("--exclusive", "--mail-type=END"));
  ASSERT_EQ(both.environment.size(), 1u);
  EXPECT_EQ(both.environment[0].value, "1");
  // gpus_per_slot written "00" asks for none.
  const ExperimentConfig zero = parse_ok(std::string(kBase) + "resources: {gpus_per_slot: 00}\n"
                                         "environment: {environment_variables: {cpu: [A=1], cuda: [A=2]}}\n");
  ASSERT_EQ(zero.environment.size(), 1u);
  EXPECT_EQ(zero.environment[0].value, "1");
}

TEST(ReferenceKeys, MistakesAndConflictsNameTheirPlaces) {
  EXPECT_THAT(errors_of(std::string(kBase) + "resources: {slots_per_trial: 8, slots_per_node: 2}\n"
                                              "slurm: {slots_per_node: 4}\n"),
              ElementsAre("exp.yaml:5:25: slurm.slots_per_node: sets resources.slots_per_node, which exp.yaml:4:49 "
                          "sets to something else; keep one of the two"));
  EXPECT_TRUE(errors_of(std::string(kBase) + "resources: {slots_per_trial: 8, slots_per_node: 4}\n"
                                             "slurm: {slots_per_node: 4}\n")
                  .empty())
      << "the same value twice is no conflict";
  EXPECT_THAT(errors_of(std::string(kBase) + "environment: {A: x, environment_variables: [A=y]}\n"),
              ElementsAre(HasSubstr("exp.yaml:4:45: environment.environment_variables: sets environment.A, which exp.yaml:4:18 sets "
                                    "to something else")));
  EXPECT_THAT(errors_of(std::string(kBase) + "environment: {environment_variables: [NOEQUALS]}\n"),
              ElementsAre(HasSubstr("holds \"NOEQUALS\"; each entry is NAME=VALUE, e.g. NCCL_DEBUG=INFO")));
  EXPECT_THAT(errors_of(std::string(kBase) + "environment: {environment_variables: [HPCTRIAL_X=1]}\n"),
              ElementsAre(HasSubstr("variables starting with HPCTRIAL_ are set by hpctrial itself")));
  EXPECT_THAT(errors_of(std::string(kBase) + "bind_mounts: [{host_path: /a, container_path: /b}]\n"),
              ElementsAre("exp.yaml:4:14: bind_mounts: mounts folders into the ranks' containers, but "
                          "environment.image names none; without one the ranks see this machine's folders as they "
                          "are: leave bind_mounts out"));
  const std::string image = "environment: {image: x.sif, container_runtime: apptainer}\n";
  EXPECT_THAT(errors_of(std::string(kBase) + image + "bind_mounts: [{host_path: /a}]\n"),
              ElementsAre(HasSubstr("bind_mounts[0]: needs both host_path and container_path")));
  EXPECT_THAT(errors_of(std::string(kBase) + image + "bind_mounts: [{host_path: /a, container_path: b}]\n"),
              ElementsAre(HasSubstr("environment.bind[0]")));
  EXPECT_THAT(errors_of(std::string(kBase) + image +
                        "bind_mounts: [{host_path: /a, container_path: /b, propagation: shared}]\n"),
              ElementsAre(HasSubstr("bind_mounts[0].propagation: takes only rprivate here")));
  EXPECT_THAT(errors_of(std::string(kBase) + "scheduler: {type: slurm, gpu_type: a100}\nslurm: {gpu_type: h100}\n"),
              ElementsAre("exp.yaml:5:19: slurm.gpu_type: sets scheduler.gpu_type, which exp.yaml:4:36 sets to "
                          "something else; keep one of the two"));
  EXPECT_THAT(errors_of(std::string(kBase) + "slurm: [a]\n"),
              ElementsAre("exp.yaml:4:8: slurm: must be a map, e.g. slurm: {slots_per_node: 4}"));
  Diagnostics d;
  parse_experiment_config(parse_config_text(std::string(kBase) + "slurm: {gpu_type: a100}\n", "exp.yaml", d), d);
  EXPECT_THAT(d.to_string(), HasSubstr("slurm: unknown key")) << "a section only where the registry names it";
  EXPECT_THAT(errors_of(std::string(kBase) + "scheduler: {type: slurm}\nslurm: {sbatch_args: [exclusive]}\n"),
              ElementsAre(HasSubstr("must be an option such as --exclusive")));
}

}  // namespace
}  // namespace hpctrial::core
