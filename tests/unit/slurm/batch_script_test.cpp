// The sbatch script rendered from a config: every key where it belongs, hostile values either
// kept literal or refused with the key named, and the script clean for bash -n and shellcheck.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../../support/temp_dir.h"
#include "hpctrial/core/batch_job.h"
#include "hpctrial/core/config_node.h"
#include "hpctrial/core/diagnostics.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/slurm/batch_script.h"

namespace hpctrial::slurm {
namespace {

using testing::HasSubstr;
using testing::Not;
using testing_support::TempDir;

core::ExperimentConfig parse(const std::string& extra, const std::string& name = "exp") {
  core::Diagnostics d;
  const std::string yaml = "name: " + name + "\nentrypoint: /opt/trial\n"
                           "searcher: {name: single, metric: loss, max_length: {batches: 10}}\n" + extra;
  auto config = core::parse_experiment_config(core::parse_config_text(yaml, "exp.yaml", d), d);
  EXPECT_TRUE(d.empty()) << d.to_string();
  return config;
}

const BatchScriptOptions kOptions{"/scratch/me/runs/exp", "/opt/hpctrial/bin/hpctrial"};

// bash -n and shellcheck on the script.
void expect_clean(const std::string& script) {
  TempDir dir;
  const std::string path = dir.write("job.sbatch", script);
  const auto syntax = core::run_process({"bash", "-n", path});
  EXPECT_TRUE(syntax.ok()) << syntax.err << script;
  const auto lint = core::run_process({"shellcheck", path});
  EXPECT_TRUE(lint.ok()) << lint.out << script;
}

std::string error_of(const core::ExperimentConfig& config) {
  try {
    render_batch_script(config, kOptions);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(BatchScript, EveryKeyBecomesItsDirective) {
  const auto config = parse(R"(resources: {slots_per_trial: 8, slots_per_node: 4, cpus_per_slot: 6, gpus_per_slot: 1, memory_per_node: 64G}
scheduler:
  type: slurm
  partition: gpu
  account: proj-42
  qos: high
  time_limit: 1-02:30:00
  preemption_grace: 5m
  modules: [gcc/12, openmpi/4.1]
  environment: {NCCL_DEBUG: WARN, TOKEN: '${env:MY_TOKEN}'}
  extra_directives: [--exclusive, --constraint=a100]
)");
  const std::string s = render_batch_script(config, kOptions);
  for (const char* line : {"#SBATCH --job-name=exp\n", "#SBATCH --nodes=2\n", "#SBATCH --ntasks-per-node=4\n",
                           "#SBATCH --cpus-per-task=6\n", "#SBATCH --gpus-per-node=4\n", "#SBATCH --mem=65536M\n",
                           "#SBATCH --time=1-02:30:00\n", "#SBATCH --partition=gpu\n", "#SBATCH --account=proj-42\n",
                           "#SBATCH --qos=high\n", "#SBATCH --requeue\n", "#SBATCH --open-mode=append\n",
                           "#SBATCH --signal=B:USR2@300\n", "#SBATCH --output=/scratch/me/runs/exp/slurm-%j.out\n",
                           "#SBATCH --error=/scratch/me/runs/exp/slurm-%j.err\n", "#SBATCH --exclusive\n",
                           "#SBATCH --constraint=a100\n", "module load gcc/12 ", "module load openmpi/4.1 ",
                           "export NCCL_DEBUG=WARN\n",
                           "exec /opt/hpctrial/bin/hpctrial launch --experiment /scratch/me/runs/exp\n"}) {
    EXPECT_THAT(s, HasSubstr(line));
  }
  EXPECT_THAT(s, Not(HasSubstr("TOKEN"))) << "a value from the submitting environment is never written";
  EXPECT_EQ(s.rfind("#!/bin/bash -l\n", 0), 0u) << "modules need a login shell";
  // Every directive comes before the first command, or Slurm stops reading them.
  EXPECT_LT(s.rfind("#SBATCH"), s.find("\numask"));
  // Slurm's warning or a pause before the launcher handles them would end the job; the module
  // loads take seconds.
  EXPECT_LT(s.find("\ntrap '' USR1 USR2\n"), s.find("module load"));
  expect_clean(s);
}

TEST(BatchScript, DefaultsLeaveTheClusterToChoose) {
  const std::string s = render_batch_script(parse(""), kOptions);
  EXPECT_EQ(s.rfind("#!/bin/bash\n", 0), 0u);
  for (const char* absent : {"--time", "--partition", "--account", "--qos", "--mem", "--gpus", "module load",
                             "export "}) {
    EXPECT_THAT(s, Not(HasSubstr(absent)));
  }
  EXPECT_THAT(s, HasSubstr("#SBATCH --signal=B:USR2@180\n"));
  expect_clean(s);
}

// An elastic trial asks for a range of nodes and, as the most it runs, slots_per_trial tasks
// (Slurm gives no more nodes than tasks); a fixed one for its nodes and ranks per node.
TEST(BatchScript, AnElasticTrialAsksForARangeOfNodes) {
  const std::string s = render_batch_script(
      parse("resources: {slots_per_trial: 8, slots_per_node: 2, min_slots_per_trial: 4, cpus_per_slot: 3}\n"), kOptions);
  EXPECT_THAT(s, HasSubstr("#SBATCH --nodes=2-4\n#SBATCH --ntasks=8\n"));
  EXPECT_THAT(s, Not(HasSubstr("--ntasks-per-node")));
  EXPECT_THAT(s, HasSubstr("#SBATCH --cpus-per-task=3\n"));
  expect_clean(s);
  const std::string fixed = render_batch_script(parse("resources: {slots_per_trial: 8, slots_per_node: 2}\n"), kOptions);
  EXPECT_THAT(fixed, HasSubstr("#SBATCH --nodes=4\n#SBATCH --ntasks-per-node=2\n"));
}

// A search is one job array; each task runs the trial of its index, with its own output files.
TEST(BatchScript, ASearchIsAJobArrayThrottledByMaxConcurrentTrials) {
  core::Diagnostics d;
  const std::string yaml = "name: g\nentrypoint: /opt/trial\n"
                           "searcher: {name: grid, metric: loss, max_length: {batches: 10}, max_concurrent_trials: 2}\n"
                           "hyperparameters: {lr: {type: log, minval: -3, maxval: -1, count: 3}, "
                           "bs: {type: categorical, vals: [16, 32]}}\n";
  const auto config = core::parse_experiment_config(core::parse_config_text(yaml, "exp.yaml", d), d);
  ASSERT_TRUE(d.empty()) << d.to_string();
  const std::string s = render_batch_script(config, kOptions);
  for (const char* line : {"#SBATCH --array=0-5%2\n", "#SBATCH --output=/scratch/me/runs/exp/slurm-%A_%a.out\n",
                           "#SBATCH --error=/scratch/me/runs/exp/slurm-%A_%a.err\n",
                           "exec /opt/hpctrial/bin/hpctrial launch --experiment /scratch/me/runs/exp --trial "
                           "\"$SLURM_ARRAY_TASK_ID\"\n"}) {
    EXPECT_THAT(s, HasSubstr(line));
  }
  expect_clean(s);
  auto unthrottled = config;
  unthrottled.searcher.max_concurrent_trials = 16;
  EXPECT_THAT(render_batch_script(unthrottled, kOptions), HasSubstr("#SBATCH --array=0-5\n"));
  EXPECT_THAT(render_batch_script(parse(""), kOptions), Not(HasSubstr("--array")));
}

// An adaptive search: one array task per worker (max_concurrent_trials, at most max_trials),
// each a worker of the search; their output named as a worker's.
TEST(BatchScript, AnAdaptiveSearchIsAJobArrayOfWorkers) {
  core::Diagnostics d;
  const std::string yaml = "name: a\nentrypoint: /opt/trial\n"
                           "searcher: {name: adaptive_asha, metric: loss, max_length: {batches: 64}, max_trials: 16, "
                           "max_concurrent_trials: 3}\nhyperparameters: {lr: {type: log, minval: -3, maxval: -1}}\n"
                           "reproducibility: {experiment_seed: 1}\n";
  auto config = core::parse_experiment_config(core::parse_config_text(yaml, "exp.yaml", d), d);
  ASSERT_TRUE(d.empty()) << d.to_string();
  const std::string s = render_batch_script(config, kOptions);
  for (const char* line : {"#SBATCH --array=0-2\n", "#SBATCH --output=/scratch/me/runs/exp/slurm-%A_w%a.out\n",
                           "#SBATCH --error=/scratch/me/runs/exp/slurm-%A_w%a.err\n",
                           "exec /opt/hpctrial/bin/hpctrial launch --experiment /scratch/me/runs/exp --search-worker\n"}) {
    EXPECT_THAT(s, HasSubstr(line));
  }
  EXPECT_THAT(s, Not(HasSubstr("--trial")));
  expect_clean(s);
  config.searcher.max_trials = 2;  // no more workers than trials
  EXPECT_THAT(render_batch_script(config, kOptions), HasSubstr("#SBATCH --array=0-1\n"));
}

TEST(BatchScript, ExportedEnvironmentResolvesReferencesFromTheSubmitter) {
  core::MapEnv env;
  env.set("MY_TOKEN", "s3cr3t");
  const auto config = parse("scheduler: {type: slurm, environment: {A: plain, TOKEN: 'Bearer ${env:MY_TOKEN}'}}\n");
  const auto exported = core::exported_environment(config, env);
  ASSERT_EQ(exported.size(), 1u);
  EXPECT_EQ(exported[0].first, "TOKEN");
  EXPECT_EQ(exported[0].second, "Bearer s3cr3t");
  EXPECT_THAT(render_batch_script(config, kOptions), Not(HasSubstr("s3cr3t")));
  EXPECT_THROW(core::exported_environment(config, core::MapEnv{}), ConfigError) << "MY_TOKEN unset";
}

// The config refuses such names (one safe path component); the script does not rely on it
// (an experiment.yaml of an older hpctrial, a program that builds its config in code).
core::ExperimentConfig named(const std::string& name) {
  auto config = parse("");
  config.name = name;
  return config;
}

TEST(BatchScript, HostileNamesStayLiteralOrAreRefusedWithTheirKey) {
  // Blanks, '#', $(), backticks and ; are kept literal: double-quoted for Slurm, and never in a
  // bash line.
  for (const std::string& name : std::vector<std::string>{"my exp #1", "x$(touch /tmp/pwned)", "a`id`b", "a;b|c&d",
                                                         std::string(120, 'n')}) {
    const std::string s = render_batch_script(named(name), kOptions);
    EXPECT_THAT(s, HasSubstr("#SBATCH --job-name=")) << name;
    EXPECT_THAT(s.substr(s.find("\numask")), Not(HasSubstr(name.substr(0, 3)))) << "no name in the bash part";
    expect_clean(s);
  }
  EXPECT_THAT(render_batch_script(named("my exp #1"), kOptions), HasSubstr("#SBATCH --job-name=\"my exp #1\"\n"));
  EXPECT_THAT(error_of(named("say \"hi\"")), HasSubstr("name: holds a quote"));
  EXPECT_THAT(error_of(named("it's")), HasSubstr("name: holds a quote"));
  EXPECT_THAT(error_of(named("back\\slash")), HasSubstr("name: holds a backslash"));
  // The config reader refuses control characters in a name already; the script does too.
  auto two_lines = parse("");
  two_lines.name = "two\nlines";
  EXPECT_THAT(error_of(two_lines), HasSubstr("name: holds a line break"));
}

TEST(BatchScript, ExtraDirectivesAreOneOptionAndNotOursToChange) {
  EXPECT_THAT(error_of(parse("scheduler: {type: slurm, extra_directives: [--signal=B:TERM@10]}\n")),
              HasSubstr("scheduler.extra_directives[0]: --signal is set by hpctrial itself"));
  EXPECT_THAT(error_of(parse("scheduler: {type: slurm, extra_directives: [--exclusive, -o /tmp/x]}\n")),
              HasSubstr("scheduler.extra_directives[1]: -o is set by hpctrial itself"));
  EXPECT_THAT(error_of(parse("scheduler: {type: slurm, extra_directives: ['-C a100']}\n")),
              HasSubstr("must be one option without blanks or '#'"));
  EXPECT_THAT(error_of(parse("scheduler: {type: slurm, extra_directives: ['--comment=x#y']}\n")),
              HasSubstr("must be one option without blanks or '#'"));
  EXPECT_THAT(error_of(parse("scheduler: {type: slurm, extra_directives: [\"--comment=\\\"x\"]}\n")),
              HasSubstr("holds a quote"));
}

TEST(BatchScript, AnExperimentDirectoryWithPercentOrBlanksIsKeptLiteral) {
  const BatchScriptOptions odd{"/scratch/my runs/100%done", "/opt/hpctrial/bin/hpctrial"};
  const std::string s = render_batch_script(parse(""), odd);
  EXPECT_THAT(s, HasSubstr("#SBATCH --output=\"/scratch/my runs/100%%done/slurm-%j.out\"\n"))
      << "%% is Slurm's literal %";
  EXPECT_THAT(s, HasSubstr("exec /opt/hpctrial/bin/hpctrial launch --experiment '/scratch/my runs/100%done'\n"));
  expect_clean(s);
  const BatchScriptOptions newline{"/scratch/a\nb", "/opt/hpctrial/bin/hpctrial"};
  EXPECT_THROW(render_batch_script(parse(""), newline), ConfigError);
}

TEST(BatchScript, DirectiveValuesAndTimeLimits) {
  EXPECT_EQ(directive_value("gpu-a100", "k"), "gpu-a100");
  EXPECT_EQ(directive_value("a b", "k"), "\"a b\"");
  EXPECT_THROW(directive_value("", "k"), ConfigError);
  EXPECT_THROW(directive_value(std::string("a\0b", 3), "k"), ConfigError);
  EXPECT_EQ(format_time_limit(60), "0-00:01:00");
  EXPECT_EQ(format_time_limit(61), "0-00:02:00") << "rounded up: never less than asked";
  EXPECT_EQ(format_time_limit(366LL * 86400), "366-00:00:00");
}

}  // namespace
}  // namespace hpctrial::slurm
