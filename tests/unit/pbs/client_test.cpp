// pbs::Client over a fake runner: the argv it runs, and how it reads qstat (the pbs tier runs
// it against a real server). The outputs below copy the shapes PBS Pro / OpenPBS print, as
// published by their users and as OpenPBS 23.06 printed them on a real server (qstat -f -F json
// -x: "Jobs" keyed by job id, numbers unquoted, "host:/path" output paths, "Jobs" left out when
// nothing matches) and the "key = value" text of qstat -f with tab-continued lines.
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
  client.hold("1234.pbs1");
  client.release("1234.pbs1");
  client.cancel("1237[].pbs1");
  client.cancel("1238.pbs1", 120);
  ASSERT_EQ(pbs.calls.size(), 4u);
  EXPECT_THAT(pbs.calls[0].argv, ElementsAre("qhold", "1234.pbs1"));
  EXPECT_THAT(pbs.calls[1].argv, ElementsAre("qrls", "1234.pbs1"));
  EXPECT_THAT(pbs.calls[2].argv, ElementsAre("qdel", "1237[].pbs1"));
  EXPECT_THAT(pbs.calls[3].argv, ElementsAre("qdel", "-W", "120", "1238.pbs1"));
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
  // Several jobs, or an array job's with -t, come as text (given several, OpenPBS 23.06 prints
  // only the first as JSON).
  pbs.answers["qstat -f -x -t 1237[].pbs1"] = answer(0,
      "Job Id: 1237[].pbs1\n    Job_Name = grid\n    job_state = B\n\n"
      "Job Id: 1237[0].pbs1\n    Job_Name = grid\n    job_state = X\n    Exit_status = 0\n\n"
      "Job Id: 1237[1].pbs1\n    Job_Name = grid\n    job_state = R\n    run_count = 1\n\n"
      "Job Id: 1237[2].pbs1\n    Job_Name = grid\n    job_state = Q\n\n");
  const Client client = pbs.client();
  const auto tasks = client.jobs({"1237[].pbs1"});
  ASSERT_EQ(tasks.size(), 4u);
  std::map<std::string, std::string> states;
  for (const auto& t : tasks) states[t.id] = t.state;
  EXPECT_EQ(states["1237[].pbs1"], "B");
  EXPECT_EQ(states["1237[0].pbs1"], "X");
  EXPECT_EQ(states["1237[1].pbs1"], "R");
  EXPECT_EQ(states["1237[2].pbs1"], "Q");
  EXPECT_THAT(pbs.calls.back().argv, ElementsAre("qstat", "-f", "-x", "-t", "1237[].pbs1"));

  // A user's jobs: qstat refuses -u beside -f ("qstat: conflicting options."), so qselect names
  // the live ones and, from the history, those changed since the time given (not weeks of them:
  // qstat asks for each on a connection of its own), and one qstat describes them; a job of
  // another owner is left out.
  pbs.calls.clear();
  const std::time_t since = 1764320400;
  std::tm local{};
  ::localtime_r(&since, &local);
  char when[32];
  std::strftime(when, sizeof when, "%Y%m%d%H%M", &local);
  const std::string ended = std::string("-tm.gt.") + when;
  pbs.answers["qselect -u alice"] = answer(0, "1238.pbs1\n");
  pbs.answers["qselect -x -u alice " + ended] = answer(0, "1236.pbs1\n1238.pbs1\n");
  pbs.answers["qstat -f -x 1238.pbs1 1236.pbs1"] =
      answer(0, kText + "\nJob Id: 1238.pbs1\n    Job_Owner = bob@login1\n    job_state = R\n");
  const auto mine = client.user_jobs("alice", since);
  ASSERT_EQ(mine.size(), 1u);
  EXPECT_EQ(mine[0].id, "1236.pbs1");
  ASSERT_EQ(pbs.calls.size(), 3u);
  EXPECT_THAT(pbs.calls[0].argv, ElementsAre("qselect", "-u", "alice"));
  EXPECT_THAT(pbs.calls[1].argv, ElementsAre("qselect", "-x", "-u", "alice", ended));
  EXPECT_THAT(pbs.calls[2].argv, ElementsAre("qstat", "-f", "-x", "1238.pbs1", "1236.pbs1"));
  // No job: no qstat at all; a server without history lists the live ones; a line that is no
  // job id is an error.
  pbs.answers["qselect -u carol"] = answer(0, "");
  pbs.answers["qselect -x -u carol " + ended] = answer(0, "");
  EXPECT_TRUE(client.user_jobs("carol", since).empty());
  pbs.answers["qselect -u erin"] = answer(0, "1240.pbs1\n");
  pbs.answers["qselect -x -u erin " + ended] = answer(2, "", "qselect: illegal -x");
  pbs.calls.clear();
  client.user_jobs("erin", since);
  EXPECT_THAT(pbs.calls.back().argv, ElementsAre("qstat", "-f", "-x", "1240.pbs1"));
  pbs.answers["qselect -u dave"] = answer(0, "1236.pbs1; rm -rf /\n");
  EXPECT_THROW(client.user_jobs("dave", since), SchedulerError);
  // No user: every user's jobs, bob's too ("qselect" answers every qselect: the fake matches by
  // prefix).
  pbs.answers.clear();
  pbs.answers["qselect"] = answer(0, "1238.pbs1\n1236.pbs1\n");
  pbs.answers["qstat -f -x 1238.pbs1 1236.pbs1"] =
      answer(0, kText + "\nJob Id: 1238.pbs1\n    Job_Owner = bob@login1\n    job_state = R\n");
  pbs.calls.clear();
  const auto everyone = client.user_jobs("", since);
  ASSERT_EQ(everyone.size(), 3u);  // the array job 1237[] too, as qstat described it
  EXPECT_EQ(everyone[0].owner, "alice@login1");
  EXPECT_EQ(everyone[2].owner, "bob@login1");
  EXPECT_THAT(pbs.calls[0].argv, ElementsAre("qselect"));
  EXPECT_THAT(pbs.calls[1].argv, ElementsAre("qselect", "-x", ended));

  // More jobs than qstat may name (a connection and a reserved port each): every job on one
  // connection, then those asked for, an array's subjobs with it.
  std::vector<std::string> many;
  for (int i = 0; i < 40; ++i) many.push_back(std::to_string(2000 + i) + ".pbs1");
  many.push_back("1237[].pbs1");
  pbs.answers["qstat -f -x -t"] = answer(0, "Job Id: 2003.pbs1\n    job_state = F\n\nJob Id: 9999.pbs1\n"
                                            "    job_state = R\n\nJob Id: 1237[1].pbs1\n    job_state = R\n");
  pbs.calls.clear();
  const auto found = client.jobs(many);
  ASSERT_EQ(pbs.calls.size(), 1u);
  EXPECT_THAT(pbs.calls[0].argv, ElementsAre("qstat", "-f", "-x", "-t"));
  ASSERT_EQ(found.size(), 2u);
  EXPECT_EQ(found[0].id, "2003.pbs1");
  EXPECT_EQ(found[1].id, "1237[1].pbs1");
}

// Several jobs by one qstat, as OpenPBS 23.06 answers when it forgot one of them: the others on
// stdout, "Unknown Job Id" for each forgotten one on stderr, exit 153.
TEST(PbsClient, ReadsSeveralJobsByOneQstatThoughSomeAreForgotten) {
  FakePbs pbs;
  pbs.answers["qstat -f -x 1236.pbs1 9.pbs1"] = answer(153, kText, "qstat: Unknown Job Id 9.pbs1\n");
  const Client client = pbs.client();
  const auto jobs = client.jobs({"1236.pbs1", "9.pbs1"});
  ASSERT_EQ(jobs.size(), 2u) << "the two jobs of the answer";
  EXPECT_EQ(pbs.calls.size(), 1u);
  // All forgotten: nothing, and no error.
  pbs.answers["qstat -f -x 8.pbs1 9.pbs1"] =
      answer(153, "", "qstat: Unknown Job Id 8.pbs1\nqstat: Unknown Job Id 9.pbs1\n");
  EXPECT_TRUE(client.jobs({"8.pbs1", "9.pbs1"}).empty());
  EXPECT_TRUE(client.jobs({}).empty());
  // Another complaint beside them is an error.
  pbs.answers["qstat -f -x 7.pbs1"] = answer(153, "", "qstat: Unknown Job Id 7.pbs1\nqstat: cannot connect to server\n");
  EXPECT_THROW(client.jobs({"7.pbs1"}), SchedulerError);
}

}  // namespace
}  // namespace hpctrial::pbs
