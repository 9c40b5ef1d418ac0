// The Slurm and PBS job environments as the launcher reads them: every variable through a
// MapEnv and every command through a fake runner, so each branch runs without a scheduler.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ctime>

#include "../../support/temp_dir.h"
#include "hpctrial/core/error.h"
#include "hpctrial/pbs/job_environment.h"
#include "hpctrial/slurm/job_environment.h"

namespace hpctrial {
namespace {

using testing::HasSubstr;

// Answers commands from a table; records what was asked.
struct FakeRunner {
  std::map<std::string, std::string> answers;  // first argument -> stdout
  std::vector<std::vector<std::string>> asked;
  core::CommandRunner runner() {
    return [this](const std::vector<std::string>& argv, const core::RunOptions&) {
      asked.push_back(argv);
      core::RunResult r;
      r.argv = argv;
      const auto it = answers.find(argv.front());
      r.exit_code = it == answers.end() ? 1 : 0;
      if (it != answers.end()) r.out = it->second;
      return r;
    };
  }
};

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const SchedulerError& e) {
    return e.what();
  }
  return "no error";
}

TEST(SlurmJobEnvironment, OutsideAJobThereIsNone) {
  FakeRunner fake;
  EXPECT_FALSE(slurm::job_allocation(core::MapEnv{}, fake.runner()).has_value());
  EXPECT_TRUE(fake.asked.empty());
}

TEST(SlurmJobEnvironment, ReadsHostsSlotsRestartsAndEndTime) {
  FakeRunner fake;
  fake.answers["scontrol"] = "node01\nnode02\nnode03\n";
  fake.answers["squeue"] = "2026-11-21T05:00:00\n";
  const core::MapEnv env({{"SLURM_JOB_ID", "4242"}, {"SLURM_JOB_NODELIST", "node[01-03]"},
                          {"SLURM_TASKS_PER_NODE", "2(x2),1"}, {"SLURM_RESTART_COUNT", "3"}});
  const auto a = slurm::job_allocation(env, fake.runner());
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->scheduler, "slurm");
  EXPECT_EQ(a->job_id, "4242");
  ASSERT_EQ(a->hosts.size(), 3u);
  EXPECT_EQ(a->hosts[0].name, "node01");
  EXPECT_EQ(a->hosts[1].slots, 2);
  EXPECT_EQ(a->hosts[2].slots, 1);
  EXPECT_EQ(a->total_slots(), 5);
  EXPECT_EQ(a->restart_count, 3);
  ASSERT_TRUE(a->end_time.has_value());
  std::tm tm{};
  tm.tm_year = 126;
  tm.tm_mon = 10;
  tm.tm_mday = 21;
  tm.tm_hour = 5;
  tm.tm_isdst = -1;
  EXPECT_EQ(std::chrono::system_clock::to_time_t(*a->end_time), std::mktime(&tm));
  EXPECT_EQ(fake.asked[0], (std::vector<std::string>{"scontrol", "show", "hostnames", "node[01-03]"}));
}

// The last task of an array to start has the array's own id as SLURM_JOB_ID: requeueing or
// asking squeue about that id would mean every task, so a task is named ARRAY_TASK.
TEST(SlurmJobEnvironment, ATaskOfAJobArrayIsNamedByArrayAndTask) {
  FakeRunner fake;
  fake.answers["scontrol"] = "node01\n";
  fake.answers["squeue"] = "2026-11-21T05:00:00\n";
  const core::MapEnv env({{"SLURM_JOB_ID", "18"}, {"SLURM_JOB_NODELIST", "node01"},
                          {"SLURM_ARRAY_JOB_ID", "18"}, {"SLURM_ARRAY_TASK_ID", "2"}});
  const auto a = slurm::job_allocation(env, fake.runner());
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->job_id, "18_2");
  EXPECT_EQ(fake.asked[1], (std::vector<std::string>{"squeue", "--noheader", "--jobs", "18_2", "--format", "%e"}));
  EXPECT_THAT(error_of([&] {
                slurm::job_allocation(core::MapEnv({{"SLURM_JOB_ID", "18"}, {"SLURM_JOB_NODELIST", "node01"},
                                                    {"SLURM_ARRAY_JOB_ID", "18"}, {"SLURM_ARRAY_TASK_ID", "2;x"}}),
                                      fake.runner());
              }),
              HasSubstr("SLURM_ARRAY_JOB_ID and SLURM_ARRAY_TASK_ID make \"18_2;x\", which is not a Slurm job id"));
}

TEST(SlurmJobEnvironment, BadValuesAreRefusedNamingTheVariable) {
  FakeRunner fake;
  fake.answers["scontrol"] = "node01\n";
  EXPECT_THAT(error_of([&] { slurm::job_allocation(core::MapEnv(std::map<std::string, std::string>{{"SLURM_JOB_ID", "12; rm -rf /"}}), fake.runner()); }),
              HasSubstr("SLURM_JOB_ID is \"12; rm -rf /\", which is not a Slurm job id"));
  EXPECT_THAT(error_of([&] {
                slurm::job_allocation(core::MapEnv({{"SLURM_JOB_ID", "1"}, {"SLURM_JOB_NODELIST", "a b"}}), fake.runner());
              }),
              HasSubstr("SLURM_JOB_NODELIST is \"a b\", which is not a Slurm node list"));
  EXPECT_THAT(error_of([&] {
                slurm::job_allocation(core::MapEnv({{"SLURM_JOB_ID", "1"}, {"SLURM_JOB_NODELIST", "node01"},
                                                    {"SLURM_TASKS_PER_NODE", "2(x2)"}}),
                                      fake.runner());
              }),
              HasSubstr("names 2 nodes but the job has 1"));
  fake.answers["scontrol"] = "node01\n$(evil)\n";
  EXPECT_THAT(error_of([&] {
                slurm::job_allocation(core::MapEnv({{"SLURM_JOB_ID", "1"}, {"SLURM_JOB_NODELIST", "node01"}}),
                                      fake.runner());
              }),
              HasSubstr("\"$(evil)\", which is not valid"));
  EXPECT_EQ(slurm::parse_tasks_per_node("3"), (std::vector<int>{3}));
  EXPECT_THAT(error_of([] { slurm::parse_tasks_per_node("2(x"); }), HasSubstr("expected counts like 2(x3),1"));
  EXPECT_FALSE(slurm::parse_end_time("Unknown").has_value());
  EXPECT_TRUE(slurm::is_valid_job_id("77_3"));
}

TEST(PbsJobEnvironment, NodeFilesPerChunkOrPerProcessBecomeHostsWithSlots) {
  const auto per_process = pbs::parse_node_file("n1\nn1\nn2\nn2\nn1\n", "nodes");
  ASSERT_EQ(per_process.size(), 2u);
  EXPECT_EQ(per_process[0].name, "n1");
  EXPECT_EQ(per_process[0].slots, 3);
  EXPECT_EQ(per_process[1].slots, 2);
  const auto per_chunk = pbs::parse_node_file("n1.cluster\nn2.cluster\n", "nodes");
  EXPECT_EQ(per_chunk.size(), 2u);
  EXPECT_THAT(error_of([] { pbs::parse_node_file("n1\nbad host\n", "/var/spool/nodes"); }),
              HasSubstr("/var/spool/nodes:2: \"bad host\" is not a host name"));
}

TEST(PbsJobEnvironment, ReadsTheRunCountAndTheEndFromQstat) {
  testing_support::TempDir dir;
  const std::string nodes = dir.write("nodes", "n1\nn1\n");
  FakeRunner fake;
  fake.answers["qstat"] = "Job Id: 77.server\n    run_count = 3\n    stime = Sat Nov 21 04:00:00 2026\n"
                          "    Resource_List.walltime = 02:30:00\n";
  const auto a = pbs::job_allocation(core::MapEnv({{"PBS_JOBID", "77.server"}, {"PBS_NODEFILE", nodes}}),
                                     fake.runner());
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->scheduler, "pbs");
  EXPECT_EQ(a->restart_count, 2);
  EXPECT_EQ(a->total_slots(), 2);
  std::tm tm{};
  tm.tm_year = 126;
  tm.tm_mon = 10;
  tm.tm_mday = 21;
  tm.tm_hour = 6;
  tm.tm_min = 30;
  tm.tm_isdst = -1;
  ASSERT_TRUE(a->end_time.has_value());
  EXPECT_EQ(std::chrono::system_clock::to_time_t(*a->end_time), std::mktime(&tm));
  EXPECT_FALSE(a->kill_delay_seconds.has_value()) << "no PBS_QUEUE, no queue asked";

  // The queue's kill_delay (qstat -Qf QUEUE), PBS's 10 s where it sets none.
  fake.asked.clear();
  const auto queued = pbs::job_allocation(
      core::MapEnv({{"PBS_JOBID", "77.server"}, {"PBS_NODEFILE", nodes}, {"PBS_QUEUE", "workq"}}), fake.runner());
  ASSERT_TRUE(queued.has_value());
  EXPECT_EQ(queued->kill_delay_seconds, 10);
  EXPECT_EQ(fake.asked.back(), (std::vector<std::string>{"qstat", "-Qf", "workq"}));
  core::Allocation q;
  pbs::apply_queue("Queue: workq\n    queue_type = Execution\n    kill_delay = 120\n    enabled = True\n", q);
  EXPECT_EQ(q.kill_delay_seconds, 120);
  EXPECT_THAT(error_of([&] { pbs::apply_queue("Queue: workq\n    kill_delay = soon\n", q); }),
              HasSubstr("kill_delay = soon"));
  EXPECT_THAT(error_of([&] { pbs::job_allocation(core::MapEnv(std::map<std::string, std::string>{{"PBS_JOBID", "77`x`"}}), fake.runner()); }),
              HasSubstr("PBS_JOBID is \"77`x`\", which is not a PBS job id"));
  EXPECT_FALSE(pbs::job_allocation(core::MapEnv{}, fake.runner()).has_value());
}

}  // namespace
}  // namespace hpctrial
