// pbs::Client over a fake runner: the argv it runs, and how it reads qstat. There is no PBS
// server here: the outputs below copy the shapes PBS Pro / OpenPBS print, as published by their
// users (qstat -f -F json -x of PBS Pro 19.0, 20.0 and 2022: "Jobs" keyed by job id, numbers
// unquoted, "host:/path" output paths; qstat -u USER -f -F json of PBS Pro 2024 leaving "Jobs"
// out when nothing matches) and the "key = value" text of qstat -f with tab-continued lines.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include "hpctrial/core/error.h"
#include "hpctrial/pbs/client.h"

namespace hpctrial::pbs {
namespace {

using testing::ElementsAre;
using testing::HasSubstr;

const std::string kJson = R"({
    "timestamp":1664911414,
    "pbs_version":"2022.1.5.20240209",
    "pbs_server":"pbs1",
    "Jobs":{
        "1234.pbs1":{
            "Job_Name":"mlp grid",
            "Job_Owner":"alice@login1",
            "job_state":"R",
            "queue":"workq",
            "Output_Path":"login1:/scratch/alice/runs/mlp/pbs-scheduler.out",
            "exec_host":"node1/0*4+node2/0*4",
            "stime":"Sun Nov 22 15:58:49 2026",
            "run_count":2,
            "Resource_List":{"ncpus":8, "walltime":"01:00:00"}
        },
        "1235.pbs1":{
            "Job_Name":"mlp",
            "Job_Owner":"alice@login1",
            "job_state":"F",
            "Exit_status":271,
            "run_count":1
        }
    }
})";

const std::string kText =
    "Job Id: 1236.pbs1\n"
    "    Job_Name = mlp\n"
    "    Job_Owner = alice@login1\n"
    "    job_state = H\n"
    "    Output_Path = login1:/scratch/alice/runs/a-very-long-experiment-directory-name/pbs-sch\n"
    "\teduler.out\n"
    "    run_count = 0\n"
    "\n"
    "Job Id: 1237[].pbs1\n"
    "    Job_Name = grid\n"
    "    job_state = B\n";

struct Call {
  std::vector<std::string> argv;
  std::vector<std::pair<std::string, std::string>> env;
};

// Answers by the command's first words; records every call.
class FakePbs {
 public:
  std::map<std::string, core::RunResult> answers;  // key: argv joined by blanks, or its prefix
  std::vector<Call> calls;
  Client client() {
    return Client([this](const std::vector<std::string>& argv, const core::RunOptions& options) {
      calls.push_back({argv, options.env_set});
      std::string line;
      for (const auto& w : argv) line += (line.empty() ? "" : " ") + w;
      core::RunResult r;
      r.exit_code = 0;
      for (const auto& [prefix, answer] : answers) {
        if (line.rfind(prefix, 0) == 0) return answer;
      }
      return r;
    });
  }
};

Client::Submit script_only() {
  Client::Submit s;
  s.script = "/runs/exp/job.pbs";
  return s;
}

core::RunResult answer(int code, const std::string& out, const std::string& err = "") {
  core::RunResult r;
  r.exit_code = code;
  r.out = out;
  r.err = err;
  return r;
}

TEST(PbsQstat, ReadsTheJsonOfEveryJob) {
  const auto jobs = parse_qstat_json(kJson, "qstat");
  ASSERT_EQ(jobs.size(), 2u);
  const JobInfo& a = jobs[0];
  EXPECT_EQ(a.id, "1234.pbs1");
  EXPECT_EQ(a.name, "mlp grid");
  EXPECT_EQ(a.owner, "alice@login1");
  EXPECT_EQ(a.state, "R");
  EXPECT_EQ(a.run_count, 2);
  EXPECT_FALSE(a.exit_status.has_value());
  EXPECT_EQ(a.output_path, "/scratch/alice/runs/mlp/pbs-scheduler.out");
  EXPECT_EQ(a.exec_host, "node1/0*4+node2/0*4");
  EXPECT_EQ(a.start_time, "Sun Nov 22 15:58:49 2026");
  EXPECT_TRUE(a.active());
  EXPECT_FALSE(a.held());
  EXPECT_EQ(jobs[1].state, "F");
  EXPECT_EQ(jobs[1].exit_status, 271);
  EXPECT_FALSE(jobs[1].active());
  // No job matched: PBS leaves "Jobs" out.
  EXPECT_TRUE(parse_qstat_json(R"({"timestamp":1,"pbs_version":"2024.1.2","pbs_server":"gadi"})", "qstat").empty());
  EXPECT_THROW(parse_qstat_json("qstat: illegal option -- F", "qstat -f -F json"), SchedulerError);
  EXPECT_THROW(parse_qstat_json(R"({"Jobs":[1,2]})", "qstat"), SchedulerError);
}

TEST(PbsQstat, ReadsTheTextFormatWithContinuedLines) {
  const auto jobs = parse_qstat_text(kText, "qstat -f");
  ASSERT_EQ(jobs.size(), 2u);
  EXPECT_EQ(jobs[0].id, "1236.pbs1");
  EXPECT_TRUE(jobs[0].held());
  EXPECT_EQ(jobs[0].output_path, "/scratch/alice/runs/a-very-long-experiment-directory-name/pbs-scheduler.out");
  EXPECT_EQ(jobs[1].id, "1237[].pbs1");
  EXPECT_EQ(jobs[1].state, "B");
  EXPECT_TRUE(jobs[1].active());
  EXPECT_TRUE(parse_qstat_text("", "qstat -f").empty());
  EXPECT_THROW(parse_qstat_text("garbage\n", "qstat -f"), SchedulerError);
}

TEST(PbsClient, SubmitsByArgvWithValuesOnlyInTheEnvironment) {
  FakePbs pbs;
  pbs.answers["qsub"] = answer(0, "1240.pbs1\n");
  const Client client = pbs.client();
  EXPECT_EQ(client.submit({"/runs/exp/job.pbs", {{"TOKEN", "s3cr3t"}, {"KEY", "k"}}, true, "1234.pbs1"}), "1240.pbs1");
  ASSERT_EQ(pbs.calls.size(), 1u);
  EXPECT_THAT(pbs.calls[0].argv, ElementsAre("qsub", "-h", "-W", "depend=afterany:1234.pbs1", "-v", "TOKEN,KEY",
                                             "/runs/exp/job.pbs"));
  EXPECT_THAT(pbs.calls[0].env, ElementsAre(std::pair<std::string, std::string>{"TOKEN", "s3cr3t"},
                                            std::pair<std::string, std::string>{"KEY", "k"}));
  EXPECT_EQ(client.submit(script_only()), "1240.pbs1");
  EXPECT_THAT(pbs.calls[1].argv, ElementsAre("qsub", "/runs/exp/job.pbs"));
  EXPECT_THROW(client.submit({"/runs/exp/job.pbs", {}, false, "1234; rm -rf ~"}), SchedulerError);

  pbs.answers["qsub"] = answer(0, "qsub: would exceed queue generic's per-user limit\n");
  EXPECT_THAT([&] {
    try {
      client.submit(script_only());
    } catch (const SchedulerError& e) {
      return std::string(e.what());
    }
    return std::string();
  }(), HasSubstr("not a job id"));
  pbs.answers["qsub"] = answer(38, "", "qsub: Unknown queue\n");
  EXPECT_THROW(client.submit(script_only()), SchedulerError);
}

TEST(PbsClient, RunsTheJobVerbsByArgv) {
  FakePbs pbs;
  const Client client = pbs.client();
  client.signal("1234.pbs1", "USR2");
  client.hold("1234.pbs1");
  client.release("1234.pbs1");
  client.cancel("1237[].pbs1");
  ASSERT_EQ(pbs.calls.size(), 4u);
  EXPECT_THAT(pbs.calls[0].argv, ElementsAre("qsig", "-s", "USR2", "1234.pbs1"));
  EXPECT_THAT(pbs.calls[1].argv, ElementsAre("qhold", "1234.pbs1"));
  EXPECT_THAT(pbs.calls[2].argv, ElementsAre("qrls", "1234.pbs1"));
  EXPECT_THAT(pbs.calls[3].argv, ElementsAre("qdel", "1237[].pbs1"));
  pbs.answers["qdel"] = answer(35, "", "qdel: Request invalid for state of job 1234.pbs1\n");
  EXPECT_THROW(client.cancel("1234.pbs1"), SchedulerError);
}

TEST(PbsClient, AsksForJsonWithHistoryAndFallsBackToText) {
  FakePbs pbs;
  pbs.answers["qstat -f -F json -x 1234.pbs1"] = answer(0, kJson);
  const Client client = pbs.client();
  const auto job = client.job("1234.pbs1");
  ASSERT_TRUE(job.has_value());
  EXPECT_EQ(job->state, "R");
  EXPECT_THAT(pbs.calls.back().argv, ElementsAre("qstat", "-f", "-F", "json", "-x", "1234.pbs1"));

  // Forgotten (no history): nullopt, with either format.
  pbs.answers["qstat -f -F json -x 9.pbs1"] = answer(153, "", "qstat: Unknown Job Id 9.pbs1\n");
  EXPECT_FALSE(client.job("9.pbs1").has_value());

  // An older PBS that knows no -F json: the text format.
  pbs.answers["qstat -f -F json"] = answer(2, "", "qstat: invalid option -- 'F'\nusage: ...\n");
  pbs.answers["qstat -f -x 1236.pbs1"] = answer(0, kText);
  const auto held = client.job("1236.pbs1");
  ASSERT_TRUE(held.has_value());
  EXPECT_TRUE(held->held());
  EXPECT_THAT(pbs.calls.back().argv, ElementsAre("qstat", "-f", "-x", "1236.pbs1"));

  // A real failure is reported, from the text form.
  pbs.answers["qstat -f -x 5.pbs1"] = answer(1, "", "qstat: cannot connect to server pbs1 (errno=111)\n");
  EXPECT_THROW(client.job("5.pbs1"), SchedulerError);
}

TEST(PbsClient, ListsAnArraysSubjobsAndTheUsersJobs) {
  FakePbs pbs;
  pbs.answers["qstat -f -F json -x -t 1237[].pbs1"] = answer(0, R"({"Jobs":{
      "1237[].pbs1":{"Job_Name":"grid","job_state":"B"},
      "1237[0].pbs1":{"Job_Name":"grid","job_state":"X","Exit_status":0},
      "1237[1].pbs1":{"Job_Name":"grid","job_state":"R","run_count":1},
      "1237[2].pbs1":{"Job_Name":"grid","job_state":"Q"}}})");
  pbs.answers["qstat -f -F json -x -u alice"] = answer(0, kJson);
  const Client client = pbs.client();
  const auto tasks = client.job_tasks("1237[].pbs1");
  ASSERT_EQ(tasks.size(), 3u);
  EXPECT_EQ(tasks[0].id, "1237[0].pbs1");
  EXPECT_EQ(tasks[1].state, "R");
  EXPECT_EQ(tasks[2].state, "Q");
  EXPECT_EQ(client.user_jobs("alice").size(), 2u);
  EXPECT_THAT(pbs.calls.back().argv, ElementsAre("qstat", "-f", "-F", "json", "-x", "-u", "alice"));
}

}  // namespace
}  // namespace hpctrial::pbs
