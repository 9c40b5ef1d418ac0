// recovery: what a rank's failure costs, on the shared filesystem's checkpoints alone and with
// the memory level (checkpoint_levels.memory), in the same run of this program.
//
//   recovery [--quick] [--dir DIR] [--memory-dir /dev/shm] [--state-mib 256] [--ranks 2]
//            [--period 10] [--step-ms 200] [--seed N] [--kill-from N] [--kill-span N]
//
// Each path is one `hpctrial run` of benchmarks/pause_resume_trial.cpp (state_mib MiB of float32
// parameters, SGD: a checkpoint holds that much state; each step sleeps step_ms before the
// optimizer step, as a rank waits for its GPU, the CPU free) on `ranks` ranks with max_restarts 1, in
// which the last rank is SIGKILLed (HPCTRIAL_FAULT) at step K, drawn from [kill-from,
// kill-from + kill-span) by the seed, the same K for both paths:
//   shared_fs  min_checkpoint_period: auto, today's default: the restart resumes from the
//              newest checkpoint on the shared filesystem (none before the first minute)
//   memory     the same, and every rank copies its state into node memory every `period` batches
// For each path:
//   lost       K minus the batch the restart resumed from: the steps trained again
//   restart    from the kill (the rank's own time stamp as it is killed) to the end of the first
//              step of the restarted run: the launcher's restart, mpirun, the ranks' start, the
//              copy or checkpoint read
//   recovery   restart + lost x the mean step: until training is back where it failed
//   step       the mean step of the restarted run over the 9 periods after its first step (the
//              same number of steps on both paths; the first step, which touches every page of
//              the state afresh, is left out): the wall-clock time from the end of its first step
//              to the end of the step 9 periods later, over 9 periods. On the memory path that
//              holds 9 copies; the first copy into each of the two slots is the first write
//              through their mappings in that process, and pays for the pages' first touch
//   copy       the memory level's stall per copy: its `memory_copy` phase and the optimizer's
//              wait for the copy's tensors, less that wait on the shared_fs path, per copy
//   excess     among those 9 periods' steps, the median of the steps that hold a copy's cost
//              (batch M with M % period == 0: the copy is taken at the boundary before it, and
//              its tensors are waited for before its optimizer step) less the median of the
//              others; on shared_fs, the same batches without a copy (the noise floor)
// and the memory level's cost, measured within its own run: excess / (period x the median of
// the steps without a copy), what the stall and the copy's thread (on the cores training uses)
// take, amortized over the period. The mean steps of the two runs are compared too, for context:
// two runs of the same program on a shared machine differ by more than the cost.
// Goals: memory's lost <= period (a copy still being written when the rank dies is not there);
// memory's restart <= 3 s; cost <= 0.02 with a copy every 10 steps; memory's recovery /
// shared_fs's recovery <= 0.1.
// --quick: 16 MiB, 50 ms steps, K in [12, 16), period 4: the test suite's smoke run.
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "hpctrial/core/subprocess.h"

namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "recovery: %s\n", message.c_str());
  std::exit(1);
}

struct Options {
  std::string dir = "recovery-scratch";
  std::string memory_dir = "/dev/shm";
  int step_ms = 200;
  int state_mib = 256;
  int ranks = 2;
  int period = 10;
  unsigned seed = 0;
  int kill_from = 150;
  int kill_span = 100;
};

struct Path {
  std::string name;
  long long killed_at_step = 0;
  long long resumed_from = 0;
  double restart_s = 0;
  double step_s = 0;        // the restarted run's mean step, its first left out
  double copy_step_s = 0;   // the median step that holds a copy's cost (on shared_fs: the same batches)
  double plain_step_s = 0;  // the median of the other steps
  double copy_s = 0;        // memory_copy + checkpoint_copy_wait, in all
  double copy_wait_s = 0;   // checkpoint_copy_wait alone
  long long copies = 0;
  double recovery_s() const { return restart_s + static_cast<double>(killed_at_step - resumed_from) * step_s; }
};

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

// One phase of the restarted run's timings (metrics.jsonl's last "timings" record): seconds, count.
std::pair<double, long long> phase(const nlohmann::json& timings, const char* name) {
  if (!timings.contains(name)) return {0.0, 0};
  const auto& p = timings.at(name);
  return {p.value("total_s", 0.0), p.value("count", 0LL)};
}

// The steps of the restarted run over which its mean step is taken: 9 periods, after its first.
int timed_steps(const Options& o) { return 9 * o.period; }

Path run_path(const Options& o, const std::string& name, int kill_step, bool memory) {
  Path path;
  path.name = name;
  const std::string experiment = o.dir + "/" + name;
  fs::remove_all(experiment);
  const std::string config = o.dir + "/" + name + ".yaml";
  std::ofstream(config) << "name: recovery-" << name << "\nentrypoint: " << HPCTRIAL_RECOVERY_TRIAL << "\n"
                        << "searcher: {name: single, metric: validation_loss, max_length: {batches: "
                        << kill_step + 10 * o.period << "}}\n"
                        << "hyperparameters: {global_batch_size: " << 8 * o.ranks << ", state_mib: " << o.state_mib
                        << ", step_ms: " << o.step_ms << ", timed_steps: " << timed_steps(o) << "}\nresources: {slots_per_trial: " << o.ranks << "}\nmax_restarts: 1\n"
                        << "min_checkpoint_period: auto\n"
                        << (memory ? "checkpoint_levels: {memory: {period: {batches: " + std::to_string(o.period) +
                                         "}, dir: " + o.memory_dir + "}}\n"
                                   : std::string());
  const std::string fault = "rank" + std::to_string(o.ranks - 1) + ":step" + std::to_string(kill_step) + ":restart0:sigkill";
  hpctrial::core::RunOptions options;
  options.timeout = 3600s;
  options.env_set = {{"HPCTRIAL_FAULT", fault}, {"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  const auto r = hpctrial::core::run_process(
      {HPCTRIAL_CLI, "run", config, "--experiment", experiment, "--oversubscribe"}, options);
  const std::string log = r.out + r.err;
  std::ofstream(experiment + ".log") << log;
  if (!r.ok()) die(name + ": hpctrial run failed: " + r.describe() + "\n" + log);
  std::smatch m;
  if (!std::regex_search(log, m, std::regex(R"(injected fault \S+ on rank \d+ at step (\d+) \(unix ms (\d+)\))"))) {
    die(name + ": the rank was not killed:\n" + log);
  }
  path.killed_at_step = std::stoll(m[1]);
  const long long killed_ms = std::stoll(m[2]);
  static const std::regex first(R"(first step of this run: batch \d+ ended at (\d+))");
  std::vector<long long> firsts;
  std::size_t restarted_at = 0;  // where the restarted run's lines begin
  for (auto it = std::sregex_iterator(log.begin(), log.end(), first); it != std::sregex_iterator(); ++it) {
    firsts.push_back(std::stoll((*it)[1]));
    restarted_at = static_cast<std::size_t>(it->position());
  }
  if (firsts.size() != 2) die(name + ": expected two runs' first steps in the log:\n" + log);
  path.restart_s = static_cast<double>(firsts[1] - killed_ms) / 1000.0;
  static const std::regex timed(R"(step (\d+) of this run: batch (\d+) ended at (\d+))");
  std::vector<long long> batches, ends;
  for (auto it = std::sregex_iterator(log.begin() + static_cast<std::ptrdiff_t>(restarted_at), log.end(), timed);
       it != std::sregex_iterator(); ++it) {
    batches.push_back(std::stoll((*it)[2]));
    ends.push_back(std::stoll((*it)[3]));
  }
  if (ends.size() != static_cast<std::size_t>(timed_steps(o))) {
    die(name + ": the restarted run did not train " + std::to_string(timed_steps(o)) + " steps:\n" + log);
  }
  path.step_s = static_cast<double>(ends.back() - firsts[1]) / 1000.0 / static_cast<double>(timed_steps(o));
  // The steps that hold a copy's cost (batch index M with M % period == 0: the copy taken after
  // batch M - 1, at the step boundary, and its tensors waited for before M's optimizer step)
  // against the others.
  std::vector<double> copying, plain;
  for (std::size_t t = 0; t < ends.size(); ++t) {
    const double step = static_cast<double>(ends[t] - (t == 0 ? firsts[1] : ends[t - 1])) / 1000.0;
    (batches[t] % o.period == 0 ? copying : plain).push_back(step);
  }
  path.copy_step_s = median(copying);
  path.plain_step_s = median(plain);
  if (std::regex_search(log, m, std::regex(R"(resumed from \S+ after (\d+) batches)"))) path.resumed_from = std::stoll(m[1]);
  // The restarted run's timings: the last "timings" record of the trial's metrics.
  nlohmann::json timings;
  std::ifstream metrics(experiment + "/trial-0/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto record = nlohmann::json::parse(line, nullptr, false);
    if (record.is_object() && record.value("kind", "") == "timings") timings = record.value("timings", nlohmann::json());
  }
  const auto [copy_s, copies] = phase(timings, "memory_copy");
  const auto [wait_s, waits] = phase(timings, "checkpoint_copy_wait");
  (void)waits;
  path.copy_s = copy_s + wait_s;
  path.copy_wait_s = wait_s;
  path.copies = copies;
  return path;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      o.state_mib = 16;
      o.step_ms = 50;
      o.kill_from = 12;
      o.kill_span = 4;
      o.period = 4;
      continue;
    }
    if (i + 1 >= argc) die("usage: recovery [--quick] [--dir DIR] [--memory-dir DIR] [--state-mib N] [--ranks N] "
                           "[--period N] [--step-ms N] [--seed N] [--kill-from N] [--kill-span N]");
    const std::string value = argv[++i];
    if (arg == "--dir") o.dir = value;
    else if (arg == "--memory-dir") o.memory_dir = value;
    else if (arg == "--step-ms") o.step_ms = std::stoi(value);
    else if (arg == "--state-mib") o.state_mib = std::stoi(value);
    else if (arg == "--ranks") o.ranks = std::stoi(value);
    else if (arg == "--period") o.period = std::stoi(value);
    else if (arg == "--seed") o.seed = static_cast<unsigned>(std::stoul(value));
    else if (arg == "--kill-from") o.kill_from = std::stoi(value);
    else if (arg == "--kill-span") o.kill_span = std::stoi(value);
    else die("unknown option " + arg);
  }
  if (o.seed == 0) o.seed = static_cast<unsigned>(std::random_device{}());
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  o.dir = fs::absolute(o.dir).string();
  fs::create_directories(o.dir);
  std::mt19937 random(o.seed);
  const int kill_step = o.kill_from + static_cast<int>(random() % static_cast<unsigned>(std::max(1, o.kill_span)));
  std::printf("a rank killed at step %d (seed %u) of a trial of %d MiB of state on %d ranks, %d ms steps; memory "
              "level every %d batches in %s\n", kill_step, o.seed, o.state_mib, o.ranks, o.step_ms, o.period,
              o.memory_dir.c_str());
  const Path shared = run_path(o, "shared_fs", kill_step, false);
  const Path memory = run_path(o, "memory", kill_step, true);
  std::printf("%-10s %6s %9s %10s %8s %10s %11s\n", "path", "lost", "restart_s", "recovery_s", "step_ms", "copy_ms",
              "excess_ms");
  for (const Path& p : {shared, memory}) {
    const double per_copy = p.copies > 0 ? (p.copy_s - shared.copy_wait_s) / static_cast<double>(p.copies) : 0;
    std::printf("%-10s %6lld %9.2f %10.2f %8.1f %10.2f %11.1f\n", p.name.c_str(), p.killed_at_step - p.resumed_from,
                p.restart_s, p.recovery_s(), p.step_s * 1000, per_copy * 1000, (p.copy_step_s - p.plain_step_s) * 1000);
  }
  // The memory level's cost within its own run: what the steps holding a copy take over the
  // others, once every period, against the period's steps.
  const double cost = memory.plain_step_s > 0
                          ? (memory.copy_step_s - memory.plain_step_s) / (o.period * memory.plain_step_s)
                          : 0;
  const double floor = shared.plain_step_s > 0
                           ? (shared.copy_step_s - shared.plain_step_s) / (o.period * shared.plain_step_s)
                           : 0;
  std::printf("memory: lost %lld <= period %d: %s; restart %.2f s (goal <= 3 s); cost %+.4f of the step with a copy "
              "every %d (goal <= 0.02; the same batches on shared_fs, without copies: %+.4f; the mean steps of the two "
              "runs: %+.4f); recovery memory / shared_fs %.3f (goal <= 0.1)\n",
              memory.killed_at_step - memory.resumed_from, o.period,
              memory.killed_at_step - memory.resumed_from <= o.period ? "yes" : "no", memory.restart_s, cost, o.period,
              floor, shared.step_s > 0 ? memory.step_s / shared.step_s - 1 : 0.0,
              shared.recovery_s() > 0 ? memory.recovery_s() / shared.recovery_s() : 0.0);
  return 0;
}
