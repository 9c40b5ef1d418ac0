// engine: what ZeRO stages 1 to 3 save and cost against stage 0, on the same engine trial,
// model, data and optimizer (Adam), in one run:
//   - optimizer state held per rank: stage 1's and 2's against stage 0's divided by the ranks
//     (goal <= 1.05);
//   - step time: stage 1's and 2's against stage 0's (goal <= 1.10);
//   - parameters, gradients and optimizer state held per rank at stage 3 against stage 0's
//     divided by the ranks (goal <= 1.05), with the working set it gathers for a global batch
//     (printed), and its step time against stage 2's (goal <= 1.25); the same model built as
//     layers (context.layered_module) at stage 3, gathered one layer at a time in forward and
//     again in backward (stage3_max_reuse_distance 0): what it holds and its step time against
//     stage 2's, without prefetch (stage3_prefetch_bucket_size 0) and with DeepSpeed's default
//     (5e7 elements: the next layers' all-gathers overlap the current layer's compute); and with
//     DeepSpeed's defaults for both, which keep each layer gathered from its forward to its
//     backward in a model this small (goal <= 1.25 with prefetch);
//   - step time with engine.bf16 (bfloat16 autocast) against float32, at stage 0 (a figure, no
//     goal: it depends on whether the CPU has bfloat16 arithmetic);
//   - stage 3 with offload_optimizer on nvme (a swap file a rank under --dir, sub-groups of a
//     quarter of the parameters): the optimizer state held in memory between steps (goal: 0),
//     and the step time against stage 3's in memory (a figure: it is the disk's speed); and with
//     offload_param on nvme too: the parameters held in memory between steps (goal: 0) and the
//     step time against stage 3's in memory.
//
//   mpirun -np N build/benchmarks/engine [--quick] [--steps N] [--rounds N] [--hidden N]
//                                        [--bucket ELEMENTS] [--dir DIR]
//
// Each run trains a fresh trial directory for --steps global batches of 64 records a rank and
// must train exactly that many; the step rate is the inverse of the median time of the trial's
// train_batch in the run (the slowest rank's), so that a burst of other load on a shared machine
// moves no figure, in rounds that rotate which stage goes first, the median round's rate taken.
// ZeRO's reduce_bucket_size is --bucket (default: a quarter of the parameters, so that stage 2's
// reduce-scatters overlap backward). --quick: 2 rounds of 30 steps with a small model, the test
// suite's smoke run.
#include <dlfcn.h>
#include <mpi.h>
#include <torch/torch.h>

#include <hpctrial/trainer.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/mpi_environment.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/trainer/training_loop.h"

namespace {

struct Options {
  std::int64_t steps = 300;
  int rounds = 3;
  std::int64_t hidden = 1024;
  std::int64_t features = 256;
  std::int64_t bucket = 0;  // 0: a quarter of the parameters
  std::string dir = "/tmp/hpctrial-bench-engine";
};

struct NetImpl : torch::nn::Module {
  NetImpl(std::int64_t features, std::int64_t hidden)
      : a(register_module("a", torch::nn::Linear(features, hidden))),
        b(register_module("b", torch::nn::Linear(hidden, hidden))),
        c(register_module("c", torch::nn::Linear(hidden, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::log_softmax(c->forward(torch::relu(b->forward(torch::relu(a->forward(x))))), 1);
  }
  torch::nn::Linear a, b, c;
};
TORCH_MODULE(Net);

// Of the last run's engine, on this rank: optimizer state, the parameters held between steps,
// the gradients held after a backward, and the parameters held during one.
std::int64_t g_state_elements = 0, g_parameter_elements = 0, g_gradient_elements = 0, g_working_elements = 0;
// Each train_batch's seconds in the last run, on this rank.
std::vector<double> g_step_seconds;

// A linear layer that tells `seen` when it runs: the parameters held then are the working set.
struct SeenLinearImpl : torch::nn::Module {
  SeenLinearImpl(std::int64_t in, std::int64_t out, std::function<void()> seen)
      : linear(register_module("linear", torch::nn::Linear(in, out))), seen(std::move(seen)) {}
  torch::Tensor forward(const torch::Tensor& x) {
    seen();
    return linear->forward(x);
  }
  torch::nn::Linear linear;
  std::function<void()> seen;
};
TORCH_MODULE(SeenLinear);

class BenchTrial : public hpctrial::EngineTrial {
 public:
  explicit BenchTrial(hpctrial::EngineTrialContext& context) : context_(context) {
    const std::int64_t features = context.hparam<std::int64_t>("features");
    torch::manual_seed(1);
    auto x = torch::randn({4096, features});
    auto y = torch::randint(0, 10, {4096});
    data_ = std::make_shared<hpctrial::TensorDataset>(x, y);
    validation_ = std::make_shared<hpctrial::TensorDataset>(x.slice(0, 0, 64), y.slice(0, 0, 64));
    const std::int64_t hidden = context.hparam<std::int64_t>("hidden");
    std::shared_ptr<torch::nn::Module> model;
    if (context.hparam<bool>("layered")) {
      const auto relu = [](const torch::Tensor& x) { return torch::relu(x); };
      const std::function<void()> seen = [this] {
        if (engine_) g_working_elements = std::max(g_working_elements, engine_->parameter_elements());
      };
      layers_ = context.layered_module(
          {hpctrial::LayerSpec::of<SeenLinear>(features, hidden, seen), hpctrial::LayerSpec::function("relu", relu),
           hpctrial::LayerSpec::of<SeenLinear>(hidden, hidden, seen), hpctrial::LayerSpec::function("relu", relu),
           hpctrial::LayerSpec::of<SeenLinear>(hidden, std::int64_t{10}, seen),
           hpctrial::LayerSpec::function("log_softmax", [](const torch::Tensor& x) { return torch::log_softmax(x, 1); })},
          [](const torch::Tensor& out, const torch::Tensor& target) { return torch::nll_loss(out, target); });
      model = layers_.ptr();
    } else {
      model_ = Net(features, hidden);
      model = model_.ptr();
    }
    auto optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-4));
    engine_ = context.wrap_model_engine(std::make_shared<hpctrial::ModelEngine>(model, optimizer));
  }
  ~BenchTrial() override { g_state_elements = engine_->optimizer_state_elements(); }

  hpctrial::Metrics train_batch(hpctrial::DataIterator& data, std::int64_t, std::int64_t) override {
    const auto started = std::chrono::steady_clock::now();
    struct Timed {
      std::chrono::steady_clock::time_point started;
      ~Timed() { g_step_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()); }
    } timed{started};
    hpctrial::Batch batch = data.next();
    auto loss = torch::nll_loss(forward(batch.data), batch.target);
    g_working_elements = std::max(g_working_elements, engine_->parameter_elements());
    engine_->backward(loss);
    g_gradient_elements = std::max(g_gradient_elements, engine_->gradient_elements());
    engine_->step();
    g_parameter_elements = std::max(g_parameter_elements, engine_->parameter_elements());
    return {{"loss", loss}};
  }
  hpctrial::Metrics evaluate_batch(hpctrial::DataIterator& data, std::int64_t) override {
    hpctrial::Batch batch = data.next();
    return {{"validation_loss", torch::nll_loss(forward(batch.data), batch.target)}};
  }
  hpctrial::DataLoader build_training_data_loader() override {
    return {data_, context_.train_micro_batch_size_per_gpu()};
  }
  hpctrial::DataLoader build_validation_data_loader() override { return {validation_, 64, false}; }

 private:
  torch::Tensor forward(const torch::Tensor& x) { return layers_ ? layers_->forward(x) : model_->forward(x); }

  hpctrial::EngineTrialContext& context_;
  std::shared_ptr<hpctrial::TensorDataset> data_, validation_;
  Net model_{nullptr};
  hpctrial::PipelineModule layers_{nullptr};
  std::shared_ptr<hpctrial::ModelEngine> engine_;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "engine: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--quick") {
      o.steps = 30;
      o.rounds = 2;
      o.hidden = 256;
      o.features = 64;
    } else if (arg == "--steps") {
      o.steps = std::stoll(value());
    } else if (arg == "--rounds") {
      o.rounds = std::stoi(value());
    } else if (arg == "--hidden") {
      o.hidden = std::stoll(value());
    } else if (arg == "--bucket") {
      o.bucket = std::stoll(value());
    } else if (arg == "--dir") {
      o.dir = value();
    } else {
      std::fprintf(stderr,
                   "usage: mpirun -np N engine [--quick] [--steps N] [--rounds N] [--hidden N] [--bucket ELEMENTS] "
                   "[--dir DIR]\n");
      std::exit(2);
    }
  }
  return o;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

struct Measure {
  double steps_per_s = 0;
  // The most any rank holds: optimizer state, parameters between steps, gradients, parameters
  // during a global batch.
  std::int64_t state_elements = 0, parameter_elements = 0, gradient_elements = 0, working_elements = 0;
  std::int64_t held() const { return state_elements + parameter_elements + gradient_elements; }
};

std::int64_t parameters(const Options& o) {
  return o.features * o.hidden + o.hidden + o.hidden * o.hidden + o.hidden + o.hidden * 10 + 10;
}

// Runs 0 to 3: ZeRO stages 0 to 3 in float32; run 4: stage 0 with bf16; run 5: stage 3 with the
// model as layers; run 6: stage 3 with the optimizer state swapped to files; run 7: with the
// parameters' parts too; run 8: stage 3 with the model as layers, prefetched; run 9: with
// DeepSpeed's defaults for the layers (prefetch and reuse distance).
constexpr int kRuns = 10;
constexpr int kBf16 = 4;
constexpr int kLayered = 5;
constexpr int kNvme = 6;
constexpr int kParam = 7;
constexpr int kPrefetch = 8;
constexpr int kDefaults = 9;

Measure run_stage(const Options& o, int run, hpctrial::comm::MpiCommunicator& comm, int round) {
  const int stage = run == kBf16 ? 0 : run >= kLayered ? 3 : run;
  const bool layered = run == kLayered || run == kPrefetch || run == kDefaults;
  const bool bf16 = run == kBf16;
  g_state_elements = g_parameter_elements = g_gradient_elements = g_working_elements = 0;
  g_step_seconds.clear();
  const int ranks = comm.size();
  const std::string trial_dir = o.dir + "/run" + std::to_string(run) + "-round" + std::to_string(round);
  if (comm.is_chief()) std::filesystem::remove_all(trial_dir);  // a fresh trial: no resume
  comm.barrier();
  std::string offload;
  if (run == kNvme || run == kParam) {
    std::filesystem::create_directories(o.dir + "/nvme");
    offload = ", sub_group_size: " + std::to_string(parameters(o) / 4) + ", offload_optimizer: {device: nvme, nvme_path: " +
              o.dir + "/nvme}";
    if (run == kParam) offload += ", offload_param: {device: nvme, nvme_path: " + o.dir + "/nvme}";
  }
  const std::string yaml =
      "name: engine-bench\nentrypoint: ./engine\nsearcher: {name: single, metric: validation_loss, max_length: "
      "{batches: " + std::to_string(o.steps) + "}}\nhyperparameters: {global_batch_size: " + std::to_string(64 * ranks) +
      ", hidden: " + std::to_string(o.hidden) + ", features: " + std::to_string(o.features) +
      ", layered: " + (layered ? "true" : "false") +
      "}\nengine: {zero_optimization: {stage: " + std::to_string(stage) + ", reduce_bucket_size: " +
      std::to_string(o.bucket > 0 ? o.bucket : parameters(o) / 4) + ", stage3_param_persistence_threshold: 0" + offload +
      (run == kLayered ? ", stage3_prefetch_bucket_size: 0" : "") +
      (run == kLayered || run == kPrefetch ? ", stage3_max_reuse_distance: 0" : "") + "}, bf16: {enabled: " + (bf16 ? "true" : "false") +
      "}}\nscheduling_unit: 1000000\n";
  hpctrial::core::Diagnostics d;
  const auto config = hpctrial::core::parse_experiment_config(hpctrial::core::parse_config_text(yaml, "bench", d), d);
  if (!d.empty()) {
    std::fprintf(stderr, "%s\n", d.to_string().c_str());
    std::exit(1);
  }
  hpctrial::trainer::LoopOptions loop;
  loop.trial_dir = trial_dir;
  loop.progress_interval_s = 0;
  loop.distributed = {comm.rank(), ranks, comm.rank(), ranks, 1};
  const auto result = hpctrial::trainer::run_training(
      config, [](hpctrial::TrialContext& c) { return hpctrial::trainer::make_engine_trial<BenchTrial>(c); }, comm,
      loop);
  if (result.batches_trained != o.steps) {
    std::fprintf(stderr, "engine: run %d trained %lld steps, not %lld\n", run,
                 static_cast<long long>(result.batches_trained), static_cast<long long>(o.steps));
    std::exit(1);
  }
  double step_s = median(g_step_seconds);
  comm.allreduce(&step_s, 1, hpctrial::comm::DType::kFloat64, hpctrial::comm::ReduceOp::kMax);
  std::int64_t elements[4] = {g_state_elements, g_parameter_elements, g_gradient_elements, g_working_elements};
  comm.allreduce(elements, 4, hpctrial::comm::DType::kInt64, hpctrial::comm::ReduceOp::kMax);
  if (comm.is_chief()) std::filesystem::remove_all(trial_dir);
  return {1.0 / step_s, elements[0], elements[1], elements[2], elements[3]};
}

}  // namespace

int main(int argc, char** argv) {
  hpctrial::comm::MpiEnvironment environment(&argc, &argv);
  const Options o = parse(argc, argv);
  hpctrial::core::set_log_level(hpctrial::core::LogLevel::kWarning);
  // One thread per rank for LibTorch and OpenBLAS, as a trial program does with the default
  // resources.cpus_per_slot: ranks that each start a BLAS thread per core fight over the cores,
  // and the step rates of the stages then vary by tens of percent from run to run.
  torch::set_num_threads(1);
  using SetThreads = void (*)(int);
  if (auto set = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) set(1);
  hpctrial::comm::MpiCommunicator comm(environment.world());
  const int ranks = comm.size();
  std::vector<double> rate[kRuns];
  Measure held[kRuns];
  for (int round = 0; round < o.rounds; ++round) {
    for (int k = 0; k < kRuns; ++k) {
      const int run = (round + k) % kRuns;  // rotate which run goes first
      const Measure m = run_stage(o, run, comm, round);
      rate[run].push_back(m.steps_per_s);
      held[run] = m;
    }
  }
  if (comm.is_chief()) {
    const double r0 = median(rate[0]);
    std::printf("ranks %d, %lld parameters, Adam, %lld records a rank a step, buckets of %lld elements\n", ranks,
                static_cast<long long>(parameters(o)), 64LL,
                static_cast<long long>(o.bucket > 0 ? o.bucket : parameters(o) / 4));
    std::printf("hpctrial trained %lld steps in each of %d runs per stage\n", static_cast<long long>(o.steps), o.rounds);
    std::printf("elements per rank: optimizer state, parameters between steps, gradients after a backward, "
                "parameters during a global batch\n");
    std::printf("stage  steps/s  state elements per rank  parameters  gradients  working set\n");
    const auto row = [&](const char* name, int run) {
      const Measure& m = held[run];
      std::printf("%s %10.2f %12lld %12lld %12lld %12lld\n", name, median(rate[run]),
                  static_cast<long long>(m.state_elements), static_cast<long long>(m.parameter_elements),
                  static_cast<long long>(m.gradient_elements), static_cast<long long>(m.working_elements));
    };
    for (const char* name : {"0", "1", "2", "3"}) row(name, name[0] - '0');
    row("0+bf16", kBf16);
    row("3+layers", kLayered);
    row("3+nvme", kNvme);
    row("3+nvme+param", kParam);
    row("3+layers+prefetch", kPrefetch);
    row("3+layers+defaults", kDefaults);
    for (int stage = 1; stage < 3; ++stage) {
      std::printf("state per rank, stage %d / (stage 0 / ranks): %.4f (goal <= 1.05)\n", stage,
                  static_cast<double>(held[stage].state_elements) / (static_cast<double>(held[0].state_elements) / ranks));
      std::printf("step time, stage %d / stage 0: %.4f (goal <= 1.10)\n", stage, r0 / median(rate[stage]));
    }
    std::printf("held per rank, stage 3 / (stage 0 / ranks): %.4f (goal <= 1.05; parameters, gradients and "
                "optimizer state; plus a working set of %lld elements gathered for a global batch)\n",
                static_cast<double>(held[3].held()) / (static_cast<double>(held[0].held()) / ranks),
                static_cast<long long>(held[3].working_elements - held[3].parameter_elements));
    std::printf("step time, stage 3 / stage 2: %.4f (goal <= 1.25)\n", median(rate[2]) / median(rate[3]));
    std::printf("held per rank, stage 3 as layers / (stage 0 / ranks): %.4f (plus a working set of %lld elements, "
                "one layer)\n",
                static_cast<double>(held[kLayered].held()) / (static_cast<double>(held[0].held()) / ranks),
                static_cast<long long>(held[kLayered].working_elements - held[kLayered].parameter_elements));
    std::printf("step time, stage 3 as layers / stage 2: %.4f (each layer gathered in forward and in backward, "
                "without prefetch)\n",
                median(rate[2]) / median(rate[kLayered]));
    std::printf("step time, stage 3 as layers prefetched / stage 2: %.4f (goal <= 1.25; a working set of %lld "
                "elements)\n",
                median(rate[2]) / median(rate[kPrefetch]),
                static_cast<long long>(held[kPrefetch].working_elements - held[kPrefetch].parameter_elements));
    std::printf("step time, stage 3 as layers with DeepSpeed's prefetch and reuse defaults / stage 2: %.4f (goal <= "
                "1.25; a working set of %lld elements)\n",
                median(rate[2]) / median(rate[kDefaults]),
                static_cast<long long>(held[kDefaults].working_elements - held[kDefaults].parameter_elements));
    std::printf("step time, bf16 / float32 (stage 0): %.4f\n", r0 / median(rate[kBf16]));
    std::printf("optimizer state in memory between steps, stage 3 with offload_optimizer nvme: %lld elements (goal 0; "
                "%lld at stage 3 in memory)\n",
                static_cast<long long>(held[kNvme].state_elements), static_cast<long long>(held[3].state_elements));
    std::printf("step time, stage 3 with the state on nvme / stage 3 in memory: %.4f (the disk's read and write of "
                "the state every step)\n",
                median(rate[3]) / median(rate[kNvme]));
    std::printf("parameters in memory between steps, stage 3 with offload_param nvme too: %lld elements (goal 0; "
                "%lld at stage 3 in memory)\n",
                static_cast<long long>(held[kParam].parameter_elements), static_cast<long long>(held[3].parameter_elements));
    std::printf("step time, stage 3 with the state and the parameters on nvme / stage 3 in memory: %.4f\n",
                median(rate[3]) / median(rate[kParam]));
  }
  return 0;
}
