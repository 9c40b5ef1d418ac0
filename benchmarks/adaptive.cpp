// adaptive: what the adaptive batch (optimizations.adaptive_batch_size, AdaScale) gains, on the
// mlp example's trial, in one run on N ranks:
//   - wall time from the first step to a target validation accuracy: the adaptive batch against
//     the example's fixed batch of 64 (goal <= 0.8) and against the best of several fixed
//     batches, each with its learning rate scaled by the square root of its batch (goal <= 1.0);
//   - the per-step cost of the estimators: the time a step spends measuring the gradients' norms
//     (and all-reducing them) and updating the noise estimate and the step-time model, against
//     the step (reading, copying and training its batch), with the adaptive batch held at the
//     base batch (goal <= 2 %); the step's time without the adaptive batch is printed beside it.
//
//   mpirun -np N build/benchmarks/adaptive [--quick] [--rounds N] [--target ACC] [--lr LR]
//       [--fixed 64,128,...] [--records N] [--epochs N] [--hidden N] [--teacher N]
//       [--label-noise P] [--period RECORDS] [--cost-steps N] [--keep] [--dir DIR]
//
// The data: the mlp example's generator in its teacher mode (synthetic_data.h), 2^20 standard
// normal records labelled by a random tanh network with a tenth of the labels random - a problem
// that takes the trial thousands of steps, not the hundred the example's blobs take, and whose
// gradient noise grows as it learns. The base learning rate (0.02 at the batch of 64) is the best
// of 0.01, 0.02 and 0.05 for the fixed batch of 64 on this data: AdaScale assumes a base tuned
// for its batch, and an untuned one flatters whichever side it happens to suit.
//
// Every run trains a fresh trial directory, validates every --period records (the same records
// for every batch, so no run is measured more coarsely than another), and stops
// (set_stop_requested) at the first validation that reaches the target; a run that never does is
// reported as such and left out of the ratios. Times are medians over the rounds, which rotate
// the order of the runs. --keep leaves each run's trial directory (metrics.jsonl) under --dir.
// --quick: one round, fewer records and batches, a lower target: the test suite's smoke run.
#include <dlfcn.h>
#include <mpi.h>
#include <torch/torch.h>

#include <hpctrial/trainer.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/mpi_environment.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/trainer/training_loop.h"
#include "mlp_trial.h"
#include "synthetic_data.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  int rounds = 3;
  double target = 0.70;
  std::vector<std::int64_t> fixed = {64, 128, 256, 512};
  std::int64_t max_epochs = 3;
  std::int64_t cost_steps = 400;
  std::string dir = "/tmp/hpctrial-bench-adaptive";
  bool keep = false;  // keep each run's trial directory (its metrics.jsonl) for a look afterwards
  std::int64_t records = 1 << 20;
  std::int64_t teacher_hidden = 32;  // the labels' teacher network (synthetic_data.h)
  double label_noise = 0.1;
  std::int64_t hidden = 128;          // the trial's hidden units
  double lr = 0.02;                   // at the base batch of 64
  std::int64_t validation_period = 32768;  // records
};

// Records when the validation accuracy first reaches the target, and ends the trial there.
struct Outcome {
  double seconds = -1;  // -1: not reached
  std::int64_t batches = 0;
  double accuracy = 0;
};
Outcome g_outcome;
Clock::time_point g_started;

class TargetCallback : public hpctrial::Callback {
 public:
  TargetCallback(hpctrial::TrialContext& context, double target) : context_(context), target_(target) {}
  void on_training_start() override { g_started = Clock::now(); }
  void on_validation_end(const hpctrial::MetricValues& metrics) override {
    const auto it = metrics.find("accuracy");
    if (it == metrics.end() || g_outcome.seconds >= 0) return;
    g_outcome.accuracy = std::max(g_outcome.accuracy, it->second.number());
    g_outcome.batches = context_.current_train_batch();
    if (it->second >= target_) {
      g_outcome.seconds = std::chrono::duration<double>(Clock::now() - g_started).count();
      context_.set_stop_requested(true);
    }
  }

 private:
  hpctrial::TrialContext& context_;
  double target_;
};

class BenchTrial : public mlp_example::MlpTrial {
 public:
  BenchTrial(hpctrial::TrialContext& context, double target)
      : MlpTrial(context), callback_(std::make_shared<TargetCallback>(context, target)) {}
  std::map<std::string, std::shared_ptr<hpctrial::Callback>> build_callbacks() override {
    return {{"target", callback_}};
  }

 private:
  std::shared_ptr<TargetCallback> callback_;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "adaptive: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--quick") {
      o.rounds = 1;
      o.target = 0.5;
      o.fixed = {64, 256};
      o.max_epochs = 2;
      o.validation_period = 4096;
      o.cost_steps = 60;
      o.records = 16384;
    } else if (arg == "--rounds") {
      o.rounds = std::stoi(value());
    } else if (arg == "--cost-steps") {
      o.cost_steps = std::stoll(value());
    } else if (arg == "--teacher") {
      o.teacher_hidden = std::stoll(value());
    } else if (arg == "--label-noise") {
      o.label_noise = std::stod(value());
    } else if (arg == "--hidden") {
      o.hidden = std::stoll(value());
    } else if (arg == "--lr") {
      o.lr = std::stod(value());
    } else if (arg == "--period") {
      o.validation_period = std::stoll(value());
    } else if (arg == "--fixed") {
      o.fixed.clear();
      std::string list = value();
      for (std::size_t at = 0; at < list.size();) {
        const std::size_t end = std::min(list.find(',', at), list.size());
        o.fixed.push_back(std::stoll(list.substr(at, end - at)));
        at = end + 1;
      }
    } else if (arg == "--records") {
      o.records = std::stoll(value());
    } else if (arg == "--epochs") {
      o.max_epochs = std::stoll(value());
    } else if (arg == "--target") {
      o.target = std::stod(value());
    } else if (arg == "--keep") {
      o.keep = true;
    } else if (arg == "--dir") {
      o.dir = value();
    } else {
      std::fprintf(stderr, "usage: mpirun -np N adaptive [--quick] [--rounds N] [--target ACC] [--dir DIR]\n");
      std::exit(2);
    }
  }
  return o;
}

hpctrial::core::ExperimentConfig config_of(const std::string& yaml) {
  hpctrial::core::Diagnostics d;
  auto config = hpctrial::core::parse_experiment_config(hpctrial::core::parse_config_text(yaml, "bench", d), d);
  if (!d.empty()) {
    std::fprintf(stderr, "%s\n", d.to_string().c_str());
    std::exit(1);
  }
  return config;
}

std::string yaml(const Options& o, std::int64_t batch, double lr, const std::string& length,
                 const std::string& optimizations) {
  return "name: adaptive-bench\nentrypoint: ./mlp\nsearcher: {name: single, metric: validation_loss, max_length: " +
         length + "}\nhyperparameters: {global_batch_size: " + std::to_string(batch) + ", learning_rate: " +
         std::to_string(lr) + ", hidden: " + std::to_string(o.hidden) + ", classes: 10}\nmin_validation_period: {records: " +
         std::to_string(o.validation_period) + "}\n" +
         "records_per_epoch: " + std::to_string(o.records) + "\nscheduling_unit: 1000000\ndata: {train: " + o.dir + "/train.h5, validation: " +
         o.dir + "/validation.h5}\n" + optimizations + "reproducibility: {experiment_seed: 7}\n";
}

hpctrial::trainer::LoopResult train(const Options& o, hpctrial::comm::MpiCommunicator& comm, const std::string& name,
                                    const std::string& text, double target) {
  const std::string trial_dir = o.dir + "/" + name;
  if (comm.is_chief()) std::filesystem::remove_all(trial_dir);  // a fresh trial: no resume
  comm.barrier();
  hpctrial::trainer::LoopOptions loop;
  loop.trial_dir = trial_dir;
  loop.progress_interval_s = 0;
  loop.report_period_batches = 1000000;
  loop.distributed = {comm.rank(), comm.size(), comm.rank(), comm.size(), 1};
  g_outcome = {};
  const auto result = hpctrial::trainer::run_training(
      config_of(text), [&](hpctrial::TrialContext& c) { return std::make_unique<BenchTrial>(c, target); }, comm, loop);
  if (comm.is_chief() && !o.keep) std::filesystem::remove_all(trial_dir);
  return result;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// A batch's milliseconds (reading, copying and training it), the most of any rank; and, with
// `phase`, that phase's milliseconds a batch.
double step_ms(const hpctrial::trainer::LoopResult& result, hpctrial::comm::MpiCommunicator& comm,
               const char* phase = nullptr) {
  const auto& timings = result.timings;
  const double count = static_cast<double>(timings.at("train_batch").at("count").get<std::int64_t>());
  double ms = 0;
  if (phase != nullptr) {
    ms = timings.at(phase).at("total_s").get<double>() * 1000 / count;
  } else {
    for (const char* p : {"dataloader_next", "to_device", "train_batch"}) ms += timings.at(p).at("total_s").get<double>();
    ms *= 1000 / count;
  }
  comm.allreduce(&ms, 1, hpctrial::comm::DType::kFloat64, hpctrial::comm::ReduceOp::kMax);
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  hpctrial::comm::MpiEnvironment environment(&argc, &argv);
  const Options o = parse(argc, argv);
  hpctrial::core::set_log_level(hpctrial::core::LogLevel::kWarning);
  torch::set_num_threads(1);
  using SetThreads = void (*)(int);
  if (auto set = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) set(1);
  hpctrial::comm::MpiCommunicator comm(environment.world());
  if (comm.is_chief()) {
    std::filesystem::create_directories(o.dir);
    mlp_example::SyntheticSpec spec;
    spec.samples = o.records;
    spec.teacher_hidden = o.teacher_hidden;
    spec.label_noise = o.label_noise;
    mlp_example::write_synthetic_dataset(o.dir + "/train.h5", spec);
    spec.samples = 4096;
    spec.seed = 2;
    mlp_example::write_synthetic_dataset(o.dir + "/validation.h5", spec);
  }
  comm.barrier();

  const std::string length = "{epochs: " + std::to_string(o.max_epochs) + "}";
  struct Run {
    std::string name;
    std::string yaml;
    std::vector<double> seconds;
    std::int64_t batches = 0;
    bool reached = true;
    double best_accuracy = 0;
  };
  std::vector<Run> runs;
  for (std::int64_t batch : o.fixed) {
    const double lr = o.lr * std::sqrt(static_cast<double>(batch) / 64.0);
    runs.push_back({"fixed " + std::to_string(batch), yaml(o, batch, lr, length, ""), {}, 0, true});
  }
  runs.push_back({"adaptive", yaml(o, 64, o.lr, length,
                                   "optimizations:\n  adaptive_batch_size: {enabled: true, max_batch_size: 2048, "
                                   "local_batch_size_bounds: [16, 1024], decision_interval: 20}\n"),
                  {}, 0, true});
  for (int round = 0; round < o.rounds; ++round) {
    for (std::size_t k = 0; k < runs.size(); ++k) {
      Run& run = runs[(round + k) % runs.size()];
      std::string dir_name = run.name;
      std::replace(dir_name.begin(), dir_name.end(), ' ', '-');
      train(o, comm, dir_name, run.yaml, o.target);
      double seconds = g_outcome.seconds;
      comm.broadcast_async(&seconds, sizeof seconds, 0)->wait();
      run.reached = run.reached && seconds >= 0;
      run.seconds.push_back(seconds);
      run.batches = g_outcome.batches;
      run.best_accuracy = g_outcome.accuracy;
    }
  }

  // The estimators' cost: the adaptive batch held at the base batch against the same steps without.
  const std::string steps = "{batches: " + std::to_string(o.cost_steps) + "}";
  std::vector<double> plain_ms, measured_ms, estimator_share, norms_ms, update_ms;
  for (int round = 0; round < std::max(3, o.rounds); ++round) {
    for (int k = 0; k < 2; ++k) {
      const bool adaptive = (round + k) % 2 == 1;
      const auto result =
          train(o, comm, "cost", yaml(o, 64, 0.05, steps, adaptive ? "optimizations:\n  adaptive_batch_size: {enabled: "
                                                                     "true, max_batch_size: 64, local_batch_size_bounds: "
                                                                     "[32, 32]}\n" : ""), 2.0);
      (adaptive ? measured_ms : plain_ms).push_back(step_ms(result, comm));
      if (adaptive) {
        const double norms = step_ms(result, comm, "adaptive_norms"), update = step_ms(result, comm, "adaptive_update");
        norms_ms.push_back(norms);
        update_ms.push_back(update);
        estimator_share.push_back((norms + update) / measured_ms.back());
      }
    }
  }

  if (comm.is_chief()) {
    std::printf("ranks %d, the mlp example's trial (32-%lld-%lld-10, SGD momentum 0.9, StepLR 0.7 an epoch) on %lld "
                "records labelled by a teacher network of %lld tanh units with %.2f of the labels random, target "
                "validation accuracy %.3f, median of %d round(s)\n",
                comm.size(), static_cast<long long>(o.hidden), static_cast<long long>(o.hidden),
                static_cast<long long>(o.records), static_cast<long long>(o.teacher_hidden), o.label_noise, o.target,
                o.rounds);
    std::printf("run            seconds  batches\n");
    double best = -1, example = -1, adaptive = -1;
    std::string best_name;
    for (const Run& run : runs) {
      if (!run.reached) {
        std::printf("%-12s not reached in %lld epochs (best accuracy %.4f)\n", run.name.c_str(),
                    static_cast<long long>(o.max_epochs), run.best_accuracy);
        continue;
      }
      const double s = median(run.seconds);
      std::printf("%-12s %9.2f %8lld\n", run.name.c_str(), s, static_cast<long long>(run.batches));
      if (run.name == "adaptive") {
        adaptive = s;
      } else {
        if (run.name == "fixed 64") example = s;
        if (best < 0 || s < best) {
          best = s;
          best_name = run.name;
        }
      }
    }
    if (adaptive > 0 && example > 0) {
      std::printf("time to target, adaptive / fixed 64 (the example's): %.4f (goal <= 0.8)\n", adaptive / example);
    }
    if (adaptive > 0 && best > 0) {
      std::printf("time to target, adaptive / best fixed (%s): %.4f (goal <= 1.0)\n", best_name.c_str(), adaptive / best);
    }
    std::printf("step at the base batch: %.4f ms without the adaptive batch, %.4f ms with it (held at the base "
                "batch)\n", median(plain_ms), median(measured_ms));
    std::printf("estimators: %.4f ms a step measuring the gradients' norms, %.4f ms updating the estimates\n",
                median(norms_ms), median(update_ms));
    std::printf("estimator cost: %.4f %% of a step (goal <= 2 %%)\n", median(estimator_share) * 100);
  }
  return 0;
}
