// What the user sees of a running trial: metrics.jsonl, progress lines, phase timings.
// Internal to the trainer; no LibTorch.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace hpctrial::trainer::detail {

// Appends one JSON object per line to <trial dir>/metrics.jsonl (mode 0600). Each line is one
// write(2), so a crash never leaves half a line followed by more data.
class MetricsLog {
 public:
  explicit MetricsLog(const std::string& path);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  // {"kind": kind, "batches": .., "epoch": .., "records": .., "time": "...Z", "metrics": {..}}
  void write(const std::string& kind, std::int64_t batches, std::int64_t epoch,
             std::int64_t records, const std::map<std::string, double>& metrics,
             const nlohmann::json& extra = nullptr);
  // Flushes what was written to disk.
  void sync();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// Time spent in each phase of the loop (dataloader_next, to_device, train_batch, ...).
class PhaseTimings {
 public:
  using Clock = std::chrono::steady_clock;

  class Scope {
   public:
    Scope(PhaseTimings& timings, const char* phase) : timings_(timings), phase_(phase), start_(Clock::now()) {}
    ~Scope() { timings_.add(phase_, Clock::now() - start_); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    PhaseTimings& timings_;
    const char* phase_;
    Clock::time_point start_;
  };

  void add(const std::string& phase, Clock::duration elapsed);
  // {"train_batch": {"total_s": .., "mean_ms": .., "count": ..}, ...}, phases in loop order.
  nlohmann::json summary() const;
  // A table for the end of the log.
  std::string table() const;

 private:
  struct Phase {
    std::string name;
    double total_s = 0;
    std::int64_t count = 0;
  };
  std::vector<Phase> phases_;
};

// Progress lines on stderr, at most one every `interval`: in place with '\r' on a terminal,
// one line each otherwise (Slurm output files).
class Progress {
 public:
  Progress(std::int64_t total_batches, std::int64_t global_batch_size, double interval_s, bool enabled);
  void update(std::int64_t batches, std::int64_t epoch, double loss, bool force = false);
  void finish();

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
