// TensorBoard event files and the profiler window of a run on 2 and 4 ranks: the chief writes
// every metric and the trial's own summaries; every rank traces the window's batches, and only
// those.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "../support/event_files.h"
#include "linear_trial_ranks.h"
#include "hpctrial/trainer/summary_writer.h"
#include "mpi_test_env.h"

namespace hpctrial::trainer {
namespace tensorboard_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing_mpi::env;
using namespace testing_trial;
namespace fs = std::filesystem;

std::string shared_dir(const std::string& name) { return testing_mpi::shared_dir("hpctrial-tb", name); }

LoopResult train(const std::string& yaml, LinearTrial::Options options, const std::string& dir) {
  return train_on_ranks(yaml, std::move(options), dir, /*report_period=*/2);
}

// metrics.jsonl's values of one kind: (batches, value) per metric name.
std::map<std::string, std::vector<std::pair<std::int64_t, double>>> logged(const std::string& dir,
                                                                            const std::string& kind) {
  std::map<std::string, std::vector<std::pair<std::int64_t, double>>> out;
  std::ifstream in(dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] != kind) continue;
    for (const auto& [name, value] : j["metrics"].items()) out[name].emplace_back(j["batches"], value.get<double>());
  }
  return out;
}

TEST(TensorBoard, TheChiefWritesEveryMetricAndTheTrialsSummaries) {
  const std::string dir = shared_dir("metrics");
  LinearTrial::Options options;
  // From the trial's constructor, before the loop has written anything.
  options.setup = [](LinearTrial& trial) { trial.context_.tensorboard_writer().add_scalars("ctor", {{"x", 1.0}}, 0); };
  options.after_batch = [](LinearTrial& trial, std::int64_t batch_idx) {
    SummaryWriter& writer = trial.context_.tensorboard_writer();
    EXPECT_EQ(writer.enabled(), env().is_chief());
    writer.add_scalar("custom/batch_idx", static_cast<double>(batch_idx));  // the default step
    if (batch_idx == 2) {
      writer.add_histogram("weight", trial.model->weight, std::nullopt, 4);
      writer.add_image("ramp", torch::linspace(0, 1, 12).reshape({1, 3, 4}));
      writer.add_text("note", "rank " + std::to_string(env().rank()));
      writer.add_scalars("pair", {{"a", 1.0}, {"b", 2.0}}, 10);
    }
  };
  train(base_yaml(8) + "min_validation_period: {batches: 4}\n", options, dir);
  if (!env().is_chief()) return;

  const auto files = testing_support::event_files(dir + "/tensorboard");
  ASSERT_EQ(files.size(), 1u) << "one event file of the run's metrics and the trial's summaries";
  const auto read = testing_support::read_events(files);
  ASSERT_TRUE(read.ok) << read.error;
  EXPECT_EQ(read.events[0]["file_version"], "brain.Event:2");
  // Every metric of metrics.jsonl, at its batches, as the float TensorBoard keeps.
  for (const char* kind : {"training", "validation"}) {
    const auto metrics = logged(dir, kind);
    ASSERT_FALSE(metrics.empty()) << kind;
    for (const auto& [name, values] : metrics) {
      const auto scalars = testing_support::scalars(read.events, std::string(kind) + "/" + name);
      ASSERT_EQ(scalars.size(), values.size()) << kind << "/" << name;
      for (std::size_t i = 0; i < values.size(); ++i) {
        EXPECT_EQ(scalars[i].first, values[i].first);
        EXPECT_FLOAT_EQ(static_cast<float>(scalars[i].second), static_cast<float>(values[i].second));
      }
    }
  }
  EXPECT_EQ(logged(dir, "training").at("loss").size(), 4u) << "a report every 2 of 8 batches";
  // The phases' mean time of each reporting period.
  const auto train_batch_ms = testing_support::scalars(read.events, "timings/train_batch_ms");
  ASSERT_EQ(train_batch_ms.size(), 4u);
  for (const auto& [step, ms] : train_batch_ms) EXPECT_GT(ms, 0.0) << step;
  // The trial's own, at the step the harness uses: the batches trained once the batch is done.
  const auto custom = testing_support::scalars(read.events, "custom/batch_idx");
  ASSERT_EQ(custom.size(), 8u);
  for (std::size_t i = 0; i < custom.size(); ++i) {
    EXPECT_EQ(custom[i].first, static_cast<std::int64_t>(i) + 1);
    EXPECT_EQ(custom[i].second, static_cast<double>(i));
  }
  int histograms = 0, images = 0, texts = 0;
  for (const auto& e : read.events) {
    if (!e.contains("values")) continue;
    for (const auto& v : e["values"]) {
      if (v.contains("histogram")) {
        ++histograms;
        EXPECT_EQ(v["tag"], "weight");
        EXPECT_EQ(v["histogram"]["num"], 3);
        EXPECT_EQ(e["step"], 3);
      } else if (v.contains("image")) {
        ++images;
        EXPECT_EQ(v["image"]["height"], 3);
        EXPECT_EQ(v["image"]["width"], 4);
        EXPECT_EQ(v["image"]["colorspace"], 1);
      } else if (v.contains("text")) {
        ++texts;
        EXPECT_EQ(v["text"], nlohmann::json({"rank 0"})) << "only the chief writes";
      }
    }
  }
  EXPECT_EQ(histograms, 1);
  EXPECT_EQ(images, 1);
  EXPECT_EQ(texts, 1);
  // add_scalars: a run per value, as torch.utils.tensorboard makes them.
  EXPECT_EQ(testing_support::read_events(testing_support::event_files(dir + "/tensorboard/ctor_x")).events.size(), 2u)
      << "the file version and the constructor's scalar";
  for (const auto& [run, value] : {std::pair{"pair_a", 1.0}, std::pair{"pair_b", 2.0}}) {
    const auto pair = testing_support::read_events(testing_support::event_files(dir + "/tensorboard/" + run));
    ASSERT_TRUE(pair.ok) << pair.error;
    EXPECT_EQ(testing_support::scalars(pair.events, "pair"), (std::vector<std::pair<std::int64_t, double>>{{10, value}}));
  }
  fs::remove_all(dir);
}

// A resumed run starts its own file with a SessionLog START at its first batch: TensorBoard drops
// what the earlier run wrote from there on.
TEST(TensorBoard, AResumedRunPurgesTheStepsAfterItsCheckpoint) {
  const std::string dir = shared_dir("resume");
  train(base_yaml(4), {}, dir);
  train(base_yaml(6), {}, dir);
  if (!env().is_chief()) return;
  const auto files = testing_support::event_files(dir + "/tensorboard");
  ASSERT_EQ(files.size(), 2u);
  const auto second = testing_support::read_events({files[1]});
  ASSERT_TRUE(second.ok) << second.error;
  ASSERT_GE(second.events.size(), 2u);
  EXPECT_EQ(second.events[1]["session_log"], "START");
  EXPECT_EQ(second.events[1]["step"], 5);
  const auto both = testing_support::read_events(files);
  const auto loss = testing_support::scalars(both.events, "training/loss");
  ASSERT_EQ(loss.size(), 3u);
  EXPECT_EQ(loss[0].first, 2);
  EXPECT_EQ(loss[1].first, 4);
  EXPECT_EQ(loss[2].first, 6);
  fs::remove_all(dir);
}

// Every rank's figures, gathered by the chief at the period, in metrics.jsonl and TensorBoard.
TEST(SystemMetrics, EveryRanksFiguresAppearAtTheirPeriod) {
  const std::string dir = shared_dir("system");
  LinearTrial::Options options;
  options.after_batch = [](LinearTrial&, std::int64_t) { std::this_thread::sleep_for(std::chrono::milliseconds(100)); };
  const auto start = std::chrono::steady_clock::now();
  train(base_yaml(32) + "profiling: {system_metrics_period: 1s}\n", options, dir);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!env().is_chief()) return;
  const auto system = logged(dir, "system");
  const auto& cpu = system.at("rank0/cpu_percent");
  // One sample a second of training (3.2 s of sleeps at least), never more often.
  EXPECT_GE(cpu.size(), 2u);
  EXPECT_LE(static_cast<double>(cpu.size()), seconds + 0.5);
  for (int rank = 0; rank < env().size(); ++rank) {
    for (const char* name : {"cpu_percent", "rss_mb", "read_mbps", "write_mbps"}) {
      const std::string key = "rank" + std::to_string(rank) + "/" + name;
      ASSERT_TRUE(system.count(key)) << key;
      EXPECT_EQ(system.at(key).size(), cpu.size()) << key;
    }
    EXPECT_GT(system.at("rank" + std::to_string(rank) + "/rss_mb").front().second, 1.0);
  }
  for (std::size_t i = 1; i < cpu.size(); ++i) EXPECT_GT(cpu[i].first, cpu[i - 1].first);
  const auto read = testing_support::read_events(testing_support::event_files(dir + "/tensorboard"));
  ASSERT_TRUE(read.ok) << read.error;
  EXPECT_EQ(testing_support::scalars(read.events, "system/rank0/cpu_percent").size(), cpu.size());
  fs::remove_all(dir);
}

std::set<std::string> trace_names(const std::string& path) {
  std::ifstream in(path);
  const auto trace = nlohmann::json::parse(in);  // throws on a trace that is not JSON
  const auto& events = trace.is_array() ? trace : trace.at("traceEvents");
  std::set<std::string> names;
  for (const auto& e : events) names.insert(e.value("name", ""));
  return names;
}

// Every rank is done with `dir`; the chief removes it.
void barrier_then_clean(const std::string& dir) {
  comm::MpiCommunicator(env().world()).barrier();
  if (env().is_chief()) fs::remove_all(dir);
}

TEST(Profiler, EveryRankTracesTheWindowsBatchesOnly) {
  const std::string dir = shared_dir("profiler");
  train(base_yaml(8) + "profiling: {enabled: true, begin_on_batch: 3, end_after_batch: 4}\n", {}, dir);
  const std::string trace = dir + "/tensorboard/traces/rank-" + std::to_string(env().rank()) + ".batches-3-4.json";
  const bool exists = fs::exists(trace);
  const auto permissions = fs::status(trace).permissions() & fs::perms::all;
  const auto names = exists ? trace_names(trace) : std::set<std::string>{};
  barrier_then_clean(dir);
  ASSERT_TRUE(exists) << trace;
  EXPECT_EQ(permissions, fs::perms::owner_read | fs::perms::owner_write);
  for (const char* name : {"batch 3", "batch 4", "dataloader_next", "to_device", "train_batch"}) {
    EXPECT_EQ(names.count(name), 1u) << name;
  }
  EXPECT_EQ(names.count("batch 2"), 0u);
  EXPECT_EQ(names.count("batch 5"), 0u);
  EXPECT_TRUE(std::any_of(names.begin(), names.end(), [](const std::string& n) { return n.rfind("aten::", 0) == 0; }))
      << "LibTorch's operators are recorded";
}

// set_profiler in the trial's constructor chooses the window without the config.
TEST(Profiler, SetProfilerChoosesTheWindow) {
  const std::string dir = shared_dir("set");
  LinearTrial::Options options;
  options.setup = [](LinearTrial& trial) { trial.context_.set_profiler(2, 2); };
  train(base_yaml(4), options, dir);
  const std::string trace = dir + "/tensorboard/traces/rank-" + std::to_string(env().rank()) + ".batches-2-2.json";
  const bool exists = fs::exists(trace);
  const auto names = exists ? trace_names(trace) : std::set<std::string>{};
  barrier_then_clean(dir);
  ASSERT_TRUE(exists) << trace;
  EXPECT_EQ(names.count("batch 2"), 1u);
  EXPECT_EQ(names.count("batch 1"), 0u);
  EXPECT_EQ(names.count("batch 3"), 0u);
}

}  // namespace tensorboard_test
}  // namespace hpctrial::trainer
