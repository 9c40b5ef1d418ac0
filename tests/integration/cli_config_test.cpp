// The real `hpctrial` command: exit codes, what it prints, and where.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <filesystem>
#include <regex>
#include <fstream>
#include <iterator>

#include "../support/temp_dir.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial {
namespace cli_config_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using testing::StartsWith;
using testing_support::TempDir;

core::RunResult hpctrial(std::vector<std::string> args, std::vector<std::pair<std::string, std::string>> env = {}) {
  args.insert(args.begin(), HPCTRIAL_CLI);
  core::RunOptions options;
  options.timeout = std::chrono::seconds(60);
  options.env_set = std::move(env);
  return core::run_process(args, options);
}

const char* kValid = R"(name: cli-test
entrypoint: ./trial
searcher: {name: single, metric: loss, max_length: {batches: 10}}
resources: {slots_per_trial: 2}
)";

TEST(Cli, HelpListsVerbsWithExamples) {
  const auto r = hpctrial({"--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, HasSubstr("usage: hpctrial"));
  EXPECT_THAT(r.out, HasSubstr("config"));
  EXPECT_THAT(r.out, HasSubstr("examples:"));
  const auto bare = hpctrial({});
  EXPECT_EQ(bare.exit_code, 2);
  EXPECT_THAT(bare.out, HasSubstr("usage: hpctrial"));
}

TEST(Cli, NewTrialWritesAProjectNamedAfterItAndRefusesMistakes) {
  testing_support::TempDir dir;
  const std::string project = (dir.path() / "p").string();
  const auto r = hpctrial({"new-trial", "seg_model", "--dir", project});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* file : {"CMakeLists.txt", "seg_model.cpp", "experiment.yaml", "README.md"}) {
    EXPECT_TRUE(std::filesystem::exists(project + "/" + file)) << file;
  }
  std::ifstream source(project + "/seg_model.cpp");
  const std::string text((std::istreambuf_iterator<char>(source)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("class SegModel : public hpctrial::Trial"));
  EXPECT_THAT(text, HasSubstr("HPCTRIAL_MAIN(SegModel)"));
  const auto again = hpctrial({"new-trial", "seg_model", "--dir", project});
  EXPECT_EQ(again.exit_code, 2);
  EXPECT_THAT(again.err, HasSubstr("already exists and is not an empty directory"));
  for (const char* bad : {"Seg", "9lives", "a-b", "x y"}) {
    const auto refused = hpctrial({"new-trial", bad, "--dir", (dir.path() / "q").string()});
    EXPECT_EQ(refused.exit_code, 2) << bad;
    EXPECT_THAT(refused.err, HasSubstr("is not a trial name")) << bad;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "q"));
  // --engine: an engine trial, with its engine section.
  const std::string engine = (dir.path() / "e").string();
  const auto e = hpctrial({"new-trial", "big_model", "--engine", "--dir", engine});
  ASSERT_EQ(e.exit_code, 0) << e.err;
  std::ifstream engine_source(engine + "/big_model.cpp");
  const std::string engine_text((std::istreambuf_iterator<char>(engine_source)), std::istreambuf_iterator<char>());
  EXPECT_THAT(engine_text, HasSubstr("class BigModel : public hpctrial::EngineTrial"));
  EXPECT_THAT(engine_text, HasSubstr("HPCTRIAL_MAIN(BigModel)"));
  const auto validated = hpctrial({"config", "validate", engine + "/experiment.yaml"});
  EXPECT_EQ(validated.exit_code, 0) << validated.err;
  // --pipeline: an engine trial in pipeline stages, with engine.pipeline.
  const std::string piped = (dir.path() / "p2").string();
  const auto p = hpctrial({"new-trial", "deep_model", "--pipeline", "--dir", piped});
  ASSERT_EQ(p.exit_code, 0) << p.err;
  std::ifstream piped_source(piped + "/deep_model.cpp");
  const std::string piped_text((std::istreambuf_iterator<char>(piped_source)), std::istreambuf_iterator<char>());
  EXPECT_THAT(piped_text, HasSubstr("class DeepModel : public hpctrial::EngineTrial"));
  EXPECT_THAT(piped_text, HasSubstr("context.pipeline_module(layers()"));
  EXPECT_THAT(piped_text, HasSubstr("engine_->train_batch(data)"));
  const auto piped_shown = hpctrial({"config", "show", piped + "/experiment.yaml"});
  EXPECT_EQ(piped_shown.exit_code, 0) << piped_shown.err;
  EXPECT_THAT(piped_shown.out, HasSubstr("stages: 2"));
  const auto both = hpctrial({"new-trial", "x", "--engine", "--pipeline", "--dir", (dir.path() / "b").string()});
  EXPECT_EQ(both.exit_code, 2);
  EXPECT_THAT(both.err, HasSubstr("--engine and --pipeline are two templates; give one"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "b"));
}

// The adaptive searchers run under `hpctrial run`, which chooses the trials itself; a batch job of
// their workers is refused until it exists.
TEST(Cli, AnAdaptiveSearchIsSubmittedAsAnArrayOfWorkersAndRunHereAsOne) {
  TempDir dir;
  const std::string path = dir.write("asha.yaml", "name: asha\nentrypoint: ./trial\nhyperparameters: {lr: {type: double, "
                                                  "minval: 0.1, maxval: 1}}\nsearcher: {name: adaptive_asha, metric: "
                                                  "loss, max_length: {batches: 64}, max_trials: 8}\n");
  const auto validated = hpctrial({"config", "validate", path});
  EXPECT_EQ(validated.exit_code, 0) << validated.err;
  const auto submitted = hpctrial({"submit", path, "--scheduler", "slurm", "--dry-run"});
  EXPECT_EQ(submitted.exit_code, 0) << submitted.err;
  EXPECT_THAT(submitted.out, HasSubstr("--search-worker"));
  EXPECT_THAT(submitted.out, HasSubstr("#SBATCH --array=0-7\n"));  // max_concurrent_trials 16, at most max_trials
  const auto pbs = hpctrial({"submit", path, "--scheduler", "pbs", "--dry-run"});
  EXPECT_EQ(pbs.exit_code, 0) << pbs.err;
  EXPECT_THAT(pbs.out, HasSubstr("#PBS -J 0-7\n"));
  EXPECT_THAT(pbs.out, HasSubstr("--search-worker"));
  const auto one = hpctrial({"run", path, "--trial", "1", "--experiment", (dir.path() / "e").string()});
  EXPECT_NE(one.exit_code, 0);
  EXPECT_THAT(one.err, HasSubstr("the adaptive_asha searcher chooses which trial runs next"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "e"));
}

// A Determined config's GPU type becomes Slurm's GPU request; named with no GPU asked for, the
// submission warns that an hpctrial slot is a rank.
TEST(Cli, AGpuTypeIsAskedForAndItsAbsentGpusWarnedOf) {
  TempDir dir;
  const std::string path = dir.write("gpu.yaml", std::string(kValid) + "slurm: {gpu_type: a100}\n");
  const auto none = hpctrial({"submit", path, "--scheduler", "slurm", "--dry-run"});
  EXPECT_EQ(none.exit_code, 0) << none.err;
  EXPECT_THAT(none.err, HasSubstr("hpctrial submit: warning: scheduler.gpu_type names GPUs of type a100 but "
                                  "resources.gpus_per_slot is 0, so the job asks for no GPU: an hpctrial slot is a "
                                  "rank, not a GPU as in Determined"));
  EXPECT_THAT(none.out, testing::Not(HasSubstr("--gpus-per-node")));
  const auto some = hpctrial({"submit", path, "--scheduler", "slurm", "--dry-run", "--set", "resources.gpus_per_slot=1"});
  EXPECT_EQ(some.exit_code, 0) << some.err;
  EXPECT_EQ(some.err, "");
  EXPECT_THAT(some.out, HasSubstr("#SBATCH --gpus-per-node=a100:2\n"));
  const auto pbs = hpctrial({"submit", path, "--scheduler", "pbs", "--dry-run"});
  EXPECT_EQ(pbs.exit_code, 0) << pbs.err << " (Determined's slurm section is Slurm's only)";
  // A key of the section that is no option of the scheduler's is refused where it was written.
  const std::string other = dir.write("other.yaml", std::string(kValid) + "scheduler: {type: slurm}\n"
                                                                          "slurm: {frobnicate: 1}\n");
  const auto refused = hpctrial({"config", "validate", other});
  EXPECT_EQ(refused.exit_code, 2);
  EXPECT_THAT(refused.err, HasSubstr(other + ":6:9: scheduler.frobnicate: "));
  // Determined has a section for each batch scheduler, none for running here.
  const std::string local = dir.write("local.yaml", std::string(kValid) + "local: {}\n");
  const auto unknown = hpctrial({"config", "validate", local});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_THAT(unknown.err, HasSubstr(local + ":5:1: local: unknown key"));
}

// A site's defaults lie under everything else: site < template < config < --set.
TEST(Cli, SiteDefaultsLieUnderTheTemplateTheConfigAndSet) {
  TempDir dir;
  const std::string site = dir.write("site.yaml", "scheduler: {type: slurm, partition: site-p, account: site-a, "
                                                  "qos: site-q, modules: [site/1]}\n");
  const std::string tmpl = dir.write("t.yaml", "scheduler: {account: template-a}\n");
  const std::string config = dir.write("c.yaml", std::string(kValid) + "scheduler: {qos: config-q}\n");
  const auto r = hpctrial({"config", "show", config, "--template", tmpl, "--set", "scheduler.partition=set-p"},
                          {{"HPCTRIAL_SITE_CONFIG", site}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("partition: set-p"));
  EXPECT_THAT(r.out, HasSubstr("account: template-a"));
  EXPECT_THAT(r.out, HasSubstr("qos: config-q"));
  EXPECT_THAT(r.out, HasSubstr("site/1"));
  // Set and empty: no site defaults.
  const auto none = hpctrial({"config", "show", config}, {{"HPCTRIAL_SITE_CONFIG", ""}});
  ASSERT_EQ(none.exit_code, 0) << none.err;
  EXPECT_THAT(none.out, testing::Not(HasSubstr("site/1")));
  // Naming no file, or not a map: a clear error.
  const auto missing = hpctrial({"config", "validate", config}, {{"HPCTRIAL_SITE_CONFIG", dir.path().string() + "/nope.yaml"}});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_THAT(missing.out + missing.err, HasSubstr("HPCTRIAL_SITE_CONFIG names " + dir.path().string() + "/nope.yaml"));
  const std::string list = dir.write("list.yaml", "- a\n- b\n");
  const auto not_map = hpctrial({"config", "validate", config}, {{"HPCTRIAL_SITE_CONFIG", list}});
  EXPECT_EQ(not_map.exit_code, 2);
  EXPECT_THAT(not_map.out + not_map.err, HasSubstr("a site's defaults file must be a map of keys"));
}

TEST(Cli, VersionSaysWhatItWasBuiltWith) {
  const auto r = hpctrial({"--version"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, StartsWith("hpctrial 0."));
  EXPECT_THAT(r.out, HasSubstr("(git "));
  EXPECT_THAT(r.out, testing::ContainsRegex("LibTorch +[0-9]+\\.[0-9]+\\.[0-9]+"));
  EXPECT_THAT(r.out, HasSubstr("Open MPI"));
  EXPECT_THAT(r.out, testing::ContainsRegex("HDF5 +1\\.[0-9]+\\.[0-9]+"));
  EXPECT_THAT(r.out, HasSubstr("CUDA"));
  EXPECT_THAT(r.out, HasSubstr("NCCL"));
}

TEST(Cli, UnknownVerbSuggestsOne) {
  const auto r = hpctrial({"confg"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("hpctrial: unknown verb 'confg'; did you mean 'config'?"));
}

TEST(Cli, ConfigHelp) {
  const auto r = hpctrial({"config", "--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, HasSubstr("hpctrial config validate CONFIG.yaml"));
  EXPECT_THAT(r.out, HasSubstr("--set"));
  EXPECT_THAT(r.out, HasSubstr("--template"));
  // Each verb's help names its options once.
  for (const char* verb : {"config", "run", "submit", "launch", "new-trial"}) {
    const auto help = hpctrial({verb, "--help"});
    EXPECT_EQ(help.exit_code, 0) << verb;
    EXPECT_THAT(help.out, HasSubstr("\n\noptions:\n")) << verb;
    EXPECT_THAT(help.out, testing::Not(HasSubstr("options:\noptions:"))) << verb;
  }
}

// Every verb, and every action of one, answers --help with its usage and exit code 0, and
// `hpctrial help VERB [ACTION]` says the same; an unknown verb is an error that suggests one.
TEST(Cli, EveryVerbAndActionHasHelpAndHelpVerbSaysTheSame) {
  const auto verbs = hpctrial({"--help"});
  ASSERT_EQ(verbs.exit_code, 0);
  std::vector<std::string> names;
  const auto from = verbs.out.find("verbs:\n");
  ASSERT_NE(from, std::string::npos) << verbs.out;
  const std::string listed = verbs.out.substr(from, verbs.out.find("\n\n", from) - from);
  const std::regex line("\n  ([a-z][a-z-]*) +[a-z]");
  for (std::sregex_iterator it(listed.begin(), listed.end(), line), end; it != end; ++it) {
    names.push_back((*it)[1]);
  }
  EXPECT_GE(names.size(), 14u) << verbs.out;
  const std::vector<std::vector<std::string>> commands = {
      {"config", "show"}, {"checkpoint", "list"}, {"checkpoint", "inspect"}, {"checkpoint", "verify"},
      {"checkpoint", "export"}, {"experiment", "repair"}};
  std::vector<std::vector<std::string>> all;
  for (const auto& name : names) all.push_back({name});
  all.insert(all.end(), commands.begin(), commands.end());
  for (const auto& command : all) {
    std::vector<std::string> args = command, asked = {"help"};
    args.push_back("--help");
    asked.insert(asked.end(), command.begin(), command.end());
    const auto help = hpctrial(args), same = hpctrial(asked);
    const std::string what = command.front() + (command.size() > 1 ? " " + command[1] : "");
    EXPECT_EQ(help.exit_code, 0) << what << ": " << help.err;
    EXPECT_THAT(help.out, HasSubstr("usage: hpctrial " + command.front())) << what;
    EXPECT_EQ(help.err, "") << what;
    EXPECT_EQ(same.exit_code, 0) << what;
    EXPECT_EQ(same.out, help.out) << what;
  }
  const auto unknown = hpctrial({"help", "jbos"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_THAT(unknown.err, HasSubstr("unknown verb 'jbos'; did you mean 'jobs'?"));
}

TEST(Cli, ValidateAcceptsAValidConfig) {
  TempDir dir;
  const std::string path = dir.write("exp.yaml", kValid);
  const auto r = hpctrial({"config", "validate", path});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, path + ": valid (name 'cli-test', 2 slots on 1 node, searcher single, scheduler local)\n");
  EXPECT_EQ(r.err, "");
}

TEST(Cli, ValidateListsEveryErrorAndExitsTwo) {
  TempDir dir;
  const std::string path = dir.write(
      "exp.yaml", std::string(kValid) + "max_restarts: -1\nscheduler: {tpye: slurm}\n");
  const auto r = hpctrial({"config", "validate", path});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, path + ":5:15: max_restarts: must be a non-negative integer, got \"-1\"\n" +
                       path + ":6:13: scheduler.tpye: unknown key; did you mean 'type'?\n" + path +
                       ": 2 errors; see docs/config-reference.md\n");
}

TEST(Cli, ValidateSeveralFilesReportsEach) {
  TempDir dir;
  const std::string good = dir.write("good.yaml", kValid);
  const std::string bad = dir.write("bad.yaml", "name: x\n");
  const auto r = hpctrial({"config", "validate", good, bad});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.out, HasSubstr(good + ": valid"));
  EXPECT_THAT(r.err, HasSubstr(bad + ":1:1: entrypoint: required key is missing"));
}

TEST(Cli, ShowPrintsTheEffectiveConfig) {
  TempDir dir;
  const std::string path = dir.write("exp.yaml", kValid);
  const std::string tmpl = dir.write("site.yaml", "scheduler: {type: slurm, modules: [gcc/12]}\n");
  const auto r = hpctrial({"config", "show", path, "--template", tmpl, "--set",
                           "resources.slots_per_trial=4", "--set", "scheduler.modules=[openmpi]"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("slots_per_trial: 4\n"));
  EXPECT_THAT(r.out, HasSubstr("type: slurm\n"));
  EXPECT_THAT(r.out, HasSubstr("modules: [openmpi]\n"));  // --set replaces, it does not merge
  EXPECT_THAT(r.out, HasSubstr("hyperparameters: {}\n"));
  EXPECT_THAT(r.out, HasSubstr("max_restarts: 5\n"));  // defaults are filled in

  // What show prints is itself a valid config that shows the same.
  const std::string effective = dir.write("effective.yaml", r.out);
  const auto again = hpctrial({"config", "show", effective});
  EXPECT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(again.out, r.out);
}

TEST(Cli, ShowWritesThePrivateEffectiveConfigToAFile) {
  TempDir dir;
  const std::string path = dir.write("exp.yaml", kValid);
  const std::string output = (dir.path() / "effective.yaml").string();
  const auto r = hpctrial({"config", "show", path, "--output", output});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "wrote the effective config of " + path + " to " + output + "\n");
  const auto shown = hpctrial({"config", "show", path});
  const auto again = hpctrial({"config", "show", output});
  EXPECT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(again.out, shown.out);
  struct stat info {};
  ASSERT_EQ(::stat(output.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0600u);

  const auto unwritable = hpctrial({"config", "show", path, "-o", "/nonexistent/dir/e.yaml"});
  EXPECT_EQ(unwritable.exit_code, 1);
  EXPECT_THAT(unwritable.err, HasSubstr("hpctrial config: cannot create a temporary file in "
                                        "/nonexistent/dir: No such file or directory"));
}

TEST(Cli, BadOptionsAreUsageErrors) {
  const auto r = hpctrial({"config", "show", "x.yaml", "--frobnicate"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("unrecognised option '--frobnicate'"));
  EXPECT_THAT(r.err, HasSubstr("hpctrial config --help"));
  const auto no_file = hpctrial({"config", "validate"});
  EXPECT_EQ(no_file.exit_code, 2);
  EXPECT_THAT(no_file.err, HasSubstr("give the config file"));
  const auto bad_set = hpctrial({"config", "validate", "x.yaml", "--set", "novalue"});
  EXPECT_EQ(bad_set.exit_code, 2);
}

TEST(Cli, AMissingFileNamesIt) {
  const auto r = hpctrial({"config", "validate", "/nonexistent/exp.yaml"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("/nonexistent/exp.yaml: cannot read: No such file or directory"));
}

}  // namespace cli_config_test
}  // namespace hpctrial
