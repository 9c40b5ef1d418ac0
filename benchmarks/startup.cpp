// startup: time from `hpctrial run` to the end of the first training step, at 1, 2 and 4 ranks,
// next to torchrun (Debian's python3-torch) starting the equivalent PyTorch DDP script
// (startup.py: the same MLP, data and batch, gloo), in the same run.
//
//   startup [--quick] [--world-sizes 1,2,4] [--rounds 5] [--threads 1]
//
// --quick: 1 and 2 ranks, one round - the test suite's smoke run.
// Each side is timed from just before its command is started to the wall-clock time its rank 0
// prints right after the first optimizer step (so the first gradient all-reduce is in); output
// buffering does not count. Rounds alternate which side runs first; the median round is
// reported. Ranks beyond the cores are oversubscribed on both sides alike.
// Goal: hpctrial <= 0.5 x torchrun at every world size. (--worker is the hpctrial side itself.)
//
// Debian's torch 1.13 under Python 3.11 drops the default `--redirects 0` (an IntFlag of value 0
// is not iterable there), so torchrun is given `--redirects 9:1 --tee 9:1`: a redirect for a
// local rank that does not exist, which leaves every real rank's output as it is.
#include <torch/torch.h>

#include <hpctrial/trainer.h>

#include <unistd.h>

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
#include <thread>
#include <vector>

#include "hpctrial/core/subprocess.h"
#include "mlp_trial.h"

namespace {

long long wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct Setup {
  std::vector<int> world_sizes = {1, 2, 4};
  int rounds = 5;
  int threads = 1;
};

// The hpctrial side: the mlp example's network on in-memory data; rank 0 prints the time its
// first step ended.
class FirstStep : public hpctrial::Trial {
 public:
  explicit FirstStep(hpctrial::TrialContext& context) : context_(context) {
    torch::manual_seed(1);
    data_ = std::make_shared<hpctrial::TensorDataset>(torch::randn({8192, 32}), torch::randint(0, 10, {8192}));
    validation_ = std::make_shared<hpctrial::TensorDataset>(torch::randn({64, 32}), torch::randint(0, 10, {64}));
    model_ = context.wrap_model(mlp_example::Mlp(32, 64, 10));
    optimizer_ = context.wrap_optimizer(
        std::make_shared<torch::optim::SGD>(model_->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)));
  }

  hpctrial::Metrics train_batch(hpctrial::Batch& batch, std::int64_t, std::int64_t batch_idx) override {
    auto loss = torch::nll_loss(model_->forward(batch.data), batch.target);
    context_.backward(loss);
    context_.step_optimizer(*optimizer_);
    if (batch_idx == 0 && context_.distributed().is_chief()) {
      std::printf("first step ended at %lld\n", wall_ns());
      std::fflush(stdout);
    }
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
};

std::vector<int> parse_list(const std::string& text) {
  std::vector<int> out;
  std::stringstream list(text);
  for (std::string item; std::getline(list, item, ',');) out.push_back(std::stoi(item));
  return out;
}

Setup parse(int argc, char** argv) {
  Setup s;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      s.world_sizes = {1, 2};
      s.rounds = 1;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "usage: %s [--quick] [--world-sizes 1,2,4] [--rounds N] [--threads N]\n", argv[0]);
      std::exit(2);
    }
    const std::string value = argv[++i];
    if (arg == "--world-sizes") s.world_sizes = parse_list(value);
    else if (arg == "--rounds") s.rounds = std::stoi(value);
    else if (arg == "--threads") s.threads = std::stoi(value);
    else {
      std::fprintf(stderr, "unknown option %s\n", arg.c_str());
      std::exit(2);
    }
  }
  return s;
}

// Seconds from `started` (wall-clock ns) to the first step's end that the command printed.
double seconds_to_first_step(const std::vector<std::string>& argv, const hpctrial::core::RunOptions& options,
                             const char* side) {
  const long long started = wall_ns();
  const auto r = hpctrial::core::run_process(argv, options);
  std::smatch match;
  if (!r.ok() || !std::regex_search(r.out, match, std::regex("first step ended at ([0-9]+)"))) {
    std::fprintf(stderr, "the %s side failed: %s\n%s\n%s\n", side, r.describe().c_str(), r.out.c_str(), r.err.c_str());
    std::exit(1);
  }
  return static_cast<double>(std::stoll(match[1]) - started) / 1e9;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int orchestrate(const Setup& s, const std::string& self) {
  const auto dir = std::filesystem::temp_directory_path() / ("hpctrial-startup-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  hpctrial::core::RunOptions options;
  options.timeout = std::chrono::minutes(5);
  const std::string threads = std::to_string(s.threads);
  options.env_set = {{"OMP_NUM_THREADS", threads}, {"OPENBLAS_NUM_THREADS", threads},
                     {"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
                     {"HPCTRIAL_LOG_LEVEL", "warning"}};
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  std::printf("time from the command to the end of the first training step (MLP 32-64-64-10, global batch 64, "
              "%d thread(s) per rank, %u cores, median of %d rounds)\n", s.threads, cores, s.rounds);
  std::printf("%-6s %14s %14s %8s\n", "ranks", "hpctrial run", "torchrun", "ratio");
  std::fflush(stdout);
  double worst = 0;
  for (int world : s.world_sizes) {
    const std::string config = (dir / ("exp-" + std::to_string(world) + ".yaml")).string();
    std::ofstream(config) << "name: startup\nentrypoint: [" << self << ", --worker]\n"
                          << "hyperparameters: {global_batch_size: 64}\n"
                          << "searcher: {name: single, metric: validation_loss, max_length: {batches: 2}}\n"
                          << "resources: {slots_per_trial: " << world << ", cpus_per_slot: " << s.threads << "}\n"
                          << "min_validation_period: {batches: 1000}\n"
                          << "reproducibility: {experiment_seed: 1}\n";
    const std::vector<std::string> torchrun = {
        "torchrun", "--redirects", "9:1", "--tee", "9:1", "--nproc_per_node", std::to_string(world),
        HPCTRIAL_STARTUP_SCRIPT, "--threads", threads};
    std::vector<double> ours, theirs;
    for (int round = 0; round < s.rounds; ++round) {
      // A fresh experiment each time: a first run, not a resume.
      const std::string experiment = (dir / ("run-" + std::to_string(world) + "-" + std::to_string(round))).string();
      std::vector<std::string> run = {HPCTRIAL_CLI, "run", config, "--experiment", experiment};
      if (static_cast<unsigned>(world) > cores) run.push_back("--oversubscribe");
      if (round % 2 == 0) {
        ours.push_back(seconds_to_first_step(run, options, "hpctrial"));
        theirs.push_back(seconds_to_first_step(torchrun, options, "torchrun"));
      } else {
        theirs.push_back(seconds_to_first_step(torchrun, options, "torchrun"));
        ours.push_back(seconds_to_first_step(run, options, "hpctrial"));
      }
    }
    const double ratio = median(ours) / median(theirs);
    worst = std::max(worst, ratio);
    std::printf("%-6d %13.2fs %13.2fs %8.2f\n", world, median(ours), median(theirs), ratio);
    std::fflush(stdout);
  }
  std::printf("worst ratio hpctrial / torchrun: %.2f (goal <= 0.5)\n", worst);
  std::filesystem::remove_all(dir);
  return std::isfinite(worst) && worst > 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--worker") == 0) {
    argv[1] = argv[0];
    return hpctrial::trainer::run_main(argc - 1, argv + 1, [](hpctrial::TrialContext& context) {
      return std::unique_ptr<hpctrial::Trial>(std::make_unique<FirstStep>(context));
    });
  }
  return orchestrate(parse(argc, argv), std::filesystem::canonical("/proc/self/exe").string());
}
