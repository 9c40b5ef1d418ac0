// `squeue --json` read into JobInfo as `scontrol show job` shows the same jobs: records as Slurm
// 22.05 printed them for jobs on the local cluster (an array's failed task, a job killed by a
// signal, a running job, an array's tasks not started yet), the form later versions print, and
// output patterns named as slurmd named the files.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ctime>

#include "hpctrial/core/error.h"
#include "hpctrial/slurm/client.h"

namespace hpctrial::slurm {
namespace {

using testing::HasSubstr;

constexpr std::time_t kNow = 1796014786;

// Fields of `squeue --json` (openapi/v0.0.38) for jobs 130-133, cut to those read and a few beside.
const std::string k2205 = R"({"meta": {"plugin": {"type": "openapi\/v0.0.38"}}, "errors": [], "jobs": [
 {"account": "", "array_job_id": 130, "array_task_id": 0, "array_task_string": "", "array_max_tasks": 0,
  "batch_host": "vm", "job_id": 133, "job_state": "FAILED", "state_reason": "NonZeroExitCode", "name": "wrap",
  "nice": null, "priority": 4294901649, "restart_cnt": 1, "start_time": 1796014703, "end_time": 1796014770,
  "submit_time": 1796014700, "suspend_time": 0, "pre_sus_time": 0, "exit_code": 768, "derived_exit_code": 0,
  "nodes": "vm", "tasks": 2, "partition": "debug", "excluded_nodes": "hpctrial-b",
  "standard_output": "\/tmp\/z-%A_%3a-%x-%u.out", "standard_error": "", "user_id": 1000, "user_name": "alice",
  "current_working_directory": "\/home\/alice"},
 {"array_job_id": 0, "array_task_id": null, "array_task_string": "", "batch_host": "vm", "job_id": 131,
  "job_state": "FAILED", "state_reason": "JobLaunchFailure", "name": "k", "nice": 5, "priority": 1,
  "restart_cnt": 0, "start_time": 1796014703, "end_time": 1796014703, "suspend_time": 0, "pre_sus_time": 0,
  "exit_code": 9, "nodes": "vm", "tasks": 1, "standard_output": "\/tmp\/k-%j.out",
  "standard_error": "\/tmp\/k-%j.err", "user_id": 1001, "user_name": "bob"},
 {"array_job_id": 0, "array_task_id": null, "batch_host": "vm", "job_id": 132, "job_state": "RUNNING",
  "state_reason": "None", "start_time": 1796014703, "end_time": 1827550703, "suspend_time": 0, "pre_sus_time": 0,
  "exit_code": 0, "tasks": 4, "standard_output": "\/tmp\/s-%j.out", "user_id": 1000, "user_name": "alice"},
 {"array_job_id": 129, "array_task_id": null, "array_task_string": "0-2", "batch_host": "", "job_id": 129,
  "job_state": "PENDING", "state_reason": "JobHeldUser", "name": "grid", "priority": 0, "start_time": 0,
  "end_time": 0, "submit_time": 1796014689, "exit_code": 0, "tasks": 1,
  "standard_output": "\/e\/slurm-%A_%a.out", "user_id": 1000, "user_name": "alice"}]})";

TEST(SlurmJobJson, ReadsSlurm2205sRecordsAsScontrolShowsThem) {
  const auto jobs = parse_jobs_json(k2205, "squeue --json", kNow);
  ASSERT_EQ(jobs.size(), 4u);
  const JobInfo& task = jobs[0];
  EXPECT_EQ(task.id, "133");
  EXPECT_EQ(task.display_id(), "130_0");
  EXPECT_EQ(task.state, "FAILED");
  EXPECT_EQ(task.reason, "NonZeroExitCode");
  EXPECT_EQ(task.exit_code, "3:0");  // wait status 768: exit 3
  EXPECT_EQ(task.run_time, "00:01:07");
  EXPECT_EQ(task.restarts, 1);
  EXPECT_EQ(task.num_tasks, 2);
  EXPECT_EQ(task.priority, "4294901649");
  EXPECT_EQ(task.nice, "0");  // null: not set
  EXPECT_EQ(task.partition, "debug");
  EXPECT_EQ(task.excluded_nodes, "hpctrial-b");
  EXPECT_EQ(task.user_id, "1000");
  EXPECT_EQ(task.user_name, "alice");
  EXPECT_EQ(task.work_dir, "/home/alice");
  EXPECT_EQ(task.std_out, "/tmp/z-130_000-wrap-alice.out");
  EXPECT_EQ(task.std_err, task.std_out) << "no error file of its own: both streams in one, as scontrol shows";

  EXPECT_EQ(jobs[1].exit_code, "0:9");  // killed by signal 9
  EXPECT_EQ(jobs[1].nice, "5");
  EXPECT_EQ(jobs[1].std_out, "/tmp/k-131.out");
  EXPECT_EQ(jobs[1].std_err, "/tmp/k-131.err");
  EXPECT_EQ(jobs[1].display_id(), "131");

  EXPECT_EQ(jobs[2].state, "RUNNING");
  EXPECT_EQ(jobs[2].run_time, "00:01:23") << "a running job's time runs to now, not to its end_time (its limit)";

  const JobInfo& pending = jobs[3];
  EXPECT_EQ(pending.display_id(), "129_[0-2]");
  EXPECT_TRUE(pending.held());
  EXPECT_EQ(pending.run_time, "00:00:00");
  EXPECT_EQ(pending.start_time, "Unknown");
  EXPECT_EQ(pending.std_out, "/e/slurm-129_4294967294.out") << "no task id yet: Slurm's NO_VAL, as scontrol shows";
}

TEST(SlurmJobJson, ReadsTheFormOfLaterVersions) {
  // Numbers as {"set", "infinite", "number"}, job_state a list of the base state and its flags,
  // exit_code an object.
  const std::string later = R"({"jobs": [
   {"job_id": 40, "array_job_id": {"set": true, "infinite": false, "number": 0},
    "array_task_id": {"set": false, "infinite": false, "number": 0}, "job_state": ["PENDING", "REQUEUE_HOLD"],
    "state_reason": "JobHoldMaxRequeue", "restart_cnt": 3, "priority": {"set": true, "infinite": false, "number": 7},
    "nice": {"set": true, "number": 2}, "start_time": {"set": true, "number": 0},
    "exit_code": {"status": ["EXITED"], "return_code": {"set": true, "number": 2},
                  "signal": {"id": {"set": false, "number": 0}, "name": ""}},
    "tasks": {"set": true, "number": 8}, "standard_output": "/e/slurm-%j.out", "user_id": 1000},
   {"job_id": 41, "array_job_id": {"set": true, "number": 41}, "array_task_id": {"set": true, "number": 5},
    "job_state": ["RUNNING", "COMPLETING"], "start_time": {"set": true, "number": 1796014700},
    "end_time": {"set": true, "number": 1796014760}, "exit_code": {"return_code": 0, "signal": {"id": 15}},
    "standard_output": "/e/slurm-%A_%a.out"}]})";
  const auto jobs = parse_jobs_json(later, "squeue --json", kNow);
  ASSERT_EQ(jobs.size(), 2u);
  EXPECT_EQ(jobs[0].state, "REQUEUE_HOLD");
  EXPECT_EQ(jobs[0].display_id(), "40");
  EXPECT_EQ(jobs[0].priority, "7");
  EXPECT_EQ(jobs[0].nice, "2");
  EXPECT_EQ(jobs[0].restarts, 3);
  EXPECT_EQ(jobs[0].num_tasks, 8);
  EXPECT_EQ(jobs[0].exit_code, "2:0");
  EXPECT_EQ(jobs[0].std_out, "/e/slurm-40.out");
  EXPECT_EQ(jobs[1].state, "COMPLETING");
  EXPECT_EQ(jobs[1].display_id(), "41_5");
  EXPECT_EQ(jobs[1].exit_code, "0:15");
  EXPECT_EQ(jobs[1].run_time, "00:01:26") << "still completing: it runs to now";
  EXPECT_EQ(jobs[1].std_out, "/e/slurm-41_5.out");
}

TEST(SlurmJobJson, SomethingElseIsAnErrorNamingTheCommand) {
  for (const std::string& text : {std::string("squeue: error: x"), std::string("{\"errors\": []}"),
                                  std::string("{\"jobs\": [{\"name\": \"no id\"}]}"), std::string("[1]")}) {
    try {
      parse_jobs_json(text, "squeue --json --states=all --me", kNow);
      ADD_FAILURE() << text;
    } catch (const SchedulerError& e) {
      EXPECT_THAT(e.what(), HasSubstr("cannot read `squeue --json --states=all --me`")) << text;
    }
  }
}

TEST(SlurmJobJson, OutputPatternsNameTheFilesSlurmdWrote) {
  // The files sbatch -o made on the local cluster for jobs 134 (plain) and 135 (array task 7).
  JobInfo plain;
  plain.id = "134";
  plain.name = "my job";
  plain.user_name = "root";
  plain.batch_host = "vm";
  EXPECT_EQ(expand_output_pattern("/tmp/p/o_%%_%A_%a_%b_%J_%j_%N_%n_%s_%t_%u_%x_%5j.out", plain),
            "/tmp/p/o_%_134_4294967294_%b_134_134_vm_0_batch_0_root_my job_00134.out");
  JobInfo task = plain;
  task.id = "135";
  task.array_job_id = "135";
  task.array_task = "7";
  EXPECT_EQ(expand_output_pattern("/tmp/p/a_%A_%a_%b_%J_%j_%3a_%N.out", task), "/tmp/p/a_135_7_%b_135_135_007_vm.out");
  // Not started: no batch host to name; a trailing % or width stays.
  plain.batch_host.clear();
  EXPECT_EQ(expand_output_pattern("/o/%N-%j%", plain), "/o/%N-134%");
  EXPECT_EQ(expand_output_pattern("/o/%j-%12", plain), "/o/134-%12");
}

}  // namespace
}  // namespace hpctrial::slurm
