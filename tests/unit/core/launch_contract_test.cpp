// The launcher-rank contract's encodings: the heartbeat record read back field by field, updated
// in place, with every kind of end; torn or foreign files refused; the watchdog's verdict.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <csignal>
#include <map>
#include <string>

#include "../../support/temp_dir.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/launch_contract.h"

namespace hpctrial::core {
namespace {

using testing_support::TempDir;

std::string record(long long step, RankPhase phase) {
  std::string page(kHeartbeatSize, '\0');
  heartbeat_init(page.data(), step, phase, 4242, "cn17");
  return page;
}

TEST(RankContract, IsReadFromTheLaunchersEnvironment) {
  const RankContract none = read_contract(MapEnv{});
  EXPECT_EQ(none.trial_id, 0);
  EXPECT_EQ(none.restart_count, 0);
  EXPECT_EQ(none.stop_file, "");
  const RankContract c = read_contract(MapEnv(std::map<std::string, std::string>{{kEnvExperimentDir, "/x/runs/e"},
                                               {kEnvConfig, "/x/runs/e/experiment.yaml"},
                                               {kEnvTrialDir, "/x/runs/e/trial-3"},
                                               {kEnvTrialId, "3"},
                                               {kEnvRestartCount, "2"},
                                               {kEnvScheduler, "slurm"},
                                               {kEnvJobId, "41"},
                                               {kEnvStopFile, "/x/s"},
                                               {kEnvHeartbeatDir, "/x/h"},
                                               {kEnvAbortFile, "/x/a"},
                                               {kEnvVerdictFile, "/x/v"},
                                               {kEnvFault, "rank1:step2:exit3"}}));
  EXPECT_EQ(c.experiment_dir, "/x/runs/e");
  EXPECT_EQ(c.config, "/x/runs/e/experiment.yaml");
  EXPECT_EQ(c.trial_dir, "/x/runs/e/trial-3");
  EXPECT_EQ(c.trial_id, 3);
  EXPECT_EQ(c.restart_count, 2);
  EXPECT_EQ(c.scheduler, "slurm");
  EXPECT_EQ(c.job_id, "41");
  EXPECT_EQ(c.stop_file, "/x/s");
  EXPECT_EQ(c.heartbeat_dir, "/x/h");
  EXPECT_EQ(c.abort_file, "/x/a");
  EXPECT_EQ(c.verdict_file, "/x/v");
  EXPECT_EQ(c.fault, "rank1:step2:exit3");
}

TEST(RankContract, ABadCountNamesTheVariableAndItsValue) {
  const auto error_of = [](const char* name, const char* value) {
    try {
      read_contract(MapEnv(std::map<std::string, std::string>{{name, value}}));
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(error_of(kEnvTrialId, "1x"), testing::HasSubstr("HPCTRIAL_TRIAL_ID must be a trial number (0 or more), got \"1x\""));
  EXPECT_THAT(error_of(kEnvTrialId, "-1"), testing::HasSubstr("got \"-1\""));
  EXPECT_THAT(error_of(kEnvRestartCount, ""), testing::HasSubstr("HPCTRIAL_RESTART_COUNT must be a count of restarts"));
  EXPECT_THAT(error_of(kEnvRestartCount, "two"), testing::HasSubstr("got \"two\"; it is set by hpctrial's launcher"));
}

// An adaptive search's worker cuts a run at its rung: the rank's config trains to that length.
TEST(RankContract, AWorkersMaxLengthReplacesTheSearchersForThisRun) {
  const RankContract c = read_contract(MapEnv(std::map<std::string, std::string>{{kEnvMaxLength, "epochs:3"}}));
  ASSERT_TRUE(c.max_length.has_value());
  EXPECT_EQ(c.max_length->unit, LengthUnit::kEpochs);
  EXPECT_EQ(c.max_length->value, 3);
  EXPECT_EQ(length_text(*c.max_length), "epochs:3");
  ExperimentConfig config;
  config.searcher.max_length = {LengthUnit::kEpochs, 27};
  EXPECT_EQ(rank_config(config, c).searcher.max_length.value, 3);
  EXPECT_EQ(rank_config(config, RankContract{}).searcher.max_length.value, 27);
  for (const char* bad : {"3", "seconds:3", "batches:0", "batches:3x", "batches:"}) {
    try {
      read_contract(MapEnv(std::map<std::string, std::string>{{kEnvMaxLength, bad}}));
      ADD_FAILURE() << bad << " was read";
    } catch (const ConfigError& e) {
      EXPECT_THAT(e.what(), testing::HasSubstr(std::string("HPCTRIAL_MAX_LENGTH is \"") + bad + "\": it is <unit>:<count>"));
    }
  }
}

TEST(Heartbeat, ReadsBackWhatWasWritten) {
  std::string page = record(-1, RankPhase::kStartup);
  ASSERT_EQ(page.size(), kHeartbeatSize);
  EXPECT_EQ(page.rfind("step -1 ", 0), 0u) << "starts with the step, for a reader of the text";
  auto r = heartbeat_decode(page);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, -1);
  EXPECT_EQ(r->phase, RankPhase::kStartup);
  EXPECT_EQ(r->pid, 4242);
  EXPECT_EQ(r->host, "cn17");
  EXPECT_FALSE(r->end.has_value());

  heartbeat_put_step(page.data(), 1234567890123LL);
  heartbeat_put_phase(page.data(), RankPhase::kCheckpoint);
  r = heartbeat_decode(page);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 1234567890123LL);
  EXPECT_EQ(r->phase, RankPhase::kCheckpoint);
  heartbeat_put_step(page.data(), 7);  // shorter: nothing of the longer number is left
  EXPECT_EQ(heartbeat_decode(page)->step, 7);
}

TEST(Heartbeat, RecordsEachKindOfEnd) {
  std::string page = record(50, RankPhase::kBatch);
  heartbeat_put_end(page.data(), {RankEnd::Kind::kSignal, SIGSEGV, 1732400000123LL});
  auto r = heartbeat_decode(page);
  ASSERT_TRUE(r && r->end);
  EXPECT_EQ(r->end->kind, RankEnd::Kind::kSignal);
  EXPECT_EQ(r->end->code, SIGSEGV);
  EXPECT_EQ(r->end->unix_ms, 1732400000123LL);
  EXPECT_TRUE(r->end->failed());
  EXPECT_THAT(r->end->describe(), testing::StartsWith("was killed by signal 11 ("));

  heartbeat_put_end(page.data(), {RankEnd::Kind::kAbort, 1, 5});
  heartbeat_put_message(page.data(), "cannot write /exp/trial-0/metrics.jsonl:\nNo space left on device");
  r = heartbeat_decode(page);
  EXPECT_EQ(r->end->kind, RankEnd::Kind::kAbort);
  EXPECT_EQ(r->message, "cannot write /exp/trial-0/metrics.jsonl: No space left on device") << "one line";

  for (int code : {0, 75}) {
    heartbeat_put_end(page.data(), {RankEnd::Kind::kExit, code, 5});
    EXPECT_FALSE(heartbeat_decode(page)->end->failed()) << code;
  }
  heartbeat_put_end(page.data(), {RankEnd::Kind::kExit, 3, 5});
  EXPECT_TRUE(heartbeat_decode(page)->end->failed());
  EXPECT_EQ(heartbeat_decode(page)->end->describe(), "exited with code 3");
}

TEST(Heartbeat, ALongMessageIsCutToTheRecord) {
  std::string page = record(1, RankPhase::kBatch);
  heartbeat_put_message(page.data(), std::string(5000, 'x').c_str());
  EXPECT_EQ(page.size(), kHeartbeatSize);
  EXPECT_EQ(page.back(), '\n');
  EXPECT_GT(heartbeat_decode(page)->message.size(), 250u);
}

TEST(Heartbeat, TornOrForeignTextIsNotARecord) {
  std::string page = record(10, RankPhase::kBatch);
  EXPECT_FALSE(heartbeat_decode(page.substr(0, 100)).has_value());
  std::string torn = page;
  torn.replace(8, 3, "x?z");  // inside the step field
  EXPECT_FALSE(heartbeat_decode(torn).has_value());
  std::string bad_phase = page;
  bad_phase.replace(bad_phase.find("batch"), 5, "batcX");
  EXPECT_FALSE(heartbeat_decode(bad_phase).has_value());
  EXPECT_FALSE(heartbeat_decode(std::string(kHeartbeatSize, ' ')).has_value());
}

TEST(Heartbeat, ReadsEveryRankFileOfADirectory) {
  TempDir dir;
  dir.write("rank-0", record(41, RankPhase::kAgreement));
  dir.write("rank-12", record(40, RankPhase::kBatch));
  dir.write("rank-2", "garbage");
  dir.write("rank-", record(1, RankPhase::kBatch));
  dir.write("notes.txt", record(1, RankPhase::kBatch));
  const auto records = read_heartbeats(dir.path().string());
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].first, 0);
  EXPECT_EQ(records[0].second.step, 41);
  EXPECT_EQ(records[1].first, 12);
  EXPECT_TRUE(read_heartbeats((dir.path() / "missing").string()).empty());
}

TEST(Phases, NamesRoundTrip) {
  for (RankPhase p : {RankPhase::kStartup, RankPhase::kBatch, RankPhase::kAgreement, RankPhase::kValidation,
                      RankPhase::kEvaluate, RankPhase::kCheckpoint, RankPhase::kShutdown}) {
    EXPECT_EQ(parse_phase(phase_name(p)), p);
  }
  EXPECT_FALSE(parse_phase("lunch").has_value());
}

TEST(Verdict, RoundTrips) {
  const auto v = decode_verdict(encode_verdict({{1, 3}, "watchdog: allreduce\nstuck", {}}));
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->culprits, (std::vector<int>{1, 3}));
  EXPECT_EQ(v->message, "watchdog: allreduce stuck");
  const auto none = decode_verdict(encode_verdict({{}, "transport stuck", {}}));
  ASSERT_TRUE(none.has_value());
  EXPECT_TRUE(none->culprits.empty());
  const auto flown = decode_verdict(encode_verdict({{1}, "stuck", {{0, "allreduce #7 (step 3) began 2.0 s ago,\n not "
                                                                       "finished"}, {1, "barrier #6 (step 2) took 0.001 s"}}}));
  ASSERT_TRUE(flown.has_value());
  EXPECT_EQ(flown->flight, (std::vector<std::pair<int, std::string>>{
                               {0, "allreduce #7 (step 3) began 2.0 s ago,  not finished"},
                               {1, "barrier #6 (step 2) took 0.001 s"}}));
  EXPECT_FALSE(decode_verdict("").has_value());
  EXPECT_FALSE(decode_verdict("culprits x\n").has_value());
}

TEST(Paths, InTheTrialDirectory) {
  const TrialLayout trial = ExperimentLayout{"/e"}.trial(0);
  EXPECT_EQ(trial.dir, "/e/trial-0");
  EXPECT_EQ(trial.stop_file(), "/e/trial-0/stop-request");
  EXPECT_EQ(trial.heartbeat_file(3), "/e/trial-0/launch/heartbeat/rank-3");
  EXPECT_EQ(TrialLayout::heartbeat_file(trial.heartbeat_dir(), 3), trial.heartbeat_file(3));
  EXPECT_EQ(trial.abort_file(2), "/e/trial-0/launch/abort-2");
  EXPECT_EQ(trial.verdict_file(2), "/e/trial-0/launch/verdict-2");
  EXPECT_TRUE(TrialLayout::is_attempt_file("abort-2"));
  EXPECT_TRUE(TrialLayout::is_attempt_file("verdict-0"));
  EXPECT_FALSE(TrialLayout::is_attempt_file("heartbeat"));
  // Joined without a doubled '/', and relative to the working directory with no directory.
  EXPECT_EQ(TrialLayout{"runs/mlp/"}.metrics_file(), "runs/mlp/metrics.jsonl");
  EXPECT_EQ(TrialLayout{""}.metrics_file(), "metrics.jsonl");
}

TEST(Paths, AHeartbeatFileNamesItsRank) {
  EXPECT_EQ(TrialLayout::heartbeat_rank("rank-12"), 12);
  EXPECT_EQ(TrialLayout::heartbeat_rank("rank-0"), 0);
  for (const char* name : {"rank-", "rank-1x", "rank--1", "rank-1234567890", "notes.txt", "Rank-1"}) {
    EXPECT_FALSE(TrialLayout::heartbeat_rank(name).has_value()) << name;
  }
}

}  // namespace
}  // namespace hpctrial::core
