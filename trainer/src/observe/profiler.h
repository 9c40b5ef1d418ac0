// The profiler window: batches first..last of a run recorded by LibTorch's profiler into a
// Chrome trace (chrome://tracing, ui.perfetto.dev), with the loop's phases as ranges. Outside the
// window nothing is recorded: the phases see no marker of the profiler, LibTorch no profiler.
#pragma once

#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "observe/metrics_log.h"

namespace at {
class RecordFunction;
}
namespace torch::autograd::profiler {
struct RecordProfile;
}

namespace hpctrial::trainer::detail {

class BatchProfiler : public PhaseMarker {
 public:
  // Records batches first..last (counted from 1) into `trace_path`, marking `timings`' phases.
  BatchProfiler(std::int64_t first, std::int64_t last, std::string trace_path, PhaseTimings& timings);
  ~BatchProfiler() override;  // a window cut short (a stop, a failure) is written as far as it got
  BatchProfiler(const BatchProfiler&) = delete;
  BatchProfiler& operator=(const BatchProfiler&) = delete;

  // Around each batch `batch` (counted from 1) of the loop, with its step boundary.
  void before_batch(std::int64_t batch);
  void after_batch(std::int64_t batch);

  bool recording() const { return profile_ != nullptr; }
  const std::string& trace_path() const { return trace_path_; }

  void begin(const char* phase) override;
  void end() override;

 private:
  void stop();

  std::int64_t first_;
  std::int64_t last_;
  std::string trace_path_;
  PhaseTimings& timings_;
  std::ostringstream trace_;
  std::unique_ptr<torch::autograd::profiler::RecordProfile> profile_;
  std::vector<std::unique_ptr<at::RecordFunction>> open_;  // the batch, then nested phases
  PhaseMarker* previous_ = nullptr;  // the marker outside the window (NVTX's), which still sees each range
  bool done_ = false;
};

}  // namespace hpctrial::trainer::detail
