// scheduler.extra_directives against the options hpctrial sets itself (slurm/src/batch_script.cpp,
// pbs/src/batch_script.cpp): refused in every spelling the scheduler's own option parser reads
// as that option, with the directive, the option and why hpctrial owns it in the message.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "hpctrial/core/config_node.h"
#include "hpctrial/core/diagnostics.h"
#include "hpctrial/core/error.h"
#include "hpctrial/pbs/batch_script.h"
#include "hpctrial/slurm/batch_script.h"

namespace hpctrial {
namespace {

using testing::HasSubstr;

core::ExperimentConfig parse(const std::string& extra) {
  core::Diagnostics d;
  const std::string yaml = "name: exp\nentrypoint: /opt/trial\n"
                           "searcher: {name: single, metric: loss, max_length: {batches: 10}}\n" + extra;
  auto config = core::parse_experiment_config(core::parse_config_text(yaml, "exp.yaml", d), d);
  EXPECT_TRUE(d.empty()) << d.to_string();
  return config;
}

template <typename Render>
std::string error_of(Render render) {
  try {
    render();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

std::string error_of(const core::ExperimentConfig& config) {
  if (config.scheduler.type == "pbs") {
    return error_of([&] { pbs::render_batch_script(config, {"/scratch/me/runs/exp", "/opt/hpctrial/bin/hpctrial"}); });
  }
  return error_of([&] { slurm::render_batch_script(config, {"/scratch/me/runs/exp", "/opt/hpctrial/bin/hpctrial"}); });
}

// sbatch reads options with getopt_long: any unambiguous prefix of a long option is that option,
// a short option's value may be attached to it, and short options without a value may share a
// word with one. Each such spelling of an option hpctrial sets is refused, and the message says
// which option it is and why hpctrial owns it.
TEST(SlurmExtraDirectives, AreRefusedInEverySpellingSbatchAccepts) {
  const auto error = [](const std::string& directive) {
    auto config = parse("scheduler: {type: slurm}\n");
    config.scheduler.extra_directives = {"--exclusive", directive};
    return error_of(config);
  };
  EXPECT_THAT(error("--no-req"),
              HasSubstr("scheduler.extra_directives[1]: --no-req abbreviates --no-requeue (sbatch accepts any "
                        "unambiguous prefix of a long option); --no-requeue is set by hpctrial itself (hpctrial "
                        "requeues the job to resume it"));
  EXPECT_THAT(error("--open-m=truncate"), HasSubstr("--open-m abbreviates --open-mode"));
  EXPECT_THAT(error("--open-m=truncate"), HasSubstr("every run of a requeued job appends to the same output files"));
  EXPECT_THAT(error("--sig=USR1@10"), HasSubstr("--sig abbreviates --signal"));
  EXPECT_THAT(error("--sig=USR1@10"), HasSubstr("set scheduler.preemption_grace instead"));
  EXPECT_THAT(error("--export-f=/tmp/env"), HasSubstr("--export-f abbreviates --export-file"));
  EXPECT_THAT(error("--outp"), HasSubstr("--outp abbreviates --output"));
  EXPECT_THAT(error("--outp /x"), HasSubstr("--outp abbreviates --output")) << "the value after a blank";
  EXPECT_THAT(error("--o=x"), HasSubstr("--o abbreviates --open-mode or --output"));
  EXPECT_THAT(error("--requeue"), HasSubstr("scheduler.extra_directives[1]: --requeue is set by hpctrial itself"));
  EXPECT_THAT(error("--export=NONE"), HasSubstr("--export is set by hpctrial itself (the job's environment"))
      << "an exact name wins over the longer --export-file";
  EXPECT_THAT(error("-o/scratch/x"),
              HasSubstr("scheduler.extra_directives[1]: -o/scratch/x sets -o (--output): sbatch takes a short "
                        "option's value attached to it"));
  EXPECT_THAT(error("-o/scratch/x"), HasSubstr("-o is set by hpctrial itself (the job's output goes to the "
                                               "experiment directory, where `hpctrial logs` reads it); remove it"));
  EXPECT_THAT(error("-e/x"), HasSubstr("-e/x sets -e (--error)"));
  EXPECT_THAT(error("-ax"), HasSubstr("-ax sets -a (--array)"));
  EXPECT_THAT(error("-vo/x"), HasSubstr("-vo/x sets -o (--output)")) << "-v takes no value: -o follows in the word";
  EXPECT_THAT(error("-sH"), HasSubstr("-sH sets -H (--hold)"));
  EXPECT_THAT(error("-H"), HasSubstr("scheduler.extra_directives[1]: -H is set by hpctrial itself (hpctrial holds"));
  // A value that spells an option of ours is only a value.
  EXPECT_EQ(error("-Jo/x"), "") << "-J takes a value: o/x is the job name";
  EXPECT_EQ(error("-Co"), "");
  EXPECT_EQ(error("--exclusive=user"), "");
  EXPECT_EQ(error("--constraint=a100"), "");
  EXPECT_EQ(error("--comment=--output"), "");
}

// qsub reads #PBS lines with getopt: a value may be attached to its option, and options without
// a value may share a word with the next. Each such spelling of an option hpctrial sets is
// refused, and so are resources and attributes of ours given to an attached -l or -W.
TEST(PbsExtraDirectives, AreRefusedInEverySpellingQsubAccepts) {
  const auto extra = [](const std::string& d) { return parse("scheduler: {type: pbs, extra_directives: ['-V', '" + d + "']}\n"); };
  EXPECT_THAT(error_of(extra("-o/scratch/x")),
              HasSubstr("scheduler.extra_directives[1]: -o/scratch/x sets -o: qsub takes an option's value "
                        "attached to it"));
  EXPECT_THAT(error_of(extra("-o/scratch/x")),
              HasSubstr("-o is set by hpctrial itself (the job's output is kept in the experiment directory, "
                        "where `hpctrial logs` reads it); remove it"));
  EXPECT_THAT(error_of(extra("-ojunk")), HasSubstr("-ojunk sets -o"));
  EXPECT_THAT(error_of(extra("-rn")), HasSubstr("-rn sets -r"));
  EXPECT_THAT(error_of(extra("-J0-3")), HasSubstr("-J0-3 sets -J"));
  EXPECT_THAT(error_of(extra("-J0-3")), HasSubstr("set searcher.max_concurrent_trials"));
  EXPECT_THAT(error_of(extra("-Ntrial")), HasSubstr("-Ntrial sets -N"));
  EXPECT_THAT(error_of(extra("-Vh")), HasSubstr("-Vh sets -h")) << "-V takes no value: -h follows in the word";
  EXPECT_THAT(error_of(extra("-h")), HasSubstr("scheduler.extra_directives[1]: -h is set by hpctrial itself (hpctrial "
                                               "holds and releases"));
  EXPECT_THAT(error_of(extra("-lwalltime=1:00:00")), HasSubstr("-l walltime is set by hpctrial from resources"));
  EXPECT_THAT(error_of(extra("-Vlselect=2")), HasSubstr("-l select is set by hpctrial"));
  EXPECT_THAT(error_of(extra("-Wdepend=afterok:12")), HasSubstr("-W depend is set by hpctrial from the experiment"));
  EXPECT_THAT(error_of(extra("-lplace=scatter extra")), HasSubstr("must be one qsub option and its value"));
  // A value that spells an option of ours is only a value.
  EXPECT_EQ(error_of(extra("-lplace=scatter")), "");
  EXPECT_EQ(error_of(extra("-mo")), "") << "-m takes a value: o is the mail option";
  EXPECT_EQ(error_of(extra("-Aproj42")), "");
}

}  // namespace
}  // namespace hpctrial
