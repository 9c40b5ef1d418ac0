// scale: how hpctrial's own costs grow with the number of ranks. At each world size (1, 2, 4, 8,
// 16 and 32 ranks on this machine: oversubscribed, Open MPI told to yield an idle core, a model
// so small that hpctrial's own work is most of a step) one `hpctrial run` measures
//   - launch: from the command to the end of the chief's first step; and the chief's CPU time
//     before MPI_Init (loading the program and its libraries, static initialisers): work every
//     rank does on its own cores at scale, but that N ranks on C cores here do N / C times
//     over, one after another. Its part, max(1, N / C) times it, is taken out of the launch
//     before the launch is fitted: what is left is what the ranks wait on each other and on the
//     launcher for, which is what grows at scale;
//   - control plane: the chief's median time a step spends outside train_batch (the stop and
//     request flags' agreement, metrics, the heartbeat, the next batch), beyond the gradient
//     all-reduce, which is in train_batch;
//   - checkpoint commit: the chief's mean `checkpoint_durable` phase (pieces, manifest,
//     identity checks, publication, retention), a checkpoint every 50 steps;
//   - stop: from SIGUSR2 to `hpctrial run` (a scheduler's warning, a pause) to its exit 75 with
//     the ranks' checkpoint, and the steps the chief trained after the signal;
// and a second run measures
//   - failure: from SIGKILL of the last rank to `hpctrial run`'s exit, every other rank ended.
// Each cost is fitted three ways - constant, a + b log2 N, a + b N (least squares) - and the
// best fit (the simplest whose residual is within 20 % of the best's) extrapolated to 4 096
// ranks. Goals: the control plane no faster than log N; launch, stop and checkpoint commit
// extrapolated to <= 10 s at 4 096 ranks.
//
// Then the paths that read one record per rank, at 4 096 and 65 536 simulated ranks (records
// written here, no processes): core::read_heartbeats, which the launcher's failure record and
// `hpctrial describe` read, and `hpctrial describe` of an experiment whose trial holds them.
// Goal: each <= 1 s at 65 536 ranks.
//
//   scale [--quick] [--world-sizes 1,2,4,8,16,32] [--records 4096,65536] [--rounds 3]
//
// Every cost is the median of --rounds rounds, each of which measures every size once.
// --quick: 1, 2 and 4 ranks, one round, records at 4 096 - the test suite's smoke run.
#include <torch/torch.h>

#include <hpctrial/trainer.h>

#include <mpi.h>
#include <sys/resource.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/core/layout.h"
#include "hpctrial/core/subprocess.h"
#include "io_util.h"
#include "trial_records.h"

// The worker's CPU time when its MPI_Init began: the library's MPI_Init_thread reaches this
// definition (the program exports it) before Open MPI's, through the MPI profiling interface.
double g_cpu_before_mpi_s = -1;

extern "C" int MPI_Init_thread(int* argc, char*** argv, int required, int* provided) {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  g_cpu_before_mpi_s = static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
                       static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
  return PMPI_Init_thread(argc, argv, required, provided);
}

namespace {

using Clock = std::chrono::steady_clock;
constexpr long long kReportAt = 200;     // the chief prints its control plane's median here
constexpr long long kCheckpointEvery = 50;

long long wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The ranks' trial: a tiny MLP; the chief times what the harness does between its batches.
class Tiny : public hpctrial::Trial {
 public:
  explicit Tiny(hpctrial::TrialContext& context) : context_(context) {
    torch::manual_seed(1);
    data_ = std::make_shared<hpctrial::TensorDataset>(torch::randn({4096, 8}), torch::randint(0, 4, {4096}));
    model_ = context.wrap_model(torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4)));
    optimizer_ = context.wrap_optimizer(std::make_shared<torch::optim::SGD>(model_->parameters(), 0.01));
  }
  hpctrial::Metrics train_batch(hpctrial::Batch& batch, std::int64_t, std::int64_t batch_idx) override {
    const long long start = wall_ns();
    if (last_end_ > 0) gaps_.push_back(static_cast<double>(start - last_end_));
    auto loss = torch::nn::functional::cross_entropy(model_->forward(batch.data), batch.target);
    context_.backward(loss);
    context_.step_optimizer(*optimizer_);
    const bool chief = context_.distributed().is_chief();
    if (batch_idx == 0 && chief) {
      std::printf("first step ended at %lld\ncpu before MPI_Init %.4f s\n", wall_ns(), g_cpu_before_mpi_s);
    }
    if (batch_idx == kReportAt && chief) {
      std::printf("control plane median %.0f ns\n", hpctrial::bench::median(gaps_));
    }
    std::fflush(stdout);
    last_end_ = wall_ns();
    return {{"loss", loss}};
  }
  hpctrial::Metrics evaluate_batch(hpctrial::Batch& batch) override {
    return {{"validation_loss", torch::nn::functional::cross_entropy(model_->forward(batch.data), batch.target)}};
  }
  hpctrial::DataLoader build_training_data_loader() override { return {data_, context_.per_slot_batch_size()}; }
  hpctrial::DataLoader build_validation_data_loader() override { return {data_, context_.per_slot_batch_size(), false}; }

 private:
  hpctrial::TrialContext& context_;
  std::shared_ptr<hpctrial::TensorDataset> data_;
  torch::nn::Sequential model_{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer_;
  long long last_end_ = 0;
  std::vector<double> gaps_;
};

struct Setup {
  std::vector<int> world_sizes = {1, 2, 4, 8, 16, 32};
  std::vector<int> records = {4096, 65536};
  int rounds = 3;
};

struct Costs {
  double launch_s = 0, control_us = 0, commit_s = 0, stop_s = 0, failure_s = 0;
  double launch_cpu_s = 0;  // the chief's CPU time before MPI_Init
  long long stop_steps = 0;
  // The same work without hpctrial: scale_plain under mpirun.
  double plain_launch_s = 0, plain_control_us = 0, plain_stop_s = 0, plain_failure_s = 0, plain_launch_cpu_s = 0;
  int world = 1;
};

// The launch less each rank's own work before MPI_Init, done N / C times over on C cores.
double launch_beyond_own_work(double launch_s, double cpu_s, int world) {
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  return launch_s - std::max(1.0, world / cores) * cpu_s;
}

class Run;
std::vector<Run*> g_runs;  // the runs alive, which a failure ends before it exits

[[noreturn]] void fail(const std::string& why, const std::string& output = "");

// A running `hpctrial run` (or mpirun of the peer), its output read as it comes.
class Run {
 public:
  Run(const std::vector<std::string>& argv, const hpctrial::core::SpawnOptions& options)
      : started_(wall_ns()), child_(hpctrial::core::spawn_process(argv, options)) {
    g_runs.push_back(this);
  }
  ~Run() {
    end();
    g_runs.erase(std::find(g_runs.begin(), g_runs.end(), this));
  }
  // A run left going: two Ctrl-C abort `hpctrial run` with its ranks, and mpirun ends its ranks on
  // SIGINT; SIGKILL to its process group if it is still there 10 s later.
  void end() {
    if (ended_) return;
    ::kill(child_.pid, SIGINT);
    ::kill(child_.pid, SIGINT);
    for (int i = 0; i < 1000 && !exited(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (!ended_) ::kill(-child_.pid, SIGKILL);
    if (!ended_) ::waitpid(child_.pid, nullptr, 0);
    ended_ = true;
  }
  void drain() {
    char buffer[4096];
    for (const int fd : {child_.out.get(), child_.err.get()}) {
      for (ssize_t n; (n = ::read(fd, buffer, sizeof buffer)) > 0;) output_.append(buffer, static_cast<std::size_t>(n));
    }
  }
  // Waits for `pattern` in the output; its first group.
  std::string wait_for(const std::string& pattern, int timeout_s) {
    const std::regex re(pattern);
    for (const auto deadline = Clock::now() + std::chrono::seconds(timeout_s); Clock::now() < deadline;) {
      drain();
      std::smatch m;
      if (std::regex_search(output_, m, re)) return m[1];
      if (exited()) fail("hpctrial run ended before printing /" + pattern + "/", output_);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    fail("no /" + pattern + "/ within " + std::to_string(timeout_s) + " s", output_);
  }
  bool exited() {
    if (!ended_ && ::waitpid(child_.pid, &status_, WNOHANG) == child_.pid) ended_ = true;
    return ended_;
  }
  int wait_exit(int timeout_s) {
    for (const auto deadline = Clock::now() + std::chrono::seconds(timeout_s); !exited();) {
      if (Clock::now() > deadline) fail("hpctrial run did not end within " + std::to_string(timeout_s) + " s", output_);
      drain();
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    drain();
    return WIFEXITED(status_) ? WEXITSTATUS(status_) : 128 + WTERMSIG(status_);
  }
  pid_t pid() const { return child_.pid; }
  long long started_ns() const { return started_; }
  const std::string& output() const { return output_; }

 private:
  long long started_;
  hpctrial::core::Child child_;
  std::string output_;
  bool ended_ = false;
  int status_ = 0;
};

// A worker's "cpu before MPI_Init" line: negative where the worker's MPI_Init was not timed.
double cpu_before_mpi(Run& run, const char* side) {
  const double cpu_s = std::stod(run.wait_for("cpu before MPI_Init (-?[0-9.]+) s", 600));
  if (cpu_s < 0) {
    fail(std::string(side) + "'s MPI_Init was not timed: the library did not call this program's MPI_Init_thread "
         "(is the program linked with its symbols exported, ENABLE_EXPORTS?)", run.output());
  }
  return cpu_s;
}

void fail(const std::string& why, const std::string& output) {
  std::fprintf(stderr, "scale: %s\n%s\n", why.c_str(), output.c_str());
  for (Run* run : std::vector<Run*>(g_runs)) run->end();
  std::exit(1);
}

hpctrial::core::SpawnOptions run_options() {
  hpctrial::core::SpawnOptions o;
  o.env_set = {{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT", "1"},
               {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}, {"OMPI_MCA_mpi_yield_when_idle", "1"},
               {"HPCTRIAL_LOG_LEVEL", "warning"}};
  return o;
}

bool oversubscribed(int world) { return static_cast<unsigned>(world) > std::max(1u, std::thread::hardware_concurrency()); }

std::vector<std::string> run_argv(const std::string& config, const std::string& experiment, int world) {
  std::vector<std::string> argv = {HPCTRIAL_CLI, "run", config, "--experiment", experiment};
  if (oversubscribed(world)) argv.push_back("--oversubscribe");
  return argv;
}

// The peer: mpirun of scale_plain, bound to no core as hpctrial's ranks are.
std::vector<std::string> plain_argv(int world) {
  std::vector<std::string> argv = {HPCTRIAL_MPIRUN, "-np", std::to_string(world), "--bind-to", "none"};
  if (oversubscribed(world)) argv.push_back("--oversubscribe");
  argv.push_back(HPCTRIAL_SCALE_PLAIN);
  return argv;
}

// The children of a process (its ranks, for mpirun on one host), whichever of its threads
// started them.
std::vector<pid_t> children_of(pid_t pid) {
  std::vector<pid_t> out;
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream in(task.path() / "children");
    for (pid_t child; in >> child;) out.push_back(child);
  }
  return out;
}

void measure_plain(int world, Costs& c) {
  {
    Run run(plain_argv(world), run_options());
    c.plain_launch_s = static_cast<double>(std::stoll(run.wait_for("first step ended at ([0-9]+)", 600)) - run.started_ns()) / 1e9;
    c.plain_launch_cpu_s = cpu_before_mpi(run, "scale_plain");
    c.plain_control_us = std::stod(run.wait_for("control plane median ([0-9.]+) ns", 600)) / 1e3;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const auto signalled = Clock::now();
    ::kill(run.pid(), SIGUSR2);  // mpirun forwards it to every rank
    if (const int code = run.wait_exit(300); code != 0) fail("scale_plain ended " + std::to_string(code) + " after SIGUSR2", run.output());
    c.plain_stop_s = seconds_since(signalled);
  }
  Run run(plain_argv(world), run_options());
  run.wait_for("control plane median ([0-9.]+) ns", 600);
  const auto ranks = children_of(run.pid());
  if (ranks.empty()) fail("mpirun of scale_plain has no child process to kill", run.output());
  const auto killed = Clock::now();
  ::kill(ranks.back(), SIGKILL);
  if (run.wait_exit(300) == 0) fail("scale_plain ended 0 after a rank was killed", run.output());
  c.plain_failure_s = seconds_since(killed);
}

// `restarts`: max_restarts; the failure's run has none, so that the launcher ends it.
std::string write_config(const std::filesystem::path& dir, const std::string& self, int world, int restarts) {
  const auto path = dir / ("scale-" + std::to_string(world) + "-" + std::to_string(restarts) + ".yaml");
  std::ofstream(path) << "name: scale\nentrypoint: [" << self << ", --worker]\n"
                      << "hyperparameters: {global_batch_size: " << 4 * world << "}\n"
                      << "searcher: {name: single, metric: validation_loss, max_length: {batches: 100000000}}\n"
                      << "resources: {slots_per_trial: " << world << ", cpus_per_slot: 1}\n"
                      << "min_validation_period: {batches: 100000000}\n"
                      << "min_checkpoint_period: {batches: " << kCheckpointEvery << "}\n"
                      << "checkpoint_storage: {save_trial_latest: 2}\n"
                      << "max_restarts: " << restarts << "\n"
                      << "reproducibility: {experiment_seed: 1}\n";
  return path.string();
}

// The chief's mean time of `phase` in seconds, from the timings its metrics file ends with.
double phase_mean_s(const hpctrial::core::TrialLayout& trial, const std::string& phase) {
  std::ifstream in(trial.dir + "/metrics.jsonl");
  double mean_ms = -1;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.value("kind", "") == "timings" && j.contains("timings") && j["timings"].contains(phase)) {
      mean_ms = j["timings"][phase].value("mean_ms", -1.0);
    }
  }
  if (mean_ms < 0) fail("no timings of " + phase + " in " + trial.dir + "/metrics.jsonl");
  return mean_ms / 1e3;
}

void wait_for_step(const hpctrial::core::TrialLayout& trial, Run& run, long long step) {
  for (const auto deadline = Clock::now() + std::chrono::seconds(600); hpctrial::bench::chief_step(trial) < step;) {
    if (Clock::now() > deadline) fail("the chief did not reach step " + std::to_string(step), run.output());
    if (run.exited()) fail("hpctrial run ended before step " + std::to_string(step), run.output());
    run.drain();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::string run_name(int world, int round) { return "run-" + std::to_string(world) + "-" + std::to_string(round); }

Costs measure(const std::filesystem::path& dir, const std::string& self, int world, int round) {
  Costs c;
  c.world = world;
  const std::string config = write_config(dir, self, world, 5);
  const std::string experiment = (dir / run_name(world, round)).string();
  const hpctrial::core::TrialLayout trial = hpctrial::core::ExperimentLayout{experiment}.trial(0);
  {
    Run run(run_argv(config, experiment, world), run_options());
    c.launch_s = static_cast<double>(std::stoll(run.wait_for("first step ended at ([0-9]+)", 600)) - run.started_ns()) / 1e9;
    c.launch_cpu_s = cpu_before_mpi(run, "hpctrial's worker");
    c.control_us = std::stod(run.wait_for("control plane median ([0-9.]+) ns", 600)) / 1e3;
    wait_for_step(trial, run, kReportAt + 10);
    const long long at_signal = hpctrial::bench::chief_step(trial);
    const auto signalled = Clock::now();
    ::kill(run.pid(), SIGUSR2);
    const int code = run.wait_exit(300);
    c.stop_s = seconds_since(signalled);
    if (code != hpctrial::core::kExitStopped) fail("hpctrial run ended " + std::to_string(code) + " after SIGUSR2", run.output());
    c.stop_steps = hpctrial::bench::newest_checkpoint(trial) - at_signal;
    c.commit_s = phase_mean_s(trial, "checkpoint_durable");
  }
  const std::string failing = (dir / ("fail-" + std::to_string(world) + "-" + std::to_string(round))).string();
  const hpctrial::core::TrialLayout failing_trial = hpctrial::core::ExperimentLayout{failing}.trial(0);
  Run run(run_argv(write_config(dir, self, world, 0), failing, world), run_options());
  wait_for_step(failing_trial, run, 20);
  int victim = 0;
  for (const auto& [rank, record] : hpctrial::core::read_heartbeats(failing_trial.heartbeat_dir())) {
    if (rank == world - 1) victim = record.pid;
  }
  if (victim <= 0) fail("no pid in rank " + std::to_string(world - 1) + "'s record", run.output());
  const auto killed = Clock::now();
  ::kill(victim, SIGKILL);
  const int code = run.wait_exit(300);
  c.failure_s = seconds_since(killed);
  if (code == 0 || code == hpctrial::core::kExitStopped) fail("a killed rank ended the run with " + std::to_string(code), run.output());
  measure_plain(world, c);
  return c;
}

// Each cost's median over the rounds.
Costs median_costs(const std::vector<Costs>& rounds) {
  auto of = [&](auto field) {
    std::vector<double> v;
    for (const Costs& c : rounds) v.push_back(static_cast<double>(c.*field));
    return hpctrial::bench::median(v);
  };
  Costs m;
  m.launch_s = of(&Costs::launch_s);
  m.control_us = of(&Costs::control_us);
  m.commit_s = of(&Costs::commit_s);
  m.stop_s = of(&Costs::stop_s);
  m.failure_s = of(&Costs::failure_s);
  m.stop_steps = static_cast<long long>(std::lround(of(&Costs::stop_steps)));
  m.plain_launch_s = of(&Costs::plain_launch_s);
  m.plain_control_us = of(&Costs::plain_control_us);
  m.plain_stop_s = of(&Costs::plain_stop_s);
  m.plain_failure_s = of(&Costs::plain_failure_s);
  m.launch_cpu_s = of(&Costs::launch_cpu_s);
  m.plain_launch_cpu_s = of(&Costs::plain_launch_cpu_s);
  m.world = rounds.front().world;
  return m;
}

// y = a + b f(N), least squares; the residual's sum of squares.
struct Fit {
  const char* name;
  double a = 0, b = 0, sse = 0;
  double at(double n) const;
};

double shape(const char* name, double n) {
  if (std::strcmp(name, "log N") == 0) return std::log2(n);
  if (std::strcmp(name, "N") == 0) return n;
  return 0;
}

double Fit::at(double n) const { return a + b * shape(name, n); }

Fit fit(const char* name, const std::vector<int>& ns, const std::vector<double>& ys) {
  Fit f{name};
  const double m = static_cast<double>(ns.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (std::size_t i = 0; i < ns.size(); ++i) {
    const double x = shape(name, ns[i]);
    sx += x, sy += ys[i], sxx += x * x, sxy += x * ys[i];
  }
  const double det = m * sxx - sx * sx;
  f.b = det > 1e-12 ? (m * sxy - sx * sy) / det : 0;
  f.b = std::max(0.0, f.b);  // a cost that falls with N is read as constant
  f.a = (sy - f.b * sx) / m;
  for (std::size_t i = 0; i < ns.size(); ++i) f.sse += std::pow(ys[i] - f.at(ns[i]), 2);
  return f;
}

// The simplest of constant, log N, N whose residual is within 20 % of the smallest (plus a
// floor of 1 % of the mean squared, so that noise does not pick a slope).
Fit best_fit(const std::vector<int>& ns, const std::vector<double>& ys) {
  std::vector<Fit> fits = {fit("constant", ns, ys), fit("log N", ns, ys), fit("N", ns, ys)};
  double mean = 0;
  for (const double y : ys) mean += y / static_cast<double>(ys.size());
  double smallest = std::numeric_limits<double>::max();
  for (const auto& f : fits) smallest = std::min(smallest, f.sse);
  const double floor = 0.0001 * mean * mean * static_cast<double>(ys.size());
  for (const auto& f : fits) {
    if (f.sse <= 1.2 * smallest + floor) return f;
  }
  return fits.back();
}

void print_costs(const Setup& s, const std::vector<Costs>& costs) {
  std::printf("median of %d round(s):\n", s.rounds);
  std::printf("%-6s %17s %19s %21s %12s %17s %7s %17s\n", "ranks", "launch (plain)", "cpu/rank (plain)",
              "control/step (plain)", "ckpt commit", "stop (plain)", "steps", "failure (plain)");
  for (std::size_t i = 0; i < costs.size(); ++i) {
    const Costs& c = costs[i];
    std::printf("%-6d %7.2fs (%6.2fs) %8.3fs (%7.3fs) %9.1fus (%7.1fus) %11.3fs %7.2fs (%6.2fs) %7lld %7.2fs (%6.2fs)\n",
                s.world_sizes[i], c.launch_s, c.plain_launch_s, c.launch_cpu_s, c.plain_launch_cpu_s, c.control_us,
                c.plain_control_us, c.commit_s, c.stop_s, c.plain_stop_s, c.stop_steps, c.failure_s, c.plain_failure_s);
  }
  std::printf("(cpu/rank: the chief's CPU time before MPI_Init; at scale each rank spends it on its own cores, here "
              "N ranks share them)\n");
  struct Row {
    const char* name;
    double (*get)(const Costs&);  // hpctrial's own: beyond the plain loop where it has a peer
    const char* unit;
    const char* goal;
  };
  const Row rows[] = {
      {"launch beyond each rank's own", [](const Costs& c) {
         return launch_beyond_own_work(c.launch_s, c.launch_cpu_s, c.world) -
                launch_beyond_own_work(c.plain_launch_s, c.plain_launch_cpu_s, c.world);
       }, "s", "<= 10 s at 4096"},
      {"each rank's own before MPI", [](const Costs& c) { return c.launch_cpu_s - c.plain_launch_cpu_s; }, "s",
       "constant"},
      {"launch as measured here", [](const Costs& c) { return c.launch_s - c.plain_launch_s; }, "s",
       "(N ranks on C cores)"},
      {"control plane a step", [](const Costs& c) { return c.control_us - c.plain_control_us; }, "us",
       "constant or log N"},
      {"checkpoint commit", [](const Costs& c) { return c.commit_s; }, "s", "<= 10 s at 4096"},
      {"stop after SIGUSR2", [](const Costs& c) { return c.stop_s - c.plain_stop_s; }, "s", "<= 10 s at 4096"},
      {"failure to every rank ended", [](const Costs& c) { return c.failure_s - c.plain_failure_s; }, "s",
       "(measured)"},
  };
  std::printf("\nhpctrial's own cost (beyond the plain loop's, where it has one), fitted (least squares; the simplest "
              "within 20 %% of the best residual) and extrapolated to 4096 ranks:\n");
  for (const Row& row : rows) {
    std::vector<double> ys;
    for (const Costs& c : costs) ys.push_back(row.get(c));
    const Fit f = best_fit(s.world_sizes, ys);
    std::printf("  %-30s grows as %-8s (a %.4g, b %.4g %s): %.4g %s at 4096   goal: %s\n", row.name, f.name, f.a, f.b,
                row.unit, f.at(4096), row.unit, row.goal);
  }
}

// Heartbeat records of `ranks` ranks, one file each, as the ranks write them; the last one failed.
void write_records(const std::string& dir, int ranks) {
  std::filesystem::create_directories(dir);
  char page[hpctrial::core::kHeartbeatSize];
  for (int rank = 0; rank < ranks; ++rank) {
    hpctrial::core::heartbeat_init(page, 1000 + rank % 7, hpctrial::core::RankPhase::kBatch, 100000 + rank,
                                   "node" + std::to_string(rank / 64));
    if (rank == ranks - 1) {
      hpctrial::core::RankEnd end;
      end.kind = hpctrial::core::RankEnd::Kind::kSignal;
      end.code = SIGKILL;
      end.unix_ms = 1;
      hpctrial::core::heartbeat_put_end(page, end);
    }
    std::ofstream(hpctrial::core::TrialLayout::heartbeat_file(dir, rank), std::ios::binary).write(page, sizeof page);
  }
}

void simulated_records(const Setup& s, const std::filesystem::path& dir) {
  // An experiment that `describe` reads: the 1-rank run's, its trial's records replaced.
  const std::string experiment = (dir / run_name(s.world_sizes.front(), 0)).string();
  const hpctrial::core::TrialLayout trial = hpctrial::core::ExperimentLayout{experiment}.trial(0);
  std::printf("\nper-rank records, simulated (no processes), median of 3:\n%-8s %18s %12s\n", "ranks", "read_heartbeats",
              "describe");
  for (const int ranks : s.records) {
    std::filesystem::remove_all(trial.heartbeat_dir());
    write_records(trial.heartbeat_dir(), ranks);
    std::vector<double> reads, describes;
    for (int round = 0; round < 3; ++round) {
      auto t = Clock::now();
      const auto records = hpctrial::core::read_heartbeats(trial.heartbeat_dir());
      reads.push_back(seconds_since(t));
      if (static_cast<int>(records.size()) != ranks) fail("read " + std::to_string(records.size()) + " records of " + std::to_string(ranks));
      t = Clock::now();
      hpctrial::core::RunOptions options;
      options.timeout = std::chrono::minutes(5);
      const auto r = hpctrial::core::run_process({HPCTRIAL_CLI, "describe", experiment}, options);
      describes.push_back(seconds_since(t));
      if (!r.ok()) fail("hpctrial describe failed: " + r.describe(), r.out + r.err);
    }
    std::printf("%-8d %17.3fs %11.3fs   goal: <= 1 s at 65536\n", ranks, hpctrial::bench::median(reads),
                hpctrial::bench::median(describes));
    std::fflush(stdout);
  }
}

Setup parse(int argc, char** argv) {
  Setup s;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      s.world_sizes = {1, 2, 4};
      s.records = {4096};
      s.rounds = 1;
    } else if (arg == "--rounds" && i + 1 < argc) {
      s.rounds = std::atoi(argv[++i]);
    } else if (arg == "--world-sizes" && i + 1 < argc) {
      s.world_sizes = hpctrial::bench::parse_int_list(argv[++i]);
    } else if (arg == "--records" && i + 1 < argc) {
      s.records = hpctrial::bench::parse_int_list(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--world-sizes 1,2,4,8,16,32] [--records 4096,65536] [--rounds 3]\n", argv[0]);
      std::exit(2);
    }
  }
  if (s.world_sizes.size() < 2) fail("--world-sizes needs two sizes at least, to fit");
  if (s.rounds < 1) fail("--rounds needs a positive number");
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--worker") == 0) {
    argv[1] = argv[0];
    return hpctrial::trainer::run_main(argc - 1, argv + 1, [](hpctrial::TrialContext& context) {
      return std::unique_ptr<hpctrial::Trial>(std::make_unique<Tiny>(context));
    });
  }
  const Setup s = parse(argc, argv);
  const std::string self = std::filesystem::canonical("/proc/self/exe").string();
  const auto dir = std::filesystem::temp_directory_path() / ("hpctrial-scale-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::printf("scale: hpctrial's own costs by world size (MLP 8-16-4, batch 4 a rank, %u cores, ranks beyond them "
              "oversubscribed, mpi_yield_when_idle)\n", std::max(1u, std::thread::hardware_concurrency()));
  std::fflush(stdout);
  // Round after round over every size, so that a slow minute of a shared machine lands in one
  // round of several sizes rather than in every round of one.
  std::vector<std::vector<Costs>> measured(s.world_sizes.size());
  for (int round = 0; round < s.rounds; ++round) {
    for (std::size_t i = 0; i < s.world_sizes.size(); ++i) {
      measured[i].push_back(measure(dir, self, s.world_sizes[i], round));
      std::fprintf(stderr, "scale: round %d, %d rank(s) measured\n", round + 1, s.world_sizes[i]);
    }
  }
  std::vector<Costs> costs;
  for (const auto& rounds : measured) costs.push_back(median_costs(rounds));
  print_costs(s, costs);
  simulated_records(s, dir);
  std::filesystem::remove_all(dir);
  return 0;
}
