// search: adaptive_asha against random on the mlp example, and the cost of a worker's decision.
//
//   search [--quick] [--dir DIR] [--trials N] [--max-batches B] [--global-batch G] [--seeds S]
//          [--mode M] [--divisor D] [--max-rungs R] [--teacher H]
//
// The task: the mlp example on labels drawn from a teacher network of width 32 (a task the
// width and the learning rate both matter for: too narrow cannot fit it, too small a rate does
// not get there in time). The same space for both searches (the learning rate, log-uniform from
// 1e-4 to 0.3, and the width, 16 to 128), the same seed and the same max_trials, so that trial N
// of each samples the same configuration; each search run by `hpctrial run` on one rank:
//   random         every trial trains B batches (320) of G records (1024), then validates
//   adaptive_asha  mode conservative, divisor 4, max_rungs 3 (rungs of B/16, B/4 and B batches;
//                  Determined's default of 5 would make the first rung 1 batch long here). The
//                  conservative mode's bracket that starts trials at full length hedges against
//                  this task's short-horizon bias (slow starters that end best); `standard`
//                  does not reach random's best for most seeds.
// Compute is batches trained, summed over trials, in the order the search trained them. Printed,
// for each of 5 experiment seeds: each search's best validation_loss and its wall time; the
// compute each needed to reach the best loss random reached (random: through the trial that
// reached it; adaptive_asha: until a rung reported a loss as good), and their ratio; the wall
// time from the search's start to the validation that reached it, and their ratio (a promoted
// trial trains on in its ranks, so adaptive_asha pays a trial's start-up once a trial, not once a
// rung); then the median ratios over the seeds (goals: adaptive_asha <= 1/3 of random's compute,
// <= 1/2 of its wall time). Also printed: a random trial's wall time and how much of it went on
// its batches (loading them, train_batch); the rest is mostly starting and ending it (mpirun,
// LibTorch's initialisation - about 0.4 s of CPU in any program that links it - the data, the
// checkpoint), paid once a trial by both searches. Wall time can only show the compute saved
// where the batches are most of a trial, as they are in any search worth running on a batch
// scheduler: with G = 1024 a full trial spends about 3 s on its batches against about 0.6 s for
// the rest; with --global-batch 64 about 0.1 s, and both searches then take the time of starting
// 64 trials whatever they compute.
// Then the decision: a log of N simulated trials' events is written, and a worker's "what next?"
// (the log's lock, reading and replaying every event, the decision) is timed, median of 20 (goal
// <= 10 ms at 1 000 trials).
// --seeds S repeats both searches with experiment seeds 1234, 1235, ... (other configurations
// sampled) and prints the median ratio; --mode, --divisor and --max-rungs set adaptive_asha's
// keys; --teacher H draws the labels from a teacher network of width H (a task whose best width
// is not the smallest).
// --quick (bench-smoke): 4 trials of 32 batches of 64, and a log of 100 trials.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hpctrial/core/json_file.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/search/event_log.h"
#include "synthetic_data.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

struct Options {
  bool quick = false;
  std::string dir = "search-scratch";
  int trials = 64, batches = 320, seeds = 5, batch = 1024;
  std::string mode = "conservative";
  int divisor = 4, max_rungs = 3;  // rungs of 20, 80 and 320 batches
  std::int64_t teacher = 32;  // labels from a teacher network of this width (synthetic_data.h); 0: blobs
};

std::string config(const std::string& name, const std::string& searcher, const Options& o, int seed,
                   const std::string& data) {
  return "name: " + name + "\nentrypoint: " HPCTRIAL_MLP "\nhyperparameters:\n  global_batch_size: " + std::to_string(o.batch) + "\n"
         "  classes: 10\n  learning_rate: {type: log, base: 10, minval: -4, maxval: -0.5}\n"
         "  hidden: {type: categorical, vals: [16, 32, 64, 128]}\nsearcher:\n  name: " + searcher +
         "\n  metric: validation_loss\n  max_length: {batches: " + std::to_string(o.batches) + "}\n  max_trials: " +
         std::to_string(o.trials) + "\n  max_concurrent_trials: 1\n" +
         (searcher == "adaptive_asha" ? "  mode: " + o.mode + "\n  divisor: " + std::to_string(o.divisor) +
                                            "\n  max_rungs: " + std::to_string(o.max_rungs) + "\n"
                                      : std::string()) +
         "min_validation_period: {batches: 100000}\nresources: {slots_per_trial: 1}\n"
         "reproducibility: {experiment_seed: " + std::to_string(seed) + "}\ndata: {train: " + data +
         "/train.h5, validation: " + data + "/validation.h5, x_dataset: x, y_dataset: y}\n";
}

// Seconds since the epoch of a UTC time as metrics.jsonl writes it, "2026-11-29T23:56:45.379Z".
double epoch_seconds(const std::string& text) {
  std::tm tm{};
  int millis = 0;
  if (std::sscanf(text.c_str(), "%d-%d-%dT%d:%d:%d.%dZ", &tm.tm_year, &tm.tm_mon, &tm.tm_mday, &tm.tm_hour, &tm.tm_min,
                  &tm.tm_sec, &millis) < 6) {
    return std::nan("");
  }
  tm.tm_year -= 1900;
  tm.tm_mon -= 1;
  return static_cast<double>(timegm(&tm)) + millis / 1000.0;
}

double now_epoch() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// A search run by one worker: its wall time, and when it started (seconds since the epoch).
struct Ran {
  double seconds = 0, started = 0;
};

Ran run_search(const std::string& dir, const std::string& name, const std::string& yaml) {
  const std::string path = dir + "/" + name + ".yaml";
  std::ofstream(path) << yaml;
  hpctrial::core::RunOptions options;
  options.timeout = std::chrono::hours(2);
  const double started = now_epoch();
  const auto start = Clock::now();
  const auto r = hpctrial::core::run_process({HPCTRIAL_CLI, "run", path, "--experiment", dir + "/" + name}, options);
  if (!r.ok()) {
    std::fprintf(stderr, "search: %s failed: %s\n%s%s\n", name.c_str(), r.describe().c_str(), r.out.c_str(), r.err.c_str());
    std::exit(1);
  }
  return {since(start), started};
}

// A validation of a trial: its batch, loss, and time (seconds since the epoch).
struct Validation {
  std::int64_t first;
  double second;
  double time;
};
std::vector<Validation> validations(const std::string& metrics) {
  std::vector<Validation> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("kind", "") != "validation" || !j["metrics"]["validation_loss"].is_number()) continue;
    out.push_back({j["batches"].get<std::int64_t>(), j["metrics"]["validation_loss"].get<double>(),
                   epoch_seconds(j.value("time", ""))});
  }
  return out;
}

// How far a search went before it reached a loss: the best loss it reached at all, and the
// compute (batches) and the time (seconds since the epoch) of the first loss <= the target
// (-1 and NaN when never).
struct Reached {
  double best = std::numeric_limits<double>::infinity();
  std::int64_t batches = -1;
  double time = std::nan("");
};

// The compute until a loss <= target, trial after trial (random's order), and the best loss.
Reached random_compute(const std::string& experiment, int trials, double target) {
  Reached out;
  std::int64_t before = 0;
  for (int t = 0; t < trials; ++t) {
    const auto v = validations(experiment + "/trial-" + std::to_string(t) + "/metrics.jsonl");
    for (const auto& [batches, loss, time] : v) {
      out.best = std::min(out.best, loss);
      if (out.batches < 0 && loss <= target) {
        out.batches = before + batches;
        out.time = time;
      }
    }
    before += v.empty() ? 0 : v.back().first;
  }
  return out;
}

// The seconds the trials spent on their batches, summed over the trials (each one's last timings
// record): loading them (dataloader_next) and training on them (train_batch).
struct Training {
  double loading = 0, stepping = 0;
};
Training training_seconds(const std::string& experiment, int trials) {
  Training total;
  for (int t = 0; t < trials; ++t) {
    std::ifstream in(experiment + "/trial-" + std::to_string(t) + "/metrics.jsonl");
    Training last;
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.value("kind", "") != "timings") continue;
      const auto& timings = j["timings"];
      if (timings.contains("train_batch")) last.stepping = timings["train_batch"]["total_s"].get<double>();
      if (timings.contains("dataloader_next")) last.loading = timings["dataloader_next"]["total_s"].get<double>();
    }
    total.loading += last.loading;
    total.stepping += last.stepping;
  }
  return total;
}

// Every trial's batches, summed: the compute a search spent in all.
std::int64_t total_batches(const std::string& experiment, int trials) {
  std::int64_t total = 0;
  for (int t = 0; t < trials; ++t) {
    const auto v = validations(experiment + "/trial-" + std::to_string(t) + "/metrics.jsonl");
    total += v.empty() ? 0 : v.back().first;
  }
  return total;
}

// adaptive_asha: the compute at each rung event (every trial's batches so far), until a loss <= target.
Reached asha_compute(const std::string& experiment, double target) {
  std::map<int, std::int64_t> trained;
  Reached out;
  std::ifstream in(experiment + "/search-events.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto e = nlohmann::json::parse(line);
    if (e["event"] != "rung") continue;
    const int trial = e["trial"].get<int>();
    const auto v = validations(experiment + "/trial-" + std::to_string(trial) + "/metrics.jsonl");
    // The rung's validation is the trial's n-th, n its rung's index + 1.
    const auto rung = static_cast<std::size_t>(e["rung"].get<int>());
    if (rung < v.size()) trained[trial] = v[rung].first;
    std::int64_t total = 0;
    for (const auto& [id, batches] : trained) total += batches;
    const auto loss = hpctrial::core::number_of(e["metric"]);
    if (!loss) continue;
    out.best = std::min(out.best, *loss);
    if (out.batches < 0 && *loss <= target) {
      out.batches = total;
      out.time = rung < v.size() ? v[rung].time : std::nan("");
    }
  }
  return out;
}

// A worker's decision over a log of `trials` simulated trials: median seconds of 20.
double decision_seconds(const std::string& dir, int trials) {
  hpctrial::search::AshaOptions o;
  o.max_length = 1000;
  o.max_trials = trials;
  o.max_concurrent_trials = 16;
  hpctrial::search::Asha asha(o);
  std::vector<hpctrial::search::Event> events(1);
  events[0].kind = hpctrial::search::Event::Kind::kSearch;
  events[0].experiment_id = "bench";
  asha.apply(events[0]);
  const auto none = [](int) { return false; };
  const auto append = [&](hpctrial::search::Event e) {
    asha.apply(e);
    events.push_back(e);
  };
  for (int step = 0; step < 10 * trials; ++step) {
    const auto d = asha.next(none);
    if (d.kind == hpctrial::search::Decision::Kind::kDone) break;
    hpctrial::search::Event e;
    e.trial = d.trial;
    if (d.create) {
      e.kind = hpctrial::search::Event::Kind::kCreated;
      e.bracket = d.bracket;
      append(e);
    }
    e.kind = d.promote ? hpctrial::search::Event::Kind::kPromoted : hpctrial::search::Event::Kind::kStarted;
    e.rung = d.rung;
    append(e);
    e.kind = hpctrial::search::Event::Kind::kRung;
    e.metric = std::fmod(d.trial * 0.618, 1.0) / (1 + d.rung);
    append(e);
  }
  const std::string log_path = dir + "/search-events.jsonl";
  fs::remove(log_path);
  hpctrial::search::EventLog log(log_path, dir + "/.search.lock", "bench", hpctrial::search::settings_of(o));
  {
    auto locked = log.lock();
    locked.read();
    locked.append(std::vector<hpctrial::search::Event>(events.begin() + 1, events.end()), "bench");
  }
  std::vector<double> times;
  for (int round = 0; round < 20; ++round) {
    const auto start = Clock::now();
    auto locked = log.lock();
    const auto replayed = hpctrial::search::replay(o, locked.read(), log.path());
    const auto d = replayed.next(none);
    times.push_back(since(start));
    if (round == 0) {
      std::printf("decision log: %zu events of %d trials (%d created), next: %s\n", events.size(), trials,
                  replayed.created(), d.kind == hpctrial::search::Decision::Kind::kDone ? "done" : "run");
    }
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}


// One seed: both searches, their figures, and the ratios of compute and of wall time to random's
// best (negative: adaptive_asha did not reach it).
std::pair<double, double> compare(const Options& o, int seed, const std::string& data) {
  const std::string tag = "-" + std::to_string(seed);
  const Ran random_run = run_search(o.dir, "random" + tag, config("random", "random", o, seed, data));
  const Ran asha_run = run_search(o.dir, "asha" + tag, config("asha", "adaptive_asha", o, seed, data));
  const double random_best =
      random_compute(o.dir + "/random" + tag, o.trials, -std::numeric_limits<double>::infinity()).best;
  const Reached random = random_compute(o.dir + "/random" + tag, o.trials, random_best);
  const Reached asha = asha_compute(o.dir + "/asha" + tag, random_best);
  const double random_wall = random.time - random_run.started, asha_wall = asha.time - asha_run.started;
  std::printf("experiment_seed %d\n%-14s %12s %10s %22s %16s %20s\n", seed, "searcher", "best loss", "wall s",
              "batches to random's best", "batches in all", "s to random's best");
  std::printf("%-14s %12.4f %10.1f %22lld %16lld %20.1f\n", "random", random_best, random_run.seconds,
              static_cast<long long>(random.batches), static_cast<long long>(o.trials) * o.batches, random_wall);
  const double per_trial = random_run.seconds / o.trials;
  const Training training = training_seconds(o.dir + "/random" + tag, o.trials);
  const double loading = training.loading / o.trials, stepping = training.stepping / o.trials;
  std::printf("a random trial: %.2f s of wall time, %.2f s of it on its batches (%.2f s loading them, %.2f s in "
              "train_batch), %.2f s the rest (starting and ending it, validation)\n",
              per_trial, loading + stepping, loading, stepping, per_trial - loading - stepping);
  std::printf("%-14s %12.4f %10.1f %22s %16lld %20s\n", "adaptive_asha", asha.best, asha_run.seconds,
              asha.batches < 0 ? "not reached" : std::to_string(asha.batches).c_str(),
              static_cast<long long>(total_batches(o.dir + "/asha" + tag, o.trials)),
              asha.batches < 0 ? "not reached" : std::to_string(asha_wall).substr(0, 6).c_str());
  if (asha.batches < 0) {
    std::printf("compute to random's best, adaptive_asha / random: not reached (its best %.4f) (goal <= 0.333)\n",
                asha.best);
    std::printf("wall time to random's best, adaptive_asha / random: not reached (goal <= 0.5)\n");
    return {-1, -1};
  }
  const double ratio = static_cast<double>(asha.batches) / static_cast<double>(random.batches);
  const double wall = asha_wall / random_wall;
  std::printf("compute to random's best, adaptive_asha / random: %.3f (goal <= 0.333)\n", ratio);
  std::printf("wall time to random's best, adaptive_asha / random: %.3f (goal <= 0.5)\n", wall);
  return {ratio, wall};
}

// The median, a value that was not reached (negative) counting as the worst.
std::string median_of(std::vector<double> values) {
  for (double& v : values) v = v < 0 ? std::numeric_limits<double>::infinity() : v;
  std::sort(values.begin(), values.end());
  const double median = values[values.size() / 2];
  return std::isinf(median) ? "not reached" : std::to_string(median).substr(0, 5);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each seed's figures as they come, into a file too
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool more = i + 1 < argc;
    if (a == "--quick") {
      o.quick = true;
      o.trials = 4;
      o.batches = 32;
      o.seeds = 1;
      o.batch = 64;
    } else if (a == "--dir" && more) {
      o.dir = argv[++i];
    } else if (a == "--trials" && more) {
      o.trials = std::atoi(argv[++i]);
    } else if (a == "--max-batches" && more) {
      o.batches = std::atoi(argv[++i]);
    } else if (a == "--seeds" && more) {
      o.seeds = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--mode" && more) {
      o.mode = argv[++i];
    } else if (a == "--divisor" && more) {
      o.divisor = std::atoi(argv[++i]);
    } else if (a == "--max-rungs" && more) {
      o.max_rungs = std::atoi(argv[++i]);
    } else if (a == "--global-batch" && more) {
      o.batch = std::atoi(argv[++i]);
    } else if (a == "--teacher" && more) {
      o.teacher = std::atoll(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: search [--quick] [--dir DIR] [--trials N] [--max-batches B] [--global-batch G] "
                           "[--seeds S] [--mode M] [--divisor D] [--max-rungs R] [--teacher H]\n");
      return 2;
    }
  }
  fs::remove_all(o.dir);
  fs::create_directories(o.dir + "/data");
  o.dir = fs::absolute(o.dir).string();
  mlp_example::SyntheticSpec spec;
  spec.teacher_hidden = o.teacher;
  mlp_example::write_synthetic_dataset(o.dir + "/data/train.h5", spec);
  spec.samples = 2048;
  spec.seed = 2;
  mlp_example::write_synthetic_dataset(o.dir + "/data/validation.h5", spec);
  std::printf("mlp example%s, %d trials of at most %d batches of %d each, one worker (hpctrial run, 1 rank); "
              "adaptive_asha: mode %s, divisor %d, max_rungs %d\n",
              o.teacher > 0 ? (" (labels from a teacher of width " + std::to_string(o.teacher) + ")").c_str() : "",
              o.trials, o.batches, o.batch, o.mode.c_str(), o.divisor, o.max_rungs);
  std::vector<double> ratios, walls;
  for (int s = 0; s < o.seeds; ++s) {
    const auto [ratio, wall] = compare(o, 1234 + s, o.dir + "/data");
    ratios.push_back(ratio);
    walls.push_back(wall);
  }
  if (o.seeds > 1) {
    std::printf("median over %d seeds, adaptive_asha / random: %s (goal <= 0.333)\n", o.seeds,
                median_of(ratios).c_str());
    std::printf("median over %d seeds, wall time to random's best, adaptive_asha / random: %s (goal <= 0.5)\n",
                o.seeds, median_of(walls).c_str());
  }
  const int logged = o.quick ? 100 : 1000;
  const double decision = decision_seconds(o.dir, logged);
  std::printf("one decision with %d trials in the log: %.3f ms (goal <= 10 ms)\n", logged, decision * 1e3);
  return 0;
}
