// The qsub script rendered from a config: every key where it belongs, read back by a parser that
// reads #PBS lines the way qsub does; hostile values kept out of bash or refused with the key
// named; the script clean for bash -n and shellcheck.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sstream>

#include "../../support/temp_dir.h"
#include "hpctrial/core/config_node.h"
#include "hpctrial/core/diagnostics.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/pbs/batch_script.h"

namespace hpctrial::pbs {
namespace {

using testing::ElementsAre;
using testing::HasSubstr;
using testing::Not;
using testing_support::TempDir;

core::ExperimentConfig parse(const std::string& extra, const std::string& name = "exp",
                             const std::string& searcher = "{name: single, metric: loss, max_length: {batches: 10}}") {
  core::Diagnostics d;
  const std::string yaml = "name: " + name + "\nentrypoint: /opt/trial\nsearcher: " + searcher + "\n" + extra;
  auto config = core::parse_experiment_config(core::parse_config_text(yaml, "exp.yaml", d), d);
  EXPECT_TRUE(d.empty()) << d.to_string();
  return config;
}

const BatchScriptOptions kOptions{"/scratch/me/runs/exp", "/opt/hpctrial/bin/hpctrial"};

// The directives as qsub reads them: "#PBS" lines up to the first line that is neither blank
// nor a comment, each split at blanks into an option and its value. A line that splits into
// anything but two words would be misread.
std::vector<std::pair<std::string, std::string>> read_directives(const std::string& script) {
  std::vector<std::pair<std::string, std::string>> out;
  std::stringstream in(script);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("#PBS", 0) == 0) {
      std::stringstream words(line.substr(4));
      std::vector<std::string> w;
      for (std::string word; words >> word;) w.push_back(word);
      EXPECT_EQ(w.size(), 2u) << "qsub would misread: " << line;
      if (w.size() == 2) out.emplace_back(w[0], w[1]);
      continue;
    }
    if (line.empty() || line[0] == '#') continue;
    break;  // the first command: qsub reads no directive after it
  }
  return out;
}

// Every #PBS line in the script (qsub ignores those after the first command).
std::size_t directive_lines(const std::string& script) {
  std::size_t n = 0;
  for (std::size_t at = script.find("#PBS"); at != std::string::npos; at = script.find("#PBS", at + 1)) ++n;
  return n;
}

void expect_clean(const std::string& script) {
  TempDir dir;
  const std::string path = dir.write("job.pbs", script);
  const auto syntax = core::run_process({"bash", "-n", path});
  EXPECT_TRUE(syntax.ok()) << syntax.err << script;
  const auto lint = core::run_process({"shellcheck", path});
  EXPECT_TRUE(lint.ok()) << lint.out << script;
  EXPECT_EQ(read_directives(script).size(), directive_lines(script)) << "a directive after the first command:\n" << script;
}

std::string error_of(const core::ExperimentConfig& config, const BatchScriptOptions& options = kOptions) {
  try {
    render_batch_script(config, options);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(PbsBatchScript, EveryKeyBecomesItsDirective) {
  const auto config = parse(R"(resources: {slots_per_trial: 8, slots_per_node: 4, cpus_per_slot: 6, gpus_per_slot: 1, memory_per_node: 64G}
scheduler:
  type: pbs
  queue: gpuq
  account: proj-42
  time_limit: 1-02:30:00
  preemption_grace: 5m
  modules: [gcc/12, openmpi/4.1]
  environment: {NCCL_DEBUG: WARN, TOKEN: '${env:MY_TOKEN}'}
  extra_directives: ['-l place=scatter:excl', '-W group_list=proj42', '-m n']
)");
  const std::string s = render_batch_script(config, kOptions);
  EXPECT_THAT(read_directives(s),
              ElementsAre(std::pair<std::string, std::string>{"-N", "exp"},
                          std::pair<std::string, std::string>{"-l", "select=2:ncpus=24:mpiprocs=4:ngpus=4:mem=65536mb"},
                          std::pair<std::string, std::string>{"-l", "walltime=26:30:00"},
                          std::pair<std::string, std::string>{"-q", "gpuq"},
                          std::pair<std::string, std::string>{"-A", "proj-42"},
                          std::pair<std::string, std::string>{"-r", "y"},
                          std::pair<std::string, std::string>{"-j", "oe"},
                          std::pair<std::string, std::string>{"-o", "/scratch/me/runs/exp/pbs-scheduler.out"},
                          std::pair<std::string, std::string>{"-W", "umask=077"},
                          std::pair<std::string, std::string>{"-l", "place=scatter:excl"},
                          std::pair<std::string, std::string>{"-W", "group_list=proj42"},
                          std::pair<std::string, std::string>{"-m", "n"}));
  for (const char* line : {"exec >>/scratch/me/runs/exp/pbs-\"${PBS_JOBID}.out\" 2>&1\n", "module load gcc/12 ",
                           "module load openmpi/4.1 ", "export NCCL_DEBUG=WARN\n",
                           "exec /opt/hpctrial/bin/hpctrial launch --experiment /scratch/me/runs/exp\n"}) {
    EXPECT_THAT(s, HasSubstr(line));
  }
  EXPECT_THAT(s, Not(HasSubstr("TOKEN"))) << "a value from the submitting environment is never written";
  EXPECT_EQ(s.rfind("#!/bin/bash -l\n", 0), 0u) << "modules need a login shell";
  // The output goes to its file before any module is loaded, so that a failing load is seen.
  EXPECT_LT(s.find("exec >>"), s.find("module load"));
  expect_clean(s);
}

TEST(PbsBatchScript, DefaultsLeaveTheClusterToChoose) {
  const std::string s = render_batch_script(parse("scheduler: {type: pbs}\n"), kOptions);
  EXPECT_EQ(s.rfind("#!/bin/bash\n", 0), 0u);
  for (const char* absent : {"#PBS -l walltime", "#PBS -q", "#PBS -A", "mem=", "ngpus", "#PBS -J", "module load", "export "}) {
    EXPECT_THAT(s, Not(HasSubstr(absent)));
  }
  EXPECT_THAT(s, HasSubstr("#PBS -l select=1:ncpus=1:mpiprocs=1\n"));
  expect_clean(s);
}

// A search is one array job; each subjob runs the trial of its index.
TEST(PbsBatchScript, ASearchIsAnArrayJobThrottledByMaxRunSubjobs) {
  const std::string grid = "{name: grid, metric: loss, max_length: {batches: 10}, max_concurrent_trials: 2}";
  const std::string ranges = "hyperparameters: {lr: {type: log, minval: -3, maxval: -1, count: 3}, "
                             "bs: {type: categorical, vals: [16, 32]}}\n";
  const auto config = parse(ranges, "g", grid);
  const std::string s = render_batch_script(config, kOptions);
  for (const char* line : {"#PBS -J 0-5\n", "#PBS -W max_run_subjobs=2\n",
                           "exec /opt/hpctrial/bin/hpctrial launch --experiment /scratch/me/runs/exp --trial "
                           "\"$PBS_ARRAY_INDEX\"\n"}) {
    EXPECT_THAT(s, HasSubstr(line));
  }
  expect_clean(s);
  auto unthrottled = config;
  unthrottled.searcher.max_concurrent_trials = 16;
  EXPECT_THAT(render_batch_script(unthrottled, kOptions), Not(HasSubstr("max_run_subjobs")));
}

// An adaptive search: an array job of max_concurrent_trials workers (at most max_trials), each
// a worker of the search; the job that resumes a stopped worker is one worker, and a search of
// one worker is a plain job (PBS has no array of one subjob).
TEST(PbsBatchScript, AnAdaptiveSearchIsAnArrayJobOfWorkers) {
  const auto config = parse("hyperparameters: {lr: {type: log, minval: -3, maxval: -1}}\n"
                            "reproducibility: {experiment_seed: 1}\n", "a",
                            "{name: adaptive_asha, metric: loss, max_length: {batches: 64}, max_trials: 16, "
                            "max_concurrent_trials: 3}");
  const std::string s = render_batch_script(config, kOptions);
  for (const char* line : {"#PBS -J 0-2\n",
                           "exec /opt/hpctrial/bin/hpctrial launch --experiment /scratch/me/runs/exp --search-worker\n"}) {
    EXPECT_THAT(s, HasSubstr(line));
  }
  EXPECT_THAT(s, Not(HasSubstr("max_run_subjobs")));
  EXPECT_THAT(s, Not(HasSubstr("--trial")));
  expect_clean(s);
  BatchScriptOptions one = kOptions;
  one.one_worker = true;
  const std::string resume = render_batch_script(config, one);
  EXPECT_THAT(resume, Not(HasSubstr("#PBS -J")));
  EXPECT_THAT(resume, HasSubstr("--search-worker\n"));
  auto single = config;
  single.searcher.max_concurrent_trials = 1;
  EXPECT_THAT(render_batch_script(single, kOptions), Not(HasSubstr("#PBS -J")));
}

TEST(PbsBatchScript, JobNamesAreSanitisedTheWayPbsAcceptsThem) {
  EXPECT_EQ(job_name("mlp-grid_2.b+c"), "mlp-grid_2.b+c");
  EXPECT_EQ(job_name("my exp #1"), "my_exp__1");
  EXPECT_EQ(job_name("_private"), "h_private") << "the first character must be a letter or digit";
  EXPECT_EQ(job_name("x$(touch /tmp/pwned)"), "x__touch__tmp_pwned_");
  EXPECT_EQ(job_name(""), "h");
  EXPECT_EQ(job_name(std::string(300, 'n')).size(), 236u);
  EXPECT_EQ(job_name("-" + std::string(300, 'n')).size(), 236u);
  // Hostile names never reach bash, and the script stays clean.
  for (const std::string& name : std::vector<std::string>{"my exp #1", "x$(touch /tmp/pwned)", "a`id`b", "a;b|c&d",
                                                         "say \"hi\"", "it's", std::string(128, 'n')}) {
    // The config refuses such names; the script does not rely on it.
    auto config = parse("");
    config.name = name;
    const std::string s = render_batch_script(config, kOptions);
    EXPECT_THAT(s, HasSubstr("#PBS -N " + job_name(name) + "\n")) << name;
    expect_clean(s);
  }
}

TEST(PbsBatchScript, ValuesPbsWouldMisreadAreRefusedWithTheirKey) {
  // The config reader refuses such values with their file and line; the script refuses them too.
  auto config = parse("scheduler: {type: pbs}\n");
  config.scheduler.options = {{"queue", {}, core::ConfigNode::scalar("gpu q")}};
  EXPECT_THAT(error_of(config), HasSubstr("scheduler.queue: \"gpu q\" cannot go into a #PBS line"));
  config.scheduler.options.clear();
  for (const char* account : {"a#b", "\"x\"", "a b", "$(id)"}) {
    config.scheduler.account = account;
    EXPECT_THAT(error_of(config), HasSubstr("scheduler.account:")) << account;
  }
  auto two_lines = parse("scheduler: {type: pbs}\n");
  two_lines.scheduler.options = {{"queue", {}, core::ConfigNode::scalar("a\nb")}};
  EXPECT_THAT(error_of(two_lines), HasSubstr("scheduler.queue: holds a line break"));
  // The output path of -o is host:path, split at blanks.
  EXPECT_THAT(error_of(parse(""), {"/scratch/my runs/exp", "/opt/hpctrial"}),
              HasSubstr("experiment directory /scratch/my runs/exp: PBS reads the output path"));
  EXPECT_THAT(error_of(parse(""), {"/scratch/a:b", "/opt/hpctrial"}), HasSubstr("host:path"));
  EXPECT_THROW(directive_word("", "k"), ConfigError);
  EXPECT_EQ(directive_word("select=1:ncpus=2", "k"), "select=1:ncpus=2");
}

TEST(PbsBatchScript, ExtraDirectivesAreOneOptionAndNotOursToChange) {
  const auto extra = [](const std::string& d) { return parse("scheduler: {type: pbs, extra_directives: ['" + d + "']}\n"); };
  EXPECT_THAT(error_of(extra("-r n")), HasSubstr("scheduler.extra_directives[0]: -r is set by hpctrial itself"));
  EXPECT_THAT(error_of(extra("-o /tmp/x")), HasSubstr("-o is set by hpctrial itself"));
  EXPECT_THAT(error_of(extra("-J 0-3")), HasSubstr("-J is set by hpctrial itself"));
  EXPECT_THAT(error_of(extra("-l walltime=1:00:00")), HasSubstr("-l walltime is set by hpctrial from resources"));
  EXPECT_THAT(error_of(extra("-l place=excl,select=2")), HasSubstr("-l select is set by hpctrial"));
  EXPECT_THAT(error_of(extra("-W depend=afterok:12")), HasSubstr("-W depend is set by hpctrial from the experiment"));
  EXPECT_THAT(error_of(extra("-W umask=022")), HasSubstr("-W umask is set by hpctrial"));
  for (const char* bad : {"place=scatter", "-l  place=scatter", "-l place=scatter extra", "-l a#b",
                                 "-l $(id)", "-N x y"}) {
    auto config = parse("scheduler: {type: pbs}\n");
    config.scheduler.extra_directives = {bad};  // some the config reader refuses already
    EXPECT_THAT(error_of(config), HasSubstr("must be one qsub option and its value")) << bad;
  }
  EXPECT_EQ(error_of(extra("-l place=scatter")), "");
  EXPECT_EQ(error_of(extra("-V")), "");
}

TEST(PbsBatchScript, Walltimes) {
  EXPECT_EQ(format_walltime(0), "00:00:01");
  EXPECT_EQ(format_walltime(90), "00:01:30");
  EXPECT_EQ(format_walltime(366LL * 86400 + 1), "8784:00:01");
}

}  // namespace
}  // namespace hpctrial::pbs
