#include "observe/profiler.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_legacy.h>

#include <filesystem>

#include "hpctrial/core/files.h"
#include "hpctrial/core/logging.h"

namespace hpctrial::trainer::detail {

BatchProfiler::BatchProfiler(std::int64_t first, std::int64_t last, std::string trace_path, PhaseTimings& timings)
    : first_(first), last_(last), trace_path_(std::move(trace_path)), timings_(timings) {}

BatchProfiler::~BatchProfiler() {
  try {
    stop();
  } catch (const std::exception& e) {
    core::log_warning("the profiler's trace {} could not be written: {}", trace_path_, e.what());
  }
}

void BatchProfiler::before_batch(std::int64_t batch) {
  if (done_ || batch < first_ || batch > last_) return;
  if (!profile_) {  // the window's first batch, or the first of a run resumed inside it
    profile_ = std::make_unique<torch::autograd::profiler::RecordProfile>(trace_);
    previous_ = timings_.marker();
    timings_.set_marker(this);
  }
  begin(("batch " + std::to_string(batch)).c_str());
}

void BatchProfiler::after_batch(std::int64_t batch) {
  if (!profile_) return;
  end();  // the batch's range
  if (batch >= last_) stop();
}

void BatchProfiler::begin(const char* phase) {
  auto range = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (range->isActive()) range->before(phase);
  open_.push_back(std::move(range));
  if (previous_ != nullptr) previous_->begin(phase);
}

void BatchProfiler::end() {
  if (open_.empty()) return;
  open_.pop_back();  // RecordFunction's destructor ends the range
  if (previous_ != nullptr) previous_->end();
}

void BatchProfiler::stop() {
  if (!profile_) return;
  while (!open_.empty()) end();  // a window cut short inside a batch
  timings_.set_marker(previous_);
  profile_.reset();  // writes the trace into trace_
  done_ = true;
  core::create_directories(std::filesystem::path(trace_path_).parent_path().string());
  core::write_file_atomic(trace_path_, trace_.str());
  core::log_info("profiler: batches {} to {} traced in {}", first_, last_, trace_path_);
}

}  // namespace hpctrial::trainer::detail
