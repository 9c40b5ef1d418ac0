// ddp_compare: samples/s of the same MLP and global batch trained by hpctrial (under mpirun) and
// by PyTorch DDP (Debian's python3-torch, gloo backend, started by torch.multiprocessing), at
// each world size, in one run, with the same thread settings (OMP_NUM_THREADS and
// OPENBLAS_NUM_THREADS = --threads for both; hpctrial's resources.cpus_per_slot likewise).
//
//   ddp_compare [--quick] [--model small|large] [--world-sizes 1,2] [--rounds 3] [--steps 300]
//               [--warmup 50] [--features 32] [--hidden 64] [--classes 10] [--global-batch 64]
//               [--threads 1]
//
// --model small (the default) is the mlp example's model and batch: its steps are so short that
// it mostly measures each side's per-step cost (Python's, on the DDP side). --model large is a
// real-sized one: MLP 784-1024-1024-10 (1.9 M parameters), global batch 256, where the
// computation and the gradient all-reduce dominate. The options after it override its sizes.
//
// --quick: 60 steps (timed after 10), one round - the test suite's smoke run. Each hpctrial run
// trains a trial directory of its own and must report --steps trained batches; a side that
// trains another number or measures no rate ends the benchmark with exit 1.
// The defaults are the mlp example's model and batch. Each side is timed from batch --warmup
// to the last batch; rounds alternate which side runs first; the median round is reported.
// Goals: hpctrial >= 1.2 x DDP at every world size with the small model; >= 1.3 x with the large
// one at 2 or more ranks (on one, both sides run the same LibTorch kernels). (--worker is the
// hpctrial side itself.)
#include <unistd.h>

#include <torch/torch.h>

#include <hpctrial/trainer.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "hpctrial/core/subprocess.h"
#include "io_util.h"
#include "mlp_trial.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Setup {
  std::vector<int> world_sizes = {1, 2};
  int rounds = 3;
  std::int64_t steps = 300, warmup = 50;
  std::int64_t samples = 8192, features = 32, hidden = 64, classes = 10, global_batch = 64;
  int threads = 1;
  std::string model = "small";
};

// The hpctrial side: the mlp example's network, on in-memory data.
class TimedMlp : public hpctrial::Trial {
 public:
  explicit TimedMlp(hpctrial::TrialContext& context) : context_(context) {
    const auto samples = context.hparam<std::int64_t>("samples");
    const auto features = context.hparam<std::int64_t>("features");
    const auto classes = context.hparam<std::int64_t>("classes");
    torch::manual_seed(1);
    data_ = std::make_shared<hpctrial::TensorDataset>(torch::randn({samples, features}),
                                                      torch::randint(0, classes, {samples}));
    validation_ = std::make_shared<hpctrial::TensorDataset>(torch::randn({context.global_batch_size(), features}),
                                                            torch::randint(0, classes, {context.global_batch_size()}));
    model_ = context.wrap_model(mlp_example::Mlp(features, context.hparam<std::int64_t>("hidden"), classes));
    optimizer_ = context.wrap_optimizer(std::make_shared<torch::optim::SGD>(
        model_->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)));
    warmup_ = context.hparam<std::int64_t>("warmup");
    last_ = context.hparam<std::int64_t>("steps") - 1;
  }
  ~TimedMlp() override {
    if (!context_.distributed().is_chief()) return;
    const double seconds = std::chrono::duration<double>(end_ - start_).count();
    std::printf("trained batches: %lld\n", static_cast<long long>(trained_));
    std::printf("samples/s: %.1f\n", static_cast<double>((last_ - warmup_) * context_.global_batch_size()) / seconds);
    std::fflush(stdout);
  }

  hpctrial::Metrics train_batch(hpctrial::Batch& batch, std::int64_t, std::int64_t batch_idx) override {
    if (batch_idx == warmup_) start_ = Clock::now();
    if (batch_idx == last_) end_ = Clock::now();
    ++trained_;
    auto loss = torch::nll_loss(model_->forward(batch.data), batch.target);
    context_.backward(loss);
    context_.step_optimizer(*optimizer_);
    return {{"loss", loss}};
  }
  hpctrial::Metrics evaluate_batch(hpctrial::Batch& batch) override {
    return {{"validation_loss", torch::nll_loss(model_->forward(batch.data), batch.target)}};
  }
  hpctrial::DataLoader build_training_data_loader() override { return {data_, context_.per_slot_batch_size()}; }
  hpctrial::DataLoader build_validation_data_loader() override {
    return {validation_, context_.per_slot_batch_size(), false};
  }

 private:
  hpctrial::TrialContext& context_;
  std::shared_ptr<hpctrial::TensorDataset> data_, validation_;
  mlp_example::Mlp model_{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer_;
  std::int64_t warmup_ = 0, last_ = 0, trained_ = 0;
  Clock::time_point start_, end_;
};

Setup parse(int argc, char** argv) {
  Setup s;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg != "--quick" && i + 1 >= argc) {
      std::fprintf(stderr, "usage: %s [--quick] [--model small|large] [--world-sizes 1,2] [--rounds N] [--steps N] [--warmup N] [--features N] "
                   "[--hidden N] [--classes N] [--global-batch N] [--threads N]\n", argv[0]);
      std::exit(2);
    }
    if (arg == "--quick") {
      s.steps = 60;
      s.warmup = 10;
      s.rounds = 1;
      continue;
    }
    const std::string value = argv[++i];
    if (arg == "--model") {
      if (value != "small" && value != "large") {
        std::fprintf(stderr, "--model takes small or large, not %s\n", value.c_str());
        std::exit(2);
      }
      s.model = value;
      if (value == "large") s.features = 784, s.hidden = 1024, s.classes = 10, s.global_batch = 256;
    } else if (arg == "--world-sizes") s.world_sizes = hpctrial::bench::parse_int_list(value);
    else if (arg == "--rounds") s.rounds = std::stoi(value);
    else if (arg == "--steps") s.steps = std::stoll(value);
    else if (arg == "--warmup") s.warmup = std::stoll(value);
    else if (arg == "--features") s.features = std::stoll(value);
    else if (arg == "--hidden") s.hidden = std::stoll(value);
    else if (arg == "--classes") s.classes = std::stoll(value);
    else if (arg == "--global-batch") s.global_batch = std::stoll(value);
    else if (arg == "--threads") s.threads = std::stoi(value);
    else {
      std::fprintf(stderr, "unknown option %s\n", arg.c_str());
      std::exit(2);
    }
  }
  return s;
}

// The rate a side printed; `steps` > 0: the side must also say it trained that many batches.
double samples_per_second(const hpctrial::core::RunResult& r, const char* side, std::int64_t steps = 0) {
  std::smatch match, trained;
  const bool counted = steps == 0 || (std::regex_search(r.out, trained, std::regex("trained batches: ([0-9]+)")) &&
                                      std::stoll(trained[1]) == steps);
  if (!r.ok() || !counted || !std::regex_search(r.out, match, std::regex("samples/s: ([0-9.]+)")) ||
      !(std::stod(match[1]) > 0) || !std::isfinite(std::stod(match[1]))) {
    std::fprintf(stderr, "the %s side failed (it must train %lld batches and print a positive rate): %s\n%s\n%s\n",
                 side, static_cast<long long>(steps), r.describe().c_str(), r.out.c_str(), r.err.c_str());
    std::exit(1);
  }
  return std::stod(match[1]);
}

using hpctrial::bench::median;

int orchestrate(const Setup& s, const std::string& self) {
  const auto dir = std::filesystem::temp_directory_path() / ("hpctrial-ddp-compare-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  hpctrial::core::RunOptions options;
  options.timeout = std::chrono::minutes(10);
  const std::string threads = std::to_string(s.threads);
  options.env_set = {{"OMP_NUM_THREADS", threads}, {"OPENBLAS_NUM_THREADS", threads},
                     {"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
                     {"HPCTRIAL_LOG_LEVEL", "warning"}};
  std::printf("%s model: MLP %lld-%lld-%lld-%lld, global batch %lld, %lld steps (timed after %lld), %d thread(s) "
              "per rank\n", s.model.c_str(), static_cast<long long>(s.features), static_cast<long long>(s.hidden), static_cast<long long>(s.hidden),
              static_cast<long long>(s.classes), static_cast<long long>(s.global_batch),
              static_cast<long long>(s.steps), static_cast<long long>(s.warmup), s.threads);
  std::printf("%-6s %16s %16s %8s\n", "ranks", "hpctrial (s/s)", "DDP gloo (s/s)", "ratio");
  std::fflush(stdout);
  double worst = 1e9;
  for (int world : s.world_sizes) {
    const std::string config = (dir / ("exp-" + std::to_string(world) + ".yaml")).string();
    std::ofstream(config) << "name: ddp-compare\nentrypoint: ./ddp_compare\n"
                          << "hyperparameters: {global_batch_size: " << s.global_batch << ", samples: " << s.samples
                          << ", features: " << s.features << ", hidden: " << s.hidden << ", classes: " << s.classes
                          << ", warmup: " << s.warmup << ", steps: " << s.steps << "}\n"
                          << "searcher: {name: single, metric: validation_loss, max_length: {batches: " << s.steps << "}}\n"
                          << "resources: {slots_per_trial: " << world << ", cpus_per_slot: " << s.threads << "}\n"
                          << "reproducibility: {experiment_seed: 1}\n";
    // A trial directory of its own for each run: a used one would resume its finished trial.
    const auto ours = [&](int round) {
      const std::string trial_dir = (dir / ("run-" + std::to_string(world) + "-" + std::to_string(round))).string();
      return std::vector<std::string>{HPCTRIAL_MPIRUN, "-np", std::to_string(world), "--oversubscribe",
                                      "--bind-to", "none", self, "--worker", "--config", config,
                                      "--trial-dir", trial_dir, "--progress-seconds", "0"};
    };
    const std::vector<std::string> theirs = {
        HPCTRIAL_PYTHON, HPCTRIAL_DDP_SCRIPT, "--nproc", std::to_string(world), "--samples", std::to_string(s.samples), "--features", std::to_string(s.features),
        "--hidden", std::to_string(s.hidden), "--classes", std::to_string(s.classes), "--global-batch",
        std::to_string(s.global_batch), "--steps", std::to_string(s.steps), "--warmup", std::to_string(s.warmup),
        "--threads", threads};
    std::vector<double> a, b;
    for (int round = 0; round < s.rounds; ++round) {
      if (round % 2 == 0) {
        a.push_back(samples_per_second(hpctrial::core::run_process(ours(round), options), "hpctrial", s.steps));
        b.push_back(samples_per_second(hpctrial::core::run_process(theirs, options), "DDP"));
      } else {
        b.push_back(samples_per_second(hpctrial::core::run_process(theirs, options), "DDP"));
        a.push_back(samples_per_second(hpctrial::core::run_process(ours(round), options), "hpctrial", s.steps));
      }
    }
    const double ratio = median(a) / median(b);
    // The large model's goal is for data parallelism: on one rank both sides run the same kernels.
    if (s.model != "large" || world >= 2) worst = std::min(worst, ratio);
    std::printf("%-6d %16.0f %16.0f %8.2f\n", world, median(a), median(b), ratio);
    std::fflush(stdout);
  }
  std::printf("hpctrial trained %lld batches in each run\n", static_cast<long long>(s.steps));
  if (s.model == "large") {
    std::printf("worst ratio hpctrial / DDP at 2 or more ranks: %.2f (goal >= 1.3)\n", worst);
  } else {
    std::printf("worst ratio hpctrial / DDP: %.2f (goal >= 1.2)\n", worst);
  }
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--worker") == 0) {
    argv[1] = argv[0];  // run_main sees: program --config ...
    return hpctrial::trainer::run_main(argc - 1, argv + 1, [](hpctrial::TrialContext& context) {
      return std::unique_ptr<hpctrial::Trial>(std::make_unique<TimedMlp>(context));
    });
  }
  return orchestrate(parse(argc, argv), std::filesystem::canonical("/proc/self/exe").string());
}
