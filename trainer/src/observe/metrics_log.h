// What the user sees of a running trial: metrics.jsonl, progress lines, phase timings.
// Internal to the trainer; no LibTorch.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "hpctrial/trainer/metric_value.h"

namespace hpctrial::tensorboard {
class EventWriter;
}

namespace hpctrial::trainer::detail {

// Appends one JSON object per line to <trial dir>/metrics.jsonl (mode 0600). Each line is one
// write(2), so a crash never leaves half a line followed by more data. With an event file, each
// metric also goes to TensorBoard as the scalar "<kind>/<name>" at step `batches`.
class MetricsLog {
 public:
  explicit MetricsLog(const std::string& path);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  // {"kind": kind, "batches": .., "epoch": .., "records": .., "time": "...Z", "metrics": {..}}.
  // In TensorBoard a number is a scalar "kind/name"; a metric of several numbers is one scalar
  // per element, "kind/name/i/j" (an array's indices, an object's keys); text is not written.
  void write(const std::string& kind, std::int64_t batches, std::int64_t epoch,
             std::int64_t records, const MetricValues& metrics,
             const nlohmann::json& extra = nullptr);
  // Flushes what was written to disk.
  void sync();
  // Null: metrics.jsonl only. `enabled`, when given, is asked at each write whether the metrics
  // go to the event files too (TrialContext::get_enable_tensorboard_logging).
  void set_events(tensorboard::EventWriter* events, std::function<bool()> enabled = {}) {
    events_ = events;
    events_enabled_ = std::move(enabled);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  tensorboard::EventWriter* events_ = nullptr;
  std::function<bool()> events_enabled_;
};

// Marks the phases as they run, where a profiler records them (profiler.h).
class PhaseMarker {
 public:
  virtual ~PhaseMarker() = default;
  virtual void begin(const char* phase) = 0;
  virtual void end() = 0;
};

// Time spent in each phase of the loop (dataloader_next, to_device, train_batch, ...).
class PhaseTimings {
 public:
  using Clock = std::chrono::steady_clock;

  class Scope {
   public:
    Scope(PhaseTimings& timings, const char* phase)
        : timings_(timings), phase_(phase), marker_(timings.marker_), start_(Clock::now()) {
      if (marker_ != nullptr) marker_->begin(phase);
    }
    ~Scope() {
      timings_.add(phase_, Clock::now() - start_);
      if (marker_ != nullptr && marker_ == timings_.marker_) marker_->end();
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    PhaseTimings& timings_;
    const char* phase_;
    PhaseMarker* marker_;
    Clock::time_point start_;
  };

  // A view, not a string: a Scope's phase is a literal, and a name over 15 characters would be
  // an allocation every step.
  void add(std::string_view phase, Clock::duration elapsed);
  // The seconds spent in `phase` so far (0 before it ran).
  double total_s(const std::string& phase) const;
  // Null: no marker (outside a profiler window).
  void set_marker(PhaseMarker* marker) { marker_ = marker; }
  PhaseMarker* marker() const { return marker_; }
  // Each phase's mean milliseconds since the last call (the phases that ran since), in loop order.
  std::vector<std::pair<std::string, double>> period_means_ms();
  // {"train_batch": {"total_s": .., "mean_ms": .., "count": ..}, ...}, phases in loop order.
  nlohmann::json summary() const;
  // A table for the end of the log.
  std::string table() const;

 private:
  struct Phase {
    std::string name;
    double total_s = 0;
    std::int64_t count = 0;
    double reported_s = 0;  // total_s and count at the last period_means_ms()
    std::int64_t reported_count = 0;
  };
  std::vector<Phase> phases_;
  PhaseMarker* marker_ = nullptr;
};

// Progress lines on stderr, at most one every `interval`: in place with '\r' on a terminal,
// one line each otherwise (Slurm output files).
class Progress {
 public:
  Progress(std::int64_t total_batches, std::int64_t global_batch_size, double interval_s, bool enabled);
  void update(std::int64_t batches, std::int64_t epoch, double loss, bool force = false);
  void finish();
  // A run that goes on past its first end (a search's trial promoted in place).
  void set_total(std::int64_t total_batches) { total_ = total_batches; }

 private:
  std::int64_t total_;
  std::int64_t global_batch_size_;
  double interval_s_;
  bool enabled_;
  bool tty_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_;
  std::int64_t last_batches_ = 0;
  bool printed_ = false;
};

std::string iso_time_now();

}  // namespace hpctrial::trainer::detail
