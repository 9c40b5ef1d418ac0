// Gradient averaging across ranks, as PyTorch DDP's Reducer does it.
//
// The parameters of the wrapped models are laid out, in reverse registration order (roughly
// the order backward produces their gradients), in buckets of about bucket_cap_mb (the first
// bucket smaller, so communication starts early). Each parameter's .grad is a view into its
// bucket, so backward accumulates straight into the buffer that is all-reduced. A post-hook on
// each parameter's gradient accumulator counts the gradients that are ready; when a bucket is
// complete its all-reduce starts on the communicator's background thread, while backward goes
// on with earlier layers. Buckets start in index order on every rank, so the collectives match.
//
//   begin_backward(batch, sync)  before loss.backward(): arms the hooks on sync batches
//   end_backward()               after it: waits for the reductions it started
//   reduce(batch)                in step_optimizer: reduces what is left (parameters that got
//                                no gradient, a backward that did not go through the context),
//                                then divides by aggregation_frequency
//
// The mean costs no pass over the gradients: context.backward divides the loss by ranks x
// aggregation_frequency, so the all-reduce is a plain sum (like Horovod's prescaling). Should
// the trial call loss.backward() itself, the bucket is divided before its reduction instead.
// Gradients that are not zeroed after a step (a second backward in the same batch, as in GANs,
// or auto_zero_grads = false) still hold the mean: it is kept aside, only what the new backward
// added is reduced, and the mean is added back. Compression rounds the (already divided) bucket to 16 bits, sums,
// and widens back.
//
// Only constructed for a world of more than one rank: a single rank does no sync work at all.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "hpctrial/core/experiment_config.h"
#include "hpctrial/comm/communicator.h"

namespace hpctrial::trainer::detail {

// The sum of the squares of the first `count` values of a flat float32 or float64 tensor, in
// double precision: a loop over host memory (a small model's step cannot afford several LibTorch
// calls), LibTorch on a device.
double squared_norm(const torch::Tensor& flat, std::int64_t count);

class GradientSync {
 public:
  struct Options {
    double bucket_cap_mb = 25;
    core::GradientCompression compression = core::GradientCompression::kNone;
    std::int64_t aggregation_frequency = 1;
  };

  // `host` reduces buckets in host memory; `device` (may be null) those on a GPU.
  GradientSync(const std::vector<torch::Tensor>& parameters, comm::Communicator& host,
               comm::Communicator* device, Options options);
  ~GradientSync();
  GradientSync(const GradientSync&) = delete;
  GradientSync& operator=(const GradientSync&) = delete;

  // context.backward multiplies the loss by this: 1 / (ranks x aggregation_frequency).
  double loss_scale() const;
  // Returns whether the caller is to scale the loss by loss_scale(): `prescale`, unless this
  // step's gradients are already unscaled (a create_graph backward, a plain loss.backward()).
  // prescale false (create_graph): the hooks stay disarmed and reduce() averages the gradients.
  bool begin_backward(std::int64_t batch, bool sync, bool prescale = true);
  void end_backward();
  void reduce(std::int64_t batch);
  // The optimizer zeroed these parameters' gradients: their buckets hold no mean any more.
  void zeroed(const std::vector<torch::Tensor>& parameters);

  // The adaptive batch's measurements (adaptive_batch.h). With `on`, each bucket's squared norm
  // is summed just before its all-reduce: this rank's own gradient.
  void measure_norms(bool on) { measure_ = on; }
  // Each parameter's preconditioner, given the parameters (in this sync's order): the norms are
  // then of each gradient divided by its preconditioner, elementwise (AdamScale's, docs/adaptive.md);
  // an undefined tensor leaves that gradient as it is. Asked once a step, as its first bucket is
  // measured: after the previous optimizer step, before this one. Null: the gradients as they are.
  using Preconditioner = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;
  void precondition_norms(Preconditioner preconditioner) { preconditioner_ = std::move(preconditioner); }
  // After reduce(): the squared norm of this rank's own mean gradient - the ranks' mean of it when
  // `averaged` (it travelled with the last bucket), else this rank's alone - and the averaged
  // gradient's; NaN for the first when a bucket was reduced twice in the step. Starts the next.
  struct Norms {
    double local_sqr = 0;
    double global_sqr = 0;
    bool averaged = false;
  };
  Norms take_norms();
  // Seconds the training thread waited for all-reduces since the last call.
  double take_wait_seconds();
  // Seconds spent measuring norms since the last call.
  double take_measure_seconds();
  // The batches a step accumulates from now on (the adaptive batch changes it between steps).
  void set_aggregation_frequency(std::int64_t frequency) { options_.aggregation_frequency = frequency; }

  // Whether `parameter` is one of those synchronised (its TensorImpl).
  bool covers(const torch::Tensor& parameter) const;
  // Bytes per bucket, in launch order (for tests and the benchmark).
  std::vector<std::int64_t> bucket_bytes() const;

 private:
  struct Bucket {
    torch::Tensor flat;     // the gradients, each parameter's .grad a view into it
    std::int64_t grads = 0;  // their number: the last bucket's flat holds one more value
    torch::Tensor staging;  // 16-bit copy when compressing
    std::vector<std::size_t> parameters;
    std::vector<std::int64_t> offsets;
    comm::DType dtype = comm::DType::kFloat32;
    comm::Communicator* communicator = nullptr;
    std::size_t pending = 0;  // parameters not yet ready in this armed backward
    bool clean = false;       // reduced, and no gradient added since
    int reductions_in_batch = 0;
    bool holds_mean = false;  // reduced, and not zeroed since
    torch::Tensor snapshot;   // that mean, kept aside while new gradients are added
    comm::WorkHandle work;
  };
  class ReadyHook;

  void on_gradient_ready(std::size_t parameter);
  void launch(Bucket& bucket);
  void complete(Bucket& bucket);
  void attach_views();
  void start_batch(std::int64_t batch);
  // The squared norm of a bucket's gradients, preconditioned when asked to.
  double measured_norm(const Bucket& bucket);

  std::vector<torch::Tensor> parameters_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<std::uintptr_t> hook_keys_;
  std::vector<std::size_t> bucket_of_;
  std::unordered_map<const void*, std::size_t> index_of_;
  std::vector<Bucket> buckets_;
  Options options_;
  int world_size_ = 1;

  std::mutex mutex_;  // hooks may run on autograd's device threads
  bool armed_ = false;
  bool in_context_ = false;     // inside context.backward: the loss was scaled
  bool scaled_seen_ = false;    // since the last reduce(): gradients from context.backward
  bool unscaled_seen_ = false;  // ... and from loss.backward() called directly
  std::size_t next_launch_ = 0;
  std::int64_t batch_ = -1;
  bool measure_ = false;
  bool carrier_ = false;  // the last bucket carries the ranks' norms
  double local_sqr_ = 0;
  Preconditioner preconditioner_;
  std::vector<torch::Tensor> preconditioners_;  // this step's, one per parameter
  bool preconditioned_ = false;                 // preconditioners_ holds this step's
  double wait_seconds_ = 0;
  double measure_seconds_ = 0;
};

}  // namespace hpctrial::trainer::detail
