// harness_overhead: what training through hpctrial costs compared with a plain hand-written
// LibTorch loop - same model, same data, same batch size, same optimizer, in one run.
//
// Each side trains `steps` batches; the rate is measured over the steady state (after
// `warmup` batches), in rounds that alternate which side goes first, so that both sides see the
// same machine noise and neither always inherits the other's state.
// The figure of merit is hpctrial's steps/s divided by the plain loop's (goal: >= 0.99), from
// each side's typical rate: the window is cut into chunks of 100 steps (each holds one of the
// harness's per-100-step reductions and one of the plain loop's loss reads), and a side's typical
// rate is 100 steps over its median chunk. A burst of the host taking the cores away (a shared
// virtual machine) slows the few chunks it lands in and moves the whole-window rate of that side
// alone; it barely moves the median. Both are printed. Also printed: the CPU time per step of
// every thread of each side - on a virtual machine the time the host takes the cores away is not
// in it, so when it moves with the rates, the machine's speed moved, not the harness's.
// Then the same comparison interleaved: in each of `rounds` hpctrial runs, the plain loop trains
// a chunk of 100 steps at the start of each of hpctrial's chunks, in the same process; the ratio
// of each pair of chunks, next to each other in time, is free of the drift of a shared machine's
// speed over seconds, which moves whole runs (and so the separate rounds' ratios) by 10-30 %.
//
//   harness_overhead [--quick] [--stream] [--steps N] [--warmup N] [--rounds N] [--hidden N]
//                    [--prefetch N] [--blas-threads N] [--only plain|hpctrial]
//                    [--with profiler|system-metrics] [--instructions]
//   mpirun -np N harness_overhead --chief-hooks [--validation-period N] [--quick] [--steps N] [--rounds N] ...
//
// --stream: hpctrial reads the same samples from a StreamDataset (one sample at a time, a
// permutation per pass, stacked by collate) instead of a TensorDataset.
//
// --quick: 200 steps (rate over 149 of them), one round - the test suite's smoke run; with
// --instructions, 25 steps (count over 14; valgrind's start of LibTorch takes most of its time).
// Every hpctrial run trains a fresh trial directory and must train exactly --steps batches;
// a side that trains a different number, or a rate that is not a positive number, ends the
// benchmark with exit 1 rather than print a figure.
//
// Both sides compute with --blas-threads OpenBLAS threads (default 1, what an hpctrial rank
// with resources.cpus_per_slot: 1 uses).
//
// --only runs one side once and prints its rate.
//
// --instructions counts what each side executes per step, which is deterministic where wall
// time on a shared machine is not: it runs `--only plain` and `--only hpctrial` under
// `valgrind --tool=callgrind --instr-atstart=no`; each side turns instrumentation on at the start
// of step `warmup` and off at the start of the last step, so the count covers the same
// steps - every thread's instructions in them, the batch reader's included - and nothing of
// start-up or shutdown. Goal: hpctrial within 1 % of the plain loop.
//
// --with profiler|system-metrics compares hpctrial with itself instead: without the feature
// against with it - a profiler window over the first batches of the warm-up (so outside the
// measured steps), or system metrics every second. Goal: >= 0.99 (what the feature costs,
// measured where it is configured but not recording, or sampling at a far shorter period than
// its default).
//
// --chief-hooks, on any number of ranks: what giving every rank the state that hooks running on
// the chief alone change costs when they change nothing (docs/trial-api.md, "State changed on
// the chief"). hpctrial validates every --validation-period batches (default 100, the default
// reporting period) - a validation, like a checkpoint, is where such hooks run - and the phase
// `chief_hook_changes` of its timings (the chief reading every optimizer's options and
// scheduler's step count before and after, the one 8-byte broadcast that tells the other ranks
// nothing follows, and a rank's wait in it) is set against the same run's time, on the rank
// where it took longest. The figure of merit is the share of the run left to everything else,
// 1 - sharing / run (goal: >= 0.999, a tenth of the rates' run-to-run noise here): timed
// directly, it is not lost in that noise as a ratio of two rates would be. The cost per sharing
// is printed too: it does not depend on the period.
#include <ATen/CPUGeneratorImpl.h>
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#else
#define CALLGRIND_START_INSTRUMENTATION
#define CALLGRIND_STOP_INSTRUMENTATION
#endif
#include <torch/torch.h>

#include <hpctrial/trainer.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <future>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/mpi_environment.h"
#include "hpctrial/trainer/training_loop.h"
#include "io_util.h"
#include "observe/system_metrics.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Setup {
  std::int64_t samples = 16384;
  std::int64_t features = 128;
  std::int64_t hidden = 256;
  std::int64_t classes = 10;
  std::int64_t batch = 64;
  std::int64_t steps = 3000;
  std::int64_t warmup = 300;
  int rounds = 9;
  std::int64_t prefetch = 2;
  std::int64_t blas_threads = 1;  // hpctrial's default per rank (resources.cpus_per_slot: 1)
  std::string only;  // "plain" or "hpctrial": run one side once (for instruction counting)
  bool stream = false;  // hpctrial reads a StreamDataset
  std::string with;     // "profiler" or "system-metrics": hpctrial without it against hpctrial with it
  bool instructions = false;  // count instructions per step under callgrind
  bool chief_hooks = false;   // time the sharing of chief-only hooks' changes (on MPI's ranks)
  std::int64_t validation_period = 100;  // with chief_hooks: batches between validations
};

// The measured window: [start of step `warmup`, start of step `steps - 1`), on both sides, in
// chunks of kChunk steps from its start. Under callgrind, instrumentation is on exactly there
// (outside valgrind these are a few no-op instructions).
// Also the CPU time of every thread of the process in the window (the reader's included): on a
// virtual machine it leaves out the time the host takes the cores away, which wall time counts.
constexpr std::int64_t kChunk = 100;
double process_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}
std::int64_t window_steps(const Setup& s) { return s.steps - 1 - s.warmup; }
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// What one side's run measured in its window.
struct Measured {
  double rate = 0;     // steps/s over the whole window
  double typical = 0;  // kChunk steps over the median chunk's time (the rate if no chunk is whole)
  double cpu_us = 0;   // CPU time per step, every thread
};

struct Window {
  Clock::time_point start, chunk_start;
  double cpu_start = 0;
  std::vector<double> chunks;  // seconds of each whole chunk
  Measured measured;           // set at the window's end
};
Window window;  // of the run being measured (one at a time)

// At the start of each step of either side.
void window_step(const Setup& s, std::int64_t step) {
  if (step < s.warmup || step > s.steps - 1) return;
  if (step == s.warmup) {
    CALLGRIND_START_INSTRUMENTATION;
    window = Window{};
    window.cpu_start = process_cpu_seconds();
    window.start = window.chunk_start = Clock::now();
    return;
  }
  const bool chunk_ends = (step - s.warmup) % kChunk == 0;
  if (!chunk_ends && step != s.steps - 1) return;
  const auto now = Clock::now();
  if (chunk_ends) {
    window.chunks.push_back(seconds(now - window.chunk_start));
    window.chunk_start = now;
  }
  if (step == s.steps - 1) {
    const auto steps = static_cast<double>(window_steps(s));
    Measured& m = window.measured;
    m.cpu_us = (process_cpu_seconds() - window.cpu_start) * 1e6 / steps;
    m.rate = steps / seconds(now - window.start);
    m.typical = window.chunks.empty() ? m.rate : kChunk / hpctrial::bench::median(window.chunks);
    CALLGRIND_STOP_INSTRUMENTATION;
  }
}

struct NetImpl : torch::nn::Module {
  NetImpl(std::int64_t in, std::int64_t hidden, std::int64_t out)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        fc3(register_module("fc3", torch::nn::Linear(hidden, out))) {}
  torch::Tensor forward(torch::Tensor x) {
    return torch::log_softmax(fc3->forward(torch::relu(fc2->forward(torch::relu(fc1->forward(x))))), 1);
  }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Net);

struct Data {
  torch::Tensor x, y;
};

Data make_data(const Setup& s) {
  torch::manual_seed(0);
  return {torch::randn({s.samples, s.features}), torch::randint(0, s.classes, {s.samples})};
}

Net seeded_net(const Setup& s) {
  torch::manual_seed(1);
  return Net(s.features, s.hidden, s.classes);
}

// The plain loop a LibTorch user writes: shuffle each epoch, slice, step.
class PlainLoop {
 public:
  PlainLoop(const Setup& s, const Data& data)
      : s_(s), data_(data), net_(seeded_net(s)),
        optimizer_(net_->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)) {}
  void step(std::int64_t step) {
    const std::int64_t offset = (step * s_.batch) % s_.samples;
    if (offset == 0 || !order_.defined()) order_ = torch::randperm(s_.samples);
    const auto index = order_.slice(0, offset, std::min(offset + s_.batch, s_.samples));
    const auto x = data_.x.index_select(0, index);
    const auto y = data_.y.index_select(0, index);
    auto loss = torch::nll_loss(net_->forward(x), y);
    optimizer_.zero_grad();
    loss.backward();
    optimizer_.step();
    running_ += loss.detach();
    if ((step + 1) % 100 == 0) {
      volatile double reported = running_.item<double>() / 100;  // what the user would print
      (void)reported;
      running_.zero_();
    }
  }

 private:
  const Setup& s_;
  const Data& data_;
  Net net_;
  torch::optim::SGD optimizer_;
  torch::Tensor order_;
  torch::Tensor running_ = torch::zeros({});
};

Measured plain_steps_per_second(const Setup& s, const Data& data) {
  PlainLoop loop(s, data);
  for (std::int64_t step = 0; step < s.steps; ++step) {
    window_step(s, step);
    loop.step(step);
  }
  return window.measured;
}

// The interleaved comparison: hpctrial trains, and at the start of each of its chunks the plain
// loop trains a chunk of its own, so each pair of chunks is measured next to each other in time
// and in one process; a drift of the machine's speed over seconds, which moves whole runs, moves
// both chunks of a pair alike. The plain loop warms up as hpctrial did before its first chunk.
class Interleave {
 public:
  Interleave(const Setup& s, const Data& data) : s_(s), plain_(s, data) {}
  // At the start of hpctrial's batch `b`.
  void at_batch(std::int64_t b) {
    if (b < s_.warmup || (b - s_.warmup) % kChunk != 0) return;
    if (b > s_.warmup) hpctrial_s_.push_back(seconds(Clock::now() - hpctrial_start_));
    if (b + kChunk > s_.steps - 1) return;  // no whole hpctrial chunk follows
    if (b == s_.warmup) {
      while (plain_step_ < s_.warmup) plain_.step(plain_step_++);
    }
    const auto start = Clock::now();
    for (std::int64_t i = 0; i < kChunk; ++i) plain_.step(plain_step_++);
    plain_s_.push_back(seconds(Clock::now() - start));
    hpctrial_start_ = Clock::now();
  }
  // hpctrial's rate over the plain loop's, of each pair.
  std::vector<double> ratios() const {
    std::vector<double> r;
    for (std::size_t i = 0; i < std::min(plain_s_.size(), hpctrial_s_.size()); ++i) r.push_back(plain_s_[i] / hpctrial_s_[i]);
    return r;
  }

 private:
  const Setup& s_;
  PlainLoop plain_;
  std::int64_t plain_step_ = 0;
  Clock::time_point hpctrial_start_;
  std::vector<double> plain_s_, hpctrial_s_;
};

// The rows of (x, y), one at a time, in a permutation per pass: what a stream reader hands out.
class RowStream : public hpctrial::StreamDataset {
 public:
  explicit RowStream(const Data& data) : data_(data) {}
  void start(std::int64_t pass) override {
    order_ = torch::randperm(data_.x.size(0), at::detail::createCPUGenerator(static_cast<std::uint64_t>(pass)));
    order_data_ = order_.data_ptr<std::int64_t>();
    next_ = 0;
  }
  std::optional<hpctrial::Batch> next() override {
    if (next_ == order_.size(0)) return std::nullopt;
    const std::int64_t row = order_data_[next_++];
    return hpctrial::Batch(data_.x[row], data_.y[row]);
  }

 private:
  Data data_;
  torch::Tensor order_;
  const std::int64_t* order_data_ = nullptr;
  std::int64_t next_ = 0;
};

class BenchTrial : public hpctrial::Trial {
 public:
  BenchTrial(hpctrial::TrialContext& context, const Setup& s, const Data& data, std::int64_t* batches,
             Interleave* interleave)
      : context_(context), setup_(s), batches_(batches), interleave_(interleave) {
    dataset_ = std::make_shared<hpctrial::TensorDataset>(data.x, data.y);
    if (s.stream) stream_ = std::make_shared<RowStream>(data);
    torch::manual_seed(1);
    net_ = context.wrap_model(Net(s.features, s.hidden, s.classes));
    optimizer_ = context.wrap_optimizer(std::make_shared<torch::optim::SGD>(
        net_->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)));
  }
  hpctrial::Metrics train_batch(hpctrial::Batch& batch, std::int64_t, std::int64_t batch_idx) override {
    if (interleave_ != nullptr) interleave_->at_batch(batch_idx);
    window_step(setup_, batch_idx);
    ++*batches_;
    auto loss = torch::nll_loss(net_->forward(batch.data), batch.target);
    context_.backward(loss);
    context_.step_optimizer(*optimizer_);
    return {{"loss", loss}};
  }
  hpctrial::Metrics evaluate_batch(hpctrial::Batch& batch) override {
    return {{"validation_loss", torch::nll_loss(net_->forward(batch.data), batch.target)}};
  }
  hpctrial::DataLoader build_training_data_loader() override {
    if (stream_) return {stream_, context_.per_slot_batch_size()};
    return {dataset_, context_.per_slot_batch_size()};
  }
  hpctrial::DataLoader build_validation_data_loader() override {
    auto small = std::make_shared<hpctrial::TensorDataset>(
        dataset_->get_batch({0, 1, 2, 3}).data, dataset_->get_batch({0, 1, 2, 3}).target);
    return {small, context_.per_slot_batch_size(), false};
  }

 private:
  hpctrial::TrialContext& context_;
  Setup setup_;
  std::int64_t* batches_;
  Interleave* interleave_;
  std::shared_ptr<hpctrial::TensorDataset> dataset_;
  std::shared_ptr<RowStream> stream_;
  Net net_{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer_;
};

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "harness_overhead: %s\n", message.c_str());
  std::exit(1);
}

Measured checked(const Measured& m, const char* side) {
  for (const double rate : {m.rate, m.typical}) {
    if (!std::isfinite(rate) || rate <= 0) fail(std::string("the ") + side + " side measured no rate (" + std::to_string(rate) + ")");
  }
  return m;
}

// One hpctrial run in a trial directory of its own under `scratch` (a used directory would
// resume its finished trial and train nothing).
// `profiling`: the config's profiling section (by default none: no system metrics either).
// With `interleave`, the plain loop's chunks run between hpctrial's (see Interleave).
// With `ranks`, every rank of it runs the trial (`scratch` the chief's), `extra` is added to the
// config, and `result` receives the loop's.
Measured hpctrial_steps_per_second(const Setup& s, const Data& data, const std::string& scratch,
                                 const std::string& profiling = "{system_metrics_period: 0s}",
                                 Interleave* interleave = nullptr, hpctrial::comm::Communicator* ranks = nullptr,
                                 const std::string& extra = "", hpctrial::trainer::LoopResult* result = nullptr) {
  static int runs = 0;
  const std::string trial_dir = scratch + "/run-" + std::to_string(++runs);
  hpctrial::core::Diagnostics d;
  const std::string yaml = "name: harness-overhead\nentrypoint: ./bench\nsearcher: {name: single, metric: "
                           "validation_loss, max_length: {batches: " + std::to_string(s.steps) +
                           "}}\nhyperparameters: {global_batch_size: " + std::to_string(s.batch) + "}\n" +
                           "records_per_epoch: " + std::to_string(s.samples) + "\nprofiling: " + profiling + "\n" +
                           // The plain loop never checkpoints; nor does this side before the end,
                           // also where valgrind makes a run outlast auto's first checkpoint.
                           "min_checkpoint_period: none\n" + extra;
  const auto config = hpctrial::core::parse_experiment_config(hpctrial::core::parse_config_text(yaml, "bench", d), d);
  d.throw_if_any();
  hpctrial::comm::LocalCommunicator local;
  hpctrial::comm::Communicator& comm = ranks != nullptr ? *ranks : local;
  hpctrial::trainer::LoopOptions options;
  options.trial_dir = trial_dir;
  options.experiment_seed = 1;
  options.progress_interval_s = 0;
  options.prefetch_depth = static_cast<std::size_t>(s.prefetch);
  options.distributed = {comm.rank(), comm.size(), comm.rank(), comm.size(), 1};
  std::int64_t batches = 0;
  window = Window{};
  auto loop = hpctrial::trainer::run_training(config, [&](hpctrial::TrialContext& context) {
    return std::unique_ptr<hpctrial::Trial>(std::make_unique<BenchTrial>(context, s, data, &batches, interleave));
  }, comm, options);
  if (result != nullptr) *result = std::move(loop);
  comm.barrier();  // every rank is done with the trial directory
  std::error_code ignored;
  if (comm.is_chief()) std::filesystem::remove_all(trial_dir, ignored);
  if (batches != s.steps) {
    fail("the hpctrial side trained " + std::to_string(batches) + " batches, not " + std::to_string(s.steps));
  }
  return checked(window.measured, "hpctrial");
}

using hpctrial::bench::median;

// hpctrial without and with a feature, in alternating rounds.
int compare_with(const Setup& s, const Data& data, const std::string& scratch) {
  const std::int64_t window = std::max<std::int64_t>(1, s.warmup / 2);
  const std::string with = s.with == "profiler"
                               ? "{enabled: true, begin_on_batch: 1, end_after_batch: " + std::to_string(window) +
                                     ", system_metrics_period: 0s}"
                               : std::string("{system_metrics_period: 1s}");
  std::printf("harness_overhead --with %s: MLP %ld-%ld-%ld-%ld, batch %ld, %ld steps (rate over the last %ld), "
              "%d alternating rounds; with: profiling: %s\n",
              s.with.c_str(), static_cast<long>(s.features), static_cast<long>(s.hidden), static_cast<long>(s.hidden),
              static_cast<long>(s.classes), static_cast<long>(s.batch), static_cast<long>(s.steps),
              static_cast<long>(window_steps(s)), s.rounds, with.c_str());
  std::vector<double> without_rates, with_rates, ratios, whole_ratios;
  for (int round = 0; round < s.rounds; ++round) {
    Measured a, b;
    if (round % 2 == 0) {
      a = hpctrial_steps_per_second(s, data, scratch);
      b = hpctrial_steps_per_second(s, data, scratch, with);
    } else {
      b = hpctrial_steps_per_second(s, data, scratch, with);
      a = hpctrial_steps_per_second(s, data, scratch);
    }
    without_rates.push_back(a.typical);
    with_rates.push_back(b.typical);
    ratios.push_back(b.typical / a.typical);
    whole_ratios.push_back(b.rate / a.rate);
    std::printf("  round %d: typical: without %8.1f steps/s   with %8.1f steps/s   ratio %.4f   (whole window: %.4f)\n",
                round + 1, a.typical, b.typical, b.typical / a.typical, b.rate / a.rate);
  }
  if (s.with == "system-metrics") {
    // What one sample costs the rank that takes it, beside the rates' noise.
    hpctrial::trainer::detail::SystemMonitor monitor;
    constexpr int kSamples = 1000;
    const auto start = Clock::now();
    for (int i = 0; i < kSamples; ++i) monitor.sample();
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count() / kSamples;
    std::printf("one sample of the system metrics takes %.1f us: %.4f %% of each second at a 1 s period\n", us,
                us / 1e4);
  }
  std::printf("hpctrial trained %ld steps in each of %d run(s)\n", static_cast<long>(s.steps), 2 * s.rounds);
  std::printf("median: typical rate without %.1f steps/s, with %s %.1f steps/s, ratio %.4f (median of per-round "
              "ratios; goal >= 0.99); whole-window ratio %.4f\n",
              median(without_rates), s.with.c_str(), median(with_rates), median(ratios), median(whole_ratios));
  std::error_code ignored;
  std::filesystem::remove_all(scratch, ignored);
  return 0;
}

// What sharing the chief-only hooks' changes costs, on every rank of `comm` (see --chief-hooks).
int measure_chief_hooks(const Setup& s, const Data& data, std::string scratch, hpctrial::comm::Communicator& comm) {
  const std::int64_t period = s.validation_period;
  comm.broadcast(scratch, 0);  // the chief's: one trial directory for every rank
  if (comm.is_chief()) {
    std::printf("harness_overhead --chief-hooks: MLP %ld-%ld-%ld-%ld, global batch %ld, %d rank(s), %ld steps, a "
                "validation every %ld, %d round(s)\n",
                static_cast<long>(s.features), static_cast<long>(s.hidden), static_cast<long>(s.hidden),
                static_cast<long>(s.classes), static_cast<long>(s.batch), comm.size(), static_cast<long>(s.steps),
                static_cast<long>(period), s.rounds);
  }
  std::vector<double> per_call_us, shares, rates;
  std::int64_t calls = 0;
  for (int round = 0; round < s.rounds; ++round) {
    hpctrial::trainer::LoopResult result;
    const auto start = Clock::now();
    const Measured m = hpctrial_steps_per_second(
        s, data, scratch, "{system_metrics_period: 0s}", nullptr, &comm,
        "min_validation_period: {batches: " + std::to_string(period) + "}\n", &result);
    double run_s = seconds(Clock::now() - start);
    const auto phase = result.timings.find("chief_hook_changes");
    if (phase == result.timings.end()) fail("the run's timings have no chief_hook_changes phase: " + result.timings.dump());
    double sharing_s = phase->at("total_s").get<double>();
    calls = phase->at("count").get<std::int64_t>();
    const double chiefs_s = sharing_s;  // on the chief: its reading and the broadcast's start
    // The rank where sharing took longest (a rank waiting in the broadcast counts it), and its run.
    double both[2] = {sharing_s, run_s};
    comm.allreduce(both, 2, hpctrial::comm::DType::kFloat64, hpctrial::comm::ReduceOp::kMax);
    sharing_s = both[0];
    run_s = both[1];
    if (calls < s.steps / period) {
      fail("the chief's hooks were wrapped " + std::to_string(calls) + " times in " + std::to_string(s.steps) +
           " steps, fewer than the validations");
    }
    per_call_us.push_back(sharing_s * 1e6 / static_cast<double>(calls));
    shares.push_back(1 - sharing_s / run_s);
    rates.push_back(m.typical);
    if (comm.is_chief()) {
      std::printf("  round %d: %ld sharings, %.1f us each (the chief's own: %.1f us), %.1f us of a %.3f s run: share "
                  "left %.6f   (%.1f steps/s)\n",
                  round + 1, static_cast<long>(calls), per_call_us.back(), chiefs_s * 1e6 / static_cast<double>(calls),
                  sharing_s * 1e6, run_s, shares.back(), m.typical);
    }
  }
  if (comm.is_chief()) {
    std::printf("hpctrial trained %ld steps in each of %d run(s)\n", static_cast<long>(s.steps), s.rounds);
    std::printf("chief-hook sharing: %.1f us per sharing, %ld per run (median); run time left to everything else: "
                "ratio %.6f (median; goal >= 0.999)\n", median(per_call_us), static_cast<long>(calls), median(shares));
    std::error_code ignored;
    std::filesystem::remove_all(scratch, ignored);
  }
  return 0;
}

// Valgrind stopped at an instruction it cannot emulate: no count on this machine, and no fault of
// the program measured.
struct ValgrindCannotRun : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Instructions per step of one side, counted by callgrind in a child process (see --instructions).
double instructions_per_step(const Setup& s, const std::string& side, const std::string& scratch) {
  std::error_code error;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", error).string();
  if (error) fail("cannot find this program's own path: " + error.message());
  const std::string out = scratch + "/callgrind." + side;
  std::vector<std::string> argv = {"valgrind", "--tool=callgrind", "--instr-atstart=no",
                                   "--callgrind-out-file=" + out, self, "--only", side,
                                   "--steps", std::to_string(s.steps), "--warmup", std::to_string(s.warmup),
                                   "--hidden", std::to_string(s.hidden), "--prefetch", std::to_string(s.prefetch),
                                   "--blas-threads", std::to_string(s.blas_threads)};
  if (s.stream) argv.push_back("--stream");
  hpctrial::core::RunResult result;
  try {
    result = hpctrial::core::run_process(argv);
  } catch (const std::exception& e) {
    fail(std::string(e.what()) + " (--instructions needs valgrind: scripts/install-deps.sh installs it)");
  }
  if (!result.ok() && result.err.find("Unrecognised instruction") != std::string::npos) {
    // Not this program's fault: a library it loads (libhwy, through libtorch) executes an
    // instruction (RDTSCP) that this CPU runs but does not advertise, and valgrind emulates only
    // what the CPU advertises. Exit 77: the test suite counts the run as skipped.
    throw ValgrindCannotRun("harness_overhead: valgrind cannot run the " + side + " side on this CPU: it stops at an "
                            "instruction a library executes and this CPU does not advertise; no instruction counts "
                            "here\n" + result.err);
  }
  if (!result.ok()) fail("the " + side + " side under callgrind failed: " + result.describe() + "\n" + result.err);
  std::ifstream in(out);
  double totals = -1;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("totals: ", 0) == 0) totals = std::stod(line.substr(8));
  }
  if (totals <= 0) {
    fail("callgrind's output " + out + " counts no instructions: this program was built without "
         "<valgrind/callgrind.h>, so it cannot turn counting on (run scripts/install-deps.sh, then rebuild)");
  }
  return totals / static_cast<double>(window_steps(s));
}

int compare_instructions(const Setup& s, const std::string& scratch) {
  std::printf("harness_overhead --instructions: MLP %ld-%ld-%ld-%ld, batch %ld, instructions of steps %ld to %ld "
              "(every thread's) counted by callgrind\n",
              static_cast<long>(s.features), static_cast<long>(s.hidden), static_cast<long>(s.hidden),
              static_cast<long>(s.classes), static_cast<long>(s.batch), static_cast<long>(s.warmup),
              static_cast<long>(s.steps - 2));
  // Both sides at once, each in its own valgrind: instruction counts do not depend on what else
  // runs, and valgrind's start-up with LibTorch is most of either's time.
  // Both are awaited before either's outcome is acted on: no exit while the other side's thread runs.
  auto plain_count = std::async(std::launch::async, [&] { return instructions_per_step(s, "plain", scratch); });
  double harness = 0, plain = 0;
  std::string cannot_run;
  try {
    harness = instructions_per_step(s, "hpctrial", scratch);
  } catch (const ValgrindCannotRun& e) {
    cannot_run = e.what();
  }
  try {
    plain = plain_count.get();
  } catch (const ValgrindCannotRun& e) {
    if (cannot_run.empty()) cannot_run = e.what();
  }
  if (!cannot_run.empty()) {
    std::fprintf(stderr, "%s", cannot_run.c_str());
    std::error_code ignored;
    std::filesystem::remove_all(scratch, ignored);
    return 77;  // the test suite counts the run as skipped
  }
  std::printf("instructions per step: plain %.0f, hpctrial %.0f, hpctrial - plain %+.0f, ratio %.4f "
              "(goal <= 1.01)\n", plain, harness, harness - plain, harness / plain);
  std::error_code ignored;
  std::filesystem::remove_all(scratch, ignored);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Setup s;
  bool quick = false, steps_given = false;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--quick") {
      quick = true;
      --i;
      continue;
    }
    if (flag == "--instructions") {
      s.instructions = true;
      --i;
      continue;
    }
    if (flag == "--stream") {
      s.stream = true;
      --i;
      continue;
    }
    if (flag == "--chief-hooks") {
      s.chief_hooks = true;
      --i;
      continue;
    }
    if (flag == "--only") {
      s.only = argv[i + 1];
      continue;
    }
    if (flag == "--with" && i + 1 < argc) {
      s.with = argv[i + 1];
      if (s.with != "profiler" && s.with != "system-metrics") fail("--with takes profiler or system-metrics");
      continue;
    }
    if (i + 1 >= argc) fail(flag + " needs a value");
    const std::int64_t value = std::stoll(argv[i + 1]);
    if (flag == "--steps") s.steps = value, steps_given = true;
    else if (flag == "--warmup") s.warmup = value, steps_given = true;
    else if (flag == "--rounds") s.rounds = static_cast<int>(value);
    else if (flag == "--hidden") s.hidden = value;
    else if (flag == "--prefetch") s.prefetch = value;
    else if (flag == "--blas-threads") s.blas_threads = value;
    else if (flag == "--validation-period" && value > 0) s.validation_period = value;
    else {
      std::fprintf(stderr, "usage: %s [--quick] [--stream] [--steps N] [--warmup N] [--rounds N] [--hidden N] [--prefetch N] [--blas-threads N] [--only plain|hpctrial] [--with profiler|system-metrics] [--instructions] [--chief-hooks [--validation-period N]]\n", argv[0]);
      return 2;
    }
  }
  // Under callgrind a step takes about half a second: the instruction count covers fewer steps.
  if (!steps_given && (quick || s.instructions)) {
    s.steps = s.instructions ? (quick ? 25 : 300) : 200;
    s.warmup = s.instructions ? (quick ? 10 : 100) : 50;
  }
  if (quick) s.rounds = 1;
  if (s.warmup < 1 || window_steps(s) < 1) fail("--steps must exceed --warmup + 1, and --warmup be at least 1");
  hpctrial::core::set_log_level(hpctrial::core::LogLevel::kWarning);
  hpctrial::bench::set_openblas_threads(static_cast<int>(s.blas_threads));
  const Data data = make_data(s);
  // A fresh scratch directory per run, so that no run resumes another's trial.
  // mkdtemp replaces the trailing six characters of the pattern; $TMPDIR is honoured.
  std::error_code no_tmp;
  const std::filesystem::path tmp = std::filesystem::temp_directory_path(no_tmp);
  if (no_tmp) {
    const char* env = std::getenv("TMPDIR");
    std::fprintf(stderr, "harness_overhead: TMPDIR (%s) is not a directory: %s; set TMPDIR to a writable directory\n",
                 env != nullptr ? env : "unset", no_tmp.message().c_str());
    return 1;
  }
  std::string scratch = (tmp / "hpctrial-bench-XXXXXX").string();  // mkdtemp fills in the Xs
  if (::mkdtemp(scratch.data()) == nullptr) {
    std::fprintf(stderr, "harness_overhead: cannot create a scratch directory %s: %s (set TMPDIR to a writable "
                 "directory)\n", scratch.c_str(), std::strerror(errno));
    return 1;
  }

  if (s.chief_hooks) {
    hpctrial::comm::MpiEnvironment environment(&argc, &argv);
    hpctrial::comm::MpiCommunicator comm(environment.world());
    if (!comm.is_chief()) std::filesystem::remove(scratch, no_tmp);  // the chief's is used
    return measure_chief_hooks(s, data, scratch, comm);
  }
  if (!s.only.empty()) {
    const Measured m = s.only == "plain" ? checked(plain_steps_per_second(s, data), "plain")
                                         : hpctrial_steps_per_second(s, data, scratch);
    std::printf("%s: %.1f steps/s (typical %.1f)\n", s.only.c_str(), m.rate, m.typical);
    std::error_code ignored;
    std::filesystem::remove_all(scratch, ignored);
    return 0;
  }
  if (!s.with.empty()) return compare_with(s, data, scratch);
  if (s.instructions) return compare_instructions(s, scratch);
  std::printf("harness_overhead: MLP %ld-%ld-%ld-%ld, batch %ld, %ld steps (rate over the last %ld), "
              "%d alternating rounds, %ld BLAS thread(s), prefetch depth %ld, hpctrial reads a %s\n",
              static_cast<long>(s.features), static_cast<long>(s.hidden), static_cast<long>(s.hidden),
              static_cast<long>(s.classes), static_cast<long>(s.batch), static_cast<long>(s.steps),
              static_cast<long>(window_steps(s)), s.rounds, static_cast<long>(s.blas_threads),
              static_cast<long>(s.prefetch), s.stream ? "StreamDataset" : "TensorDataset");
  std::vector<double> plain, harness, ratios, whole_ratios, plain_cpu, harness_cpu, cpu_ratios;
  for (int round = 0; round < s.rounds; ++round) {
    // Alternate which side goes first, so neither always inherits the other's state.
    Measured p, h;
    const auto run_plain = [&] { p = checked(plain_steps_per_second(s, data), "plain"); };
    const auto run_hpctrial = [&] { h = hpctrial_steps_per_second(s, data, scratch); };
    if (round % 2 == 0) {
      run_plain();
      run_hpctrial();
    } else {
      run_hpctrial();
      run_plain();
    }
    plain.push_back(p.typical);
    harness.push_back(h.typical);
    ratios.push_back(h.typical / p.typical);
    whole_ratios.push_back(h.rate / p.rate);
    plain_cpu.push_back(p.cpu_us);
    harness_cpu.push_back(h.cpu_us);
    cpu_ratios.push_back(p.cpu_us / h.cpu_us);
    std::printf("  round %d: typical: plain %8.1f steps/s   hpctrial %8.1f steps/s   ratio %.4f   (whole window: %.4f)   "
                "CPU per step: plain %.1f us, hpctrial %.1f us\n",
                round + 1, p.typical, h.typical, h.typical / p.typical, h.rate / p.rate, p.cpu_us, h.cpu_us);
  }
  std::printf("hpctrial trained %ld steps in each of %d run(s)\n", static_cast<long>(s.steps), s.rounds);
  std::printf("median: typical rate plain %.1f steps/s, hpctrial %.1f steps/s, ratio %.4f (median of per-round "
              "ratios; goal >= 0.99); whole-window ratio %.4f\n",
              median(plain), median(harness), median(ratios), median(whole_ratios));
  std::printf("CPU time per step (every thread): plain %.1f us, hpctrial %.1f us, plain / hpctrial %.4f (median of "
              "per-round ratios)\n", median(plain_cpu), median(harness_cpu), median(cpu_ratios));
  // The same comparison with the two sides' chunks alternating in one run.
  std::vector<double> pairs;
  for (int round = 0; round < s.rounds; ++round) {
    Interleave interleave(s, data);
    hpctrial_steps_per_second(s, data, scratch, "{system_metrics_period: 0s}", &interleave);
    const auto ratios_of_run = interleave.ratios();
    if (ratios_of_run.empty()) fail("the interleaved run measured no pair of chunks");
    std::printf("  interleaved run %d: %zu pairs of %ld-step chunks, median ratio %.4f\n", round + 1,
                ratios_of_run.size(), static_cast<long>(kChunk), median(ratios_of_run));
    pairs.insert(pairs.end(), ratios_of_run.begin(), ratios_of_run.end());
  }
  std::printf("interleaved: ratio %.4f (median of %zu pairs of chunks, the plain loop's and hpctrial's next to each "
              "other in time, in %d runs; goal >= 0.99)\n", median(pairs), pairs.size(), s.rounds);
  std::error_code ignored;
  std::filesystem::remove_all(scratch, ignored);
  return 0;
}
