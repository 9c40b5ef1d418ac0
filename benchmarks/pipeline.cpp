// pipeline: a model cut into as many stages as there are ranks, trained with the 1F1B schedule:
// its step time against the 1F1B ideal, the bubble, the state each rank holds and the activations
// it keeps, all measured in one run. Two models:
//   equal layers     `--layers` blocks of one linear map and tanh, cut uniformly;
//   unequal layers   a GPT-like shape: an input projection of 4 x hidden features (the
//                    embedding), `--layers` blocks, a LayerNorm and an output projection to 4 x
//                    hidden (the head) - compute in proportion to parameters - cut twice: by
//                    `parameters` (DeepSpeed's partition_balanced) and by `uniform` (layer counts).
//
//   mpirun -np 2 pipeline [--quick] [--layers 8] [--hidden 1024] [--micro-batches 8]
//                         [--micro-batch 64] [--steps 20]
//   mpirun -np 4 pipeline
//
// --quick: hidden 64, 4 micro-batches of 8, 3 timed steps - the test suite's smoke run.
// Each rank is one stage (one BLAS thread), Adam over its layers. Two steps warm up; the rest are
// timed. A stage's forward + backward time per micro-batch is measured inside those same steps
// (its own work, never its waits for a neighbour), and the 1F1B ideal of a step is the slowest
// stage's x (micro-batches + stages - 1): what a pipeline whose messages cost nothing would take.
// Goals: ideal / step time >= 0.9 (for the unequal model, cut by parameters); parameters +
// optimizer state per rank / the whole model's <= 1 / stages + 0.1 (equal layers); at most
// `stages` micro-batches in flight on any stage (GPipe: all of them).
#include <mpi.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/mpi_environment.h"
#include "hpctrial/trainer/pipeline.h"
#include "parallel/pipeline_runner.h"

namespace {

using Clock = std::chrono::steady_clock;
using hpctrial::trainer::LayerSpec;
using hpctrial::trainer::PipelineModule;
using hpctrial::trainer::PipelineOptions;

struct Options {
  int layers = 8;
  std::int64_t hidden = 1024;
  std::int64_t micro_batches = 8;
  std::int64_t micro_batch = 64;
  int steps = 20;
  int warmup = 2;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> long {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return std::stol(argv[++i]);
    };
    if (arg == "--quick") {
      o.hidden = 64;
      o.micro_batches = 4;
      o.micro_batch = 8;
      o.steps = 3;
    } else if (arg == "--layers") {
      o.layers = static_cast<int>(value());
    } else if (arg == "--hidden") {
      o.hidden = value();
    } else if (arg == "--micro-batches") {
      o.micro_batches = value();
    } else if (arg == "--micro-batch") {
      o.micro_batch = value();
    } else if (arg == "--steps") {
      o.steps = static_cast<int>(value());
    } else {
      std::fprintf(stderr,
                   "usage: mpirun -np N %s [--quick] [--layers 8] [--hidden 1024] [--micro-batches 8] "
                   "[--micro-batch 64] [--steps 20]\n",
                   argv[0]);
      std::exit(2);
    }
  }
  return o;
}

// One of the equal layers: a linear map and tanh.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(std::int64_t hidden) : linear(register_module("linear", torch::nn::Linear(hidden, hidden))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(linear->forward(x)); }
  torch::nn::Linear linear;
};
TORCH_MODULE(Block);

// What each stage measured, gathered on rank 0 (one row of doubles a stage).
enum Figure { kStepSeconds, kComputeSeconds, kStateElements, kFirstLayer, kPeakInFlight, kFigures };

// A model: its layers, and the widths of its input and output.
struct Model {
  std::vector<LayerSpec> layers;
  std::int64_t in = 0, out = 0;
};

Model equal_layers(const Options& o) {
  Model m{{}, o.hidden, o.hidden};
  for (int i = 0; i < o.layers; ++i) {
    m.layers.emplace_back("block", [hidden = o.hidden] { return torch::nn::AnyModule(Block(hidden)); });
  }
  return m;
}

Model unequal_layers(const Options& o) {
  const std::int64_t h = o.hidden, wide = 4 * o.hidden;
  Model m{{}, wide, wide};
  m.layers.emplace_back("embedding", [h, wide] { return torch::nn::AnyModule(torch::nn::Linear(wide, h)); });
  for (int i = 0; i < o.layers; ++i) m.layers.emplace_back("block", [h] { return torch::nn::AnyModule(Block(h)); });
  m.layers.emplace_back("layer_norm", [h] {
    return torch::nn::AnyModule(torch::nn::LayerNorm(torch::nn::LayerNormOptions({h})));
  });
  m.layers.emplace_back("head", [h, wide] { return torch::nn::AnyModule(torch::nn::Linear(h, wide)); });
  return m;
}

std::vector<double> run_stage(const Options& o, const Model& model, const std::string& partition,
                              hpctrial::comm::Communicator& pipe) {
  const std::vector<LayerSpec>& layers = model.layers;
  PipelineOptions options;
  options.stages = pipe.size();
  options.partition_method = partition;
  options.seed = 7;
  PipelineModule stage(layers, [](const torch::Tensor& y, const torch::Tensor& t) { return torch::mse_loss(y, t); },
                       pipe.rank(), options);
  torch::optim::Adam optimizer(stage->parameters(), torch::optim::AdamOptions(1e-3));
  hpctrial::trainer::detail::PipelineRunner runner(*stage, pipe);
  const auto inputs = torch::randn({o.micro_batches * o.micro_batch, model.in}).chunk(o.micro_batches);
  const auto targets = torch::zeros({o.micro_batches * o.micro_batch, model.out}).chunk(o.micro_batches);
  const std::vector<torch::Tensor> none;
  std::vector<double> figures(kFigures, 0.0);
  for (int step = 0; step < o.warmup + o.steps; ++step) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto start = Clock::now();
    runner.train(stage->is_first_stage() ? inputs : none, stage->is_last_stage() ? targets : none, o.micro_batches);
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    optimizer.step();
    optimizer.zero_grad();
    if (step < o.warmup) continue;
    figures[kStepSeconds] += seconds / o.steps;
    figures[kComputeSeconds] += runner.compute_seconds() / o.steps;
    figures[kPeakInFlight] = std::max(figures[kPeakInFlight], static_cast<double>(runner.peak_in_flight()));
  }
  // Parameters and Adam's two moments.
  double elements = 0;
  for (const auto& parameter : stage->parameters()) elements += static_cast<double>(parameter.numel());
  figures[kStateElements] = 3 * elements;
  figures[kFirstLayer] = static_cast<double>(stage->first_layer());
  return figures;
}

// One run's table and figures; `goal` marks the ratio a goal applies to.
void report(const Options& o, const std::string& title, int layers, int stages, const std::vector<double>& all,
            bool ratio_goal, bool state_goal) {
  auto at = [&](int stage, Figure figure) { return all[static_cast<std::size_t>(stage * kFigures + figure)]; };
  const double micro = static_cast<double>(o.micro_batches);
  double step = 0, slowest = 0, mean = 0, bubble = 0, state = 0, whole = 0, peak = 0;
  for (int s = 0; s < stages; ++s) whole += at(s, kStateElements);
  std::printf("\npipeline of %s (hidden %lld), %d stages, %lld micro-batches of %lld, %d timed steps\n", title.c_str(),
              static_cast<long long>(o.hidden), stages, static_cast<long long>(o.micro_batches),
              static_cast<long long>(o.micro_batch), o.steps);
  std::printf("stage  layers  fwd+bwd per micro-batch  busy share  state / whole  peak in flight\n");
  for (int s = 0; s < stages; ++s) {
    const double per_micro = at(s, kComputeSeconds) / micro;
    const double share = at(s, kComputeSeconds) / at(s, kStepSeconds);
    const int first = static_cast<int>(at(s, kFirstLayer));
    const int end = s + 1 < stages ? static_cast<int>(at(s + 1, kFirstLayer)) : layers;
    step = std::max(step, at(s, kStepSeconds));
    slowest = std::max(slowest, per_micro);
    mean += per_micro / stages;
    bubble += (1 - share) / stages;
    state = std::max(state, at(s, kStateElements) / whole);
    peak = std::max(peak, at(s, kPeakInFlight));
    std::printf("%-5d  %2d-%-3d  %20.3f ms  %10.3f  %13.3f  %14.0f\n", s, first, end - 1, 1e3 * per_micro, share,
                at(s, kStateElements) / whole, at(s, kPeakInFlight));
  }
  const double ideal = slowest * (micro + stages - 1);
  std::printf("step time %.3f ms, 1F1B ideal %.3f ms (%.3f ms x (%lld + %d - 1))\n", 1e3 * step, 1e3 * ideal,
              1e3 * slowest, static_cast<long long>(o.micro_batches), stages);
  std::printf("ideal / step time: %.3f%s\n", ideal / step, ratio_goal ? " (goal >= 0.9)" : "");
  std::printf("bubble: %.3f, 1F1B's (S - 1) / (M + S - 1): %.3f; slowest stage / mean stage: %.3f\n", bubble,
              (stages - 1) / (micro + stages - 1), slowest / mean);
  if (state_goal) {
    std::printf("state per rank / whole model: %.3f (goal <= 1 / %d + 0.1 = %.3f)\n", state, stages,
                1.0 / stages + 0.1);
  }
  std::printf("peak micro-batches in flight: %.0f (1F1B: at most %d; GPipe: %lld)\n", peak,
              std::min<int>(stages, static_cast<int>(o.micro_batches)), static_cast<long long>(o.micro_batches));
  const unsigned cores = std::thread::hardware_concurrency();
  if (cores != 0 && static_cast<unsigned>(stages) > cores) {
    std::printf("note: %d stages share %u cores, so each stage's time includes its neighbours' use of them; the "
                "ratio says how well the schedule hides its waits, not the speed-up\n",
                stages, cores);
  }
}

}  // namespace

int main(int argc, char** argv) {
  hpctrial::comm::MpiEnvironment environment(&argc, &argv);
  const Options o = parse(argc, argv);
  torch::set_num_threads(1);
  torch::manual_seed(1);
  hpctrial::comm::MpiCommunicator pipe(environment.world());
  struct Run {
    std::string title;
    Model model;
    std::string partition;
    bool ratio_goal, state_goal;
  };
  const std::vector<Run> runs = {
      {std::to_string(o.layers) + " equal layers, cut uniformly", equal_layers(o), "uniform", true, true},
      {"unequal layers (input projection, " + std::to_string(o.layers) + " blocks, LayerNorm, head), cut by parameters",
       unequal_layers(o), "parameters", true, false},
      {"the same unequal layers, cut uniformly", unequal_layers(o), "uniform", false, false}};
  for (const Run& run : runs) {
    const std::vector<double> mine = run_stage(o, run.model, run.partition, pipe);
    std::vector<double> all(static_cast<std::size_t>(kFigures * pipe.size()));
    MPI_Gather(mine.data(), kFigures, MPI_DOUBLE, all.data(), kFigures, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (pipe.rank() == 0) {
      report(o, run.title, static_cast<int>(run.model.layers.size()), pipe.size(), all, run.ratio_goal, run.state_goal);
    }
  }
  return 0;
}
