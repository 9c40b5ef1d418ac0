#include "parallel/gradient_sync.h"

#include <chrono>
#include <limits>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>
#include <optional>

#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "state/state_io.h"

namespace hpctrial::trainer::detail {
namespace {

// The sum of squares of the first `count` values of a flat bucket, in double precision: by a loop
// over host memory (a step of a small model cannot afford several LibTorch calls), by LibTorch
// on a device.
template <typename T>
double sum_of_squares(const T* values, std::int64_t count) {
  double sums[4] = {0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    for (int k = 0; k < 4; ++k) sums[k] += static_cast<double>(values[i + k]) * static_cast<double>(values[i + k]);
  }
  for (; i < count; ++i) sums[0] += static_cast<double>(values[i]) * static_cast<double>(values[i]);
  return (sums[0] + sums[1]) + (sums[2] + sums[3]);
}

}  // namespace

double squared_norm(const torch::Tensor& flat, std::int64_t count) {
  if (flat.is_cpu() && flat.scalar_type() == torch::kFloat32) return sum_of_squares(flat.data_ptr<float>(), count);
  if (flat.is_cpu() && flat.scalar_type() == torch::kFloat64) return sum_of_squares(flat.data_ptr<double>(), count);
  const torch::Tensor values = flat.narrow(0, 0, count);
  return torch::dot(values, values).item<double>();
}

namespace {

// One value of a flat bucket, read or written.
double value_at(const torch::Tensor& flat, std::int64_t index) {
  if (flat.is_cpu() && flat.scalar_type() == torch::kFloat32) return flat.data_ptr<float>()[index];
  if (flat.is_cpu() && flat.scalar_type() == torch::kFloat64) return flat.data_ptr<double>()[index];
  return flat.narrow(0, index, 1).item<double>();
}

void set_value(torch::Tensor& flat, std::int64_t index, double value) {
  if (flat.is_cpu() && flat.scalar_type() == torch::kFloat32) {
    flat.data_ptr<float>()[index] = static_cast<float>(value);
  } else if (flat.is_cpu() && flat.scalar_type() == torch::kFloat64) {
    flat.data_ptr<double>()[index] = value;
  } else {
    flat.narrow(0, index, 1).fill_(value);
  }
}

using comm::DType;
using comm::ReduceOp;

constexpr double kMiB = 1024.0 * 1024.0;
// As in DDP, the first bucket is small, so that the first all-reduce starts early in backward.
constexpr double kFirstBucketMb = 1.0;

// The DType of a parameter's gradients, refusing types MPI cannot average.
DType dtype_of(c10::ScalarType type) {
  const std::optional<DType> dtype = to_dtype(type);
  if (dtype == DType::kFloat32 || dtype == DType::kFloat64 || dtype == DType::kFloat16 || dtype == DType::kBFloat16) {
    return *dtype;
  }
  throw NotSupported(std::string("averaging gradients of type ") + c10::toString(type) +
                     " across ranks; parameters must be float32, float64, float16 or bfloat16");
}

// The parameters' indices grouped into buckets of about `bucket_cap_mb`, in launch order.
std::vector<std::vector<std::size_t>> group_into_gradient_buckets(const std::vector<torch::Tensor>& parameters,
                                                                  double bucket_cap_mb) {
  struct Open {
    std::vector<std::size_t> parameters;
    double bytes = 0;
  };
  // Fill buckets walking the parameters backwards, one open bucket per (dtype, device).
  std::map<std::pair<int, std::string>, Open> open;
  std::vector<std::vector<std::size_t>> closed;
  const double cap = bucket_cap_mb * kMiB;
  for (std::size_t k = parameters.size(); k-- > 0;) {
    const torch::Tensor& p = parameters[k];
    dtype_of(p.scalar_type());  // refuses types MPI cannot average, before anything is built
    Open& bucket = open[{static_cast<int>(p.scalar_type()), p.device().str()}];
    const double limit = closed.empty() ? std::min(cap, kFirstBucketMb * kMiB) : cap;
    if (!bucket.parameters.empty() && bucket.bytes + static_cast<double>(p.nbytes()) > limit) {
      closed.push_back(std::move(bucket.parameters));
      bucket = Open{};
    }
    bucket.parameters.push_back(k);
    bucket.bytes += static_cast<double>(p.nbytes());
  }
  for (auto& [key, bucket] : open) {
    if (!bucket.parameters.empty()) closed.push_back(std::move(bucket.parameters));
  }
  // Launch order: the bucket whose first parameter comes earliest in backward goes first.
  std::sort(closed.begin(), closed.end(), [](const auto& a, const auto& b) { return a.front() > b.front(); });
  return closed;
}

}  // namespace

// Runs after autograd has accumulated a parameter's gradient into its .grad.
class GradientSync::ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(GradientSync* sync, std::size_t index) : sync_(sync), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    sync_->on_gradient_ready(index_);
    return outputs;
  }

 private:
  GradientSync* sync_;
  std::size_t index_;
};

GradientSync::GradientSync(const std::vector<torch::Tensor>& parameters, comm::Communicator& host,
                           comm::Communicator* device, Options options)
    : options_(options), world_size_(host.size()) {
  for (const auto& p : parameters) {
    if (!p.requires_grad() || p.numel() == 0) continue;
    if (!index_of_.emplace(p.unsafeGetTensorImpl(), parameters_.size()).second) continue;  // shared
    parameters_.push_back(p);
  }
  bucket_of_.assign(parameters_.size(), 0);

  std::vector<std::vector<std::size_t>> closed = group_into_gradient_buckets(parameters_, options_.bucket_cap_mb);
  for (auto& members : closed) {
    Bucket bucket;
    const torch::Tensor& first = parameters_[members.front()];
    bucket.dtype = dtype_of(first.scalar_type());
    std::int64_t numel = 0;
    for (std::size_t k : members) {
      bucket.offsets.push_back(numel);
      numel += parameters_[k].numel();
      bucket_of_[k] = buckets_.size();
    }
    bucket.parameters = std::move(members);
    bucket.grads = numel;
    bucket.flat = torch::zeros({numel}, first.options().requires_grad(false));
    if (first.device().is_cpu()) {
      bucket.communicator = &host;
    } else if (device != nullptr) {
      bucket.communicator = device;
    } else {
      throw NotSupported("gradients on " + first.device().str() +
                         " need a device communicator (NCCL), and this build has none; train on the "
                         "CPU (resources.gpus_per_slot: 0) or build hpctrial with CUDA and NCCL");
    }
    const bool floating32 = bucket.dtype == DType::kFloat32 || bucket.dtype == DType::kFloat64;
    if (floating32 && options_.compression != core::GradientCompression::kNone) {
      const auto type = options_.compression == core::GradientCompression::kFloat16 ? torch::kFloat16 : torch::kBFloat16;
      bucket.staging = torch::empty({numel}, bucket.flat.options().dtype(type));
    }
    buckets_.push_back(std::move(bucket));
  }
  // The last bucket launched carries one more value, uncompressed: this rank's squared gradient
  // norm when the adaptive batch measures it, so that the ranks' mean needs no collective of its own.
  if (!buckets_.empty()) {  // none when every model's gradients are averaged elsewhere (ZeRO)
    Bucket& last = buckets_.back();
    if (!last.staging.defined() && (last.dtype == DType::kFloat32 || last.dtype == DType::kFloat64)) {
      last.flat = torch::zeros({last.grads + 1}, last.flat.options());
      carrier_ = true;
    }
  }
  // Gradients that exist already came from a backward we did not scale.
  unscaled_seen_ = std::any_of(parameters_.begin(), parameters_.end(), [](const torch::Tensor& p) { return p.grad().defined(); });
  attach_views();
  for (std::size_t k = 0; k < parameters_.size(); ++k) {
    auto accumulator = torch::autograd::impl::grad_accumulator(parameters_[k]);
    hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<ReadyHook>(this, k)));
    accumulators_.push_back(std::move(accumulator));  // keeps the accumulator, and so the hook, alive
  }
  std::string sizes;
  for (const auto& b : buckets_) sizes += (sizes.empty() ? "" : ", ") + fmt::format("{:.2f}", b.flat.nbytes() / kMiB);
  core::log_debug("gradients of {} parameters in {} bucket(s) of {} MiB", parameters_.size(), buckets_.size(), sizes);
}

GradientSync::~GradientSync() {
  for (std::size_t k = 0; k < accumulators_.size(); ++k) accumulators_[k]->del_post_hook(hook_keys_[k]);
  for (auto& bucket : buckets_) {
    if (!bucket.work) continue;
    try {
      bucket.work->wait();
    } catch (const std::exception& e) {
      core::log_warning("a gradient all-reduce failed while shutting down: {}", e.what());
    }
  }
}

void GradientSync::attach_views() {
  torch::NoGradGuard no_grad;  // a gradient made with create_graph is copied, not differentiated
  for (auto& bucket : buckets_) {
    for (std::size_t j = 0; j < bucket.parameters.size(); ++j) {
      torch::Tensor& p = parameters_[bucket.parameters[j]];
      torch::Tensor& grad = p.mutable_grad();
      auto* const start = static_cast<char*>(bucket.flat.data_ptr()) + bucket.offsets[j] * bucket.flat.element_size();
      if (grad.defined() && grad.data_ptr() == start && grad.sizes() == p.sizes() && grad.is_contiguous()) continue;
      // Shares the bucket's storage without being an autograd view, so that zero_grad's
      // detach_() works on it.
      torch::Tensor view = torch::empty({0}, bucket.flat.options())
                               .set_(bucket.flat.storage(), bucket.offsets[j], p.sizes(), c10::contiguous_strides(p.sizes()));
      if (grad.defined()) {
        view.copy_(grad);
      } else {
        view.zero_();
      }
      grad = view;
    }
  }
}

void GradientSync::start_batch(std::int64_t batch) {
  if (batch == batch_) return;
  batch_ = batch;
  for (auto& bucket : buckets_) {
    bucket.reductions_in_batch = 0;
  }
  // A step that measured and never took its norms (an exception in between) leaves nothing stale.
  preconditioned_ = false;
  preconditioners_.clear();
}

bool GradientSync::begin_backward(std::int64_t batch, bool sync, bool prescale) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Once a backward of this step left unscaled gradients, the step's later ones are unscaled too.
  const bool scaled = prescale && !unscaled_seen_;
  if (!scaled && scaled_seen_) {
    throw ConfigError("context.backward(..., create_graph = true) after another backward in the same step: the "
                      "first gradients were already divided by the number of ranks; make the create_graph "
                      "backward the first of the step, or use torch::autograd::grad(..., create_graph = true) "
                      "for the gradients you differentiate");
  }
  start_batch(batch);
  for (auto& bucket : buckets_) {
    complete(bucket);
    // Still holding a mean (a second backward in the batch, as in GANs, or gradients the trial
    // does not zero): keep it aside, so that only what this backward adds is reduced.
    if (bucket.holds_mean && !bucket.snapshot.defined()) bucket.snapshot = bucket.flat.clone();
  }
  attach_views();
  in_context_ = scaled;
  // A backward that creates a graph replaces .grad with new tensors: nothing is in the buckets
  // until reduce() copies it there.
  armed_ = sync && prescale;
  next_launch_ = 0;
  for (auto& bucket : buckets_) bucket.pending = armed_ ? bucket.parameters.size() : 0;
  return scaled;
}

void GradientSync::end_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  armed_ = false;
  in_context_ = false;
  for (auto& bucket : buckets_) complete(bucket);
}

void GradientSync::on_gradient_ready(std::size_t parameter) {
  std::lock_guard<std::mutex> lock(mutex_);
  (in_context_ ? scaled_seen_ : unscaled_seen_) = true;
  Bucket& bucket = buckets_[bucket_of_[parameter]];
  bucket.clean = false;
  if (!armed_ || bucket.pending == 0) return;
  if (--bucket.pending > 0) return;
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) launch(buckets_[next_launch_++]);
}

void GradientSync::launch(Bucket& bucket) {
  torch::NoGradGuard no_grad;
  if (++bucket.reductions_in_batch > 1 && options_.aggregation_frequency > 1) {
    throw NotSupported("several backward passes in one batch with optimizations.aggregation_frequency > 1; "
                       "call context.backward once per batch, or set aggregation_frequency: 1");
  }
  if (bucket.holds_mean) {
    if (!bucket.snapshot.defined()) {
      throw ConfigError("gradients were added to averaged ones that were not zeroed, by a backward pass "
                        "outside context.backward(loss); call context.backward for every backward pass");
    }
    bucket.flat.sub_(bucket.snapshot);  // only what was added since the last reduction
  }
  if (unscaled_seen_) {
    // loss.backward() called directly: the loss was not divided, so the gradients are.
    bucket.flat.div_(static_cast<double>(world_size_ * options_.aggregation_frequency));
  }
  bucket.clean = true;
  if (measure_) {
    // This rank's share of the mean: its own gradient divided by the ranks.
    const auto started = std::chrono::steady_clock::now();
    local_sqr_ += bucket.reductions_in_batch > 1 || bucket.snapshot.defined()
                      ? std::numeric_limits<double>::quiet_NaN()
                      : measured_norm(bucket);
    // The last bucket: every rank's norm travels in its extra value, summed with the gradients.
    if (carrier_ && &bucket == &buckets_.back()) {
      set_value(bucket.flat, bucket.grads, local_sqr_ / static_cast<double>(world_size_));
    }
    measure_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }
  const auto count = static_cast<std::size_t>(bucket.flat.numel());
  // The gradients are already divided by the number of ranks (and aggregated batches), so a
  // sum is their mean - with no pass over the buffer - and 16-bit rounding cannot overflow.
  if (bucket.staging.defined()) {
    bucket.staging.copy_(bucket.flat);
    const DType narrow = dtype_of(bucket.staging.scalar_type());
    bucket.work = bucket.communicator->allreduce_async(bucket.staging.data_ptr(), count, narrow, ReduceOp::kSum);
  } else {
    bucket.work = bucket.communicator->allreduce_async(bucket.flat.data_ptr(), count, bucket.dtype, ReduceOp::kSum);
  }
}

void GradientSync::complete(Bucket& bucket) {
  if (!bucket.work) return;
  comm::WorkHandle work = std::move(bucket.work);
  bucket.work.reset();
  const auto started = std::chrono::steady_clock::now();
  work->wait();
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  torch::NoGradGuard no_grad;
  if (bucket.staging.defined()) bucket.flat.copy_(bucket.staging);
  if (bucket.snapshot.defined()) {
    bucket.flat.add_(bucket.snapshot);
    bucket.snapshot = torch::Tensor();
  }
  bucket.holds_mean = true;
}

GradientSync::Norms GradientSync::take_norms() {
  torch::NoGradGuard no_grad;
  const auto started = std::chrono::steady_clock::now();
  Norms norms;
  for (const auto& bucket : buckets_) norms.global_sqr += measured_norm(bucket);
  const double world = static_cast<double>(world_size_);
  if (carrier_) {
    // The ranks' norms, summed with the last bucket: their mean.
    norms.local_sqr = value_at(buckets_.back().flat, buckets_.back().grads) * world * world;
    norms.averaged = true;
  } else {
    norms.local_sqr = local_sqr_ * world * world;
  }
  local_sqr_ = 0;
  preconditioned_ = false;
  preconditioners_.clear();  // as large as the model: not kept through the optimizer's step
  measure_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return norms;
}

double GradientSync::measured_norm(const Bucket& bucket) {
  if (!preconditioner_) return squared_norm(bucket.flat, bucket.grads);
  if (!preconditioned_) {
    preconditioners_ = preconditioner_(parameters_);
    if (preconditioners_.size() != parameters_.size()) {
      throw InternalError("a gradient preconditioner for " + std::to_string(preconditioners_.size()) +
                          " parameters, not " + std::to_string(parameters_.size()));
    }
    preconditioned_ = true;
  }
  // Summed on the bucket's device and read once (one synchronisation a bucket, not a parameter),
  // in float32 at least: a 16-bit gradient squared may overflow.
  torch::Tensor sum = torch::zeros({}, bucket.flat.options().dtype(torch::kFloat64));
  for (std::size_t k = 0; k < bucket.parameters.size(); ++k) {
    const std::size_t i = bucket.parameters[k];
    torch::Tensor grad = bucket.flat.narrow(0, bucket.offsets[k], parameters_[i].numel());
    if (grad.scalar_type() != torch::kFloat64) grad = grad.to(torch::kFloat32);
    const torch::Tensor& divisor = preconditioners_[i];
    const torch::Tensor scaled = divisor.defined() ? grad / divisor.reshape({-1}) : grad;
    sum += scaled.pow(2).sum(torch::kFloat64);
  }
  return sum.item<double>();
}

double GradientSync::take_wait_seconds() { return std::exchange(wait_seconds_, 0.0); }

double GradientSync::take_measure_seconds() { return std::exchange(measure_seconds_, 0.0); }

void GradientSync::zeroed(const std::vector<torch::Tensor>& parameters) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<bool> zero(parameters_.size(), false);
  for (const auto& p : parameters) {
    const auto it = index_of_.find(p.unsafeGetTensorImpl());
    if (it != index_of_.end()) zero[it->second] = true;
  }
  for (auto& bucket : buckets_) {
    if (std::all_of(bucket.parameters.begin(), bucket.parameters.end(), [&](std::size_t k) { return zero[k]; })) {
      bucket.holds_mean = false;
    }
  }
}

void GradientSync::reduce(std::int64_t batch) {
  std::lock_guard<std::mutex> lock(mutex_);
  start_batch(batch);
  armed_ = false;
  for (auto& bucket : buckets_) complete(bucket);
  if (scaled_seen_ && unscaled_seen_) {
    throw ConfigError("gradients came both from context.backward(loss) and from loss.backward() since the "
                      "last optimizer step; call context.backward for every backward pass");
  }
  attach_views();  // picks up gradients that a backward outside the context put elsewhere
  // Every bucket is reduced once per sync batch on every rank, in index order, whether or not
  // its gradients arrived here (a parameter unused on one rank must still match the others);
  // again only if gradients were added after its reduction.
  for (auto& bucket : buckets_) {
    if (bucket.reductions_in_batch == 0 || !bucket.clean) launch(bucket);
  }
  for (auto& bucket : buckets_) complete(bucket);
  scaled_seen_ = unscaled_seen_ = false;
}

double GradientSync::loss_scale() const {
  return 1.0 / static_cast<double>(world_size_ * options_.aggregation_frequency);
}

bool GradientSync::covers(const torch::Tensor& parameter) const {
  return index_of_.count(parameter.unsafeGetTensorImpl()) != 0;
}

std::vector<std::int64_t> GradientSync::bucket_bytes() const {
  std::vector<std::int64_t> out;
  for (const auto& bucket : buckets_) out.push_back(bucket.grads * static_cast<std::int64_t>(bucket.flat.element_size()));
  return out;
}

}  // namespace hpctrial::trainer::detail
