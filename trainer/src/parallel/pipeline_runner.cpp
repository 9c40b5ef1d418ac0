#include "parallel/pipeline_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "hpctrial/core/error.h"
#include "parallel/autocast.h"
#include "parallel/pipeline_plan.h"
#include "state/state_io.h"

namespace hpctrial::trainer::detail {
namespace {

constexpr std::size_t kMaxDims = 6;

// Adds the seconds from its construction to its end to `total`.
class Stopwatch {
 public:
  explicit Stopwatch(double& total) : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~Stopwatch() { total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
  Stopwatch(const Stopwatch&) = delete;
  Stopwatch& operator=(const Stopwatch&) = delete;

 private:
  double& total_;
  std::chrono::steady_clock::time_point start_;
};

std::string describe(const std::vector<std::int64_t>& sizes) {
  std::string out;
  for (const auto size : sizes) out += (out.empty() ? "" : ", ") + std::to_string(size);
  return "[" + out + "]";
}

comm::DType message_dtype(c10::ScalarType type) {
  const auto dtype = to_dtype(type);
  if (!dtype) {
    throw ConfigError(std::string("a pipeline stage's output is of type ") + c10::toString(type) +
                      ", which cannot travel between stages; return a floating-point or integer tensor");
  }
  return *dtype;
}

}  // namespace

PipelineRunner::PipelineRunner(PipelineModuleImpl& module, comm::Communicator& pipe)
    : module_(module), pipe_(pipe), stage_(pipe.rank()), stages_(pipe.size()) {
  if (stages_ != module.stages() || stage_ != module.stage()) {
    throw InternalError("the pipe's rank " + std::to_string(stage_) + " of " + std::to_string(stages_) +
                        " runs stage " + std::to_string(module.stage()) + " of " + std::to_string(module.stages()));
  }
  const auto parameters = module.parameters();
  if (!parameters.empty()) device_ = parameters.front().device();
  // The pairs of neighbours across even boundaries (stages 0-1, 2-3, ...) and across odd ones
  // (1-2, 3-4, ...): each pair has a communicator for activations and one for gradients.
  for (int parity = 0; parity < 2; ++parity) {
    const int color = (stage_ + parity) / 2;
    links_.push_back(pipe.split(color, stage_));
    comm::Communicator* down = links_.back().get();
    links_.push_back(pipe.split(color, stage_));
    comm::Communicator* up = links_.back().get();
    if (stage_ + 1 < stages_ && stage_ % 2 == parity) {
      activations_out_ = {down, 1};
      gradients_in_ = {up, 1};
    }
    if (stage_ > 0 && (stage_ - 1) % 2 == parity) {
      activations_in_ = {down, 0};
      gradients_out_ = {up, 0};
    }
  }
}

PipelineRunner::~PipelineRunner() = default;

void PipelineRunner::check_batch(const std::vector<torch::Tensor>& inputs, const std::vector<torch::Tensor>& targets,
                                 std::int64_t micro_batches) const {
  const auto count = static_cast<std::size_t>(micro_batches);
  if (micro_batches < 1 || (stage_ == 0 && inputs.size() != count) ||
      (stage_ == stages_ - 1 && targets.size() != count)) {
    throw InternalError("pipeline stage " + std::to_string(stage_) + " was given " + std::to_string(inputs.size()) +
                        " inputs and " + std::to_string(targets.size()) + " targets for " +
                        std::to_string(micro_batches) + " micro-batches");
  }
}

void PipelineRunner::send_shape(Link& link, const torch::Tensor& tensor) {
  if (static_cast<std::size_t>(tensor.dim()) > kMaxDims) {
    throw ConfigError("pipeline stage " + std::to_string(stage_) + " returns a tensor of " +
                      std::to_string(tensor.dim()) + " dimensions; between stages at most " +
                      std::to_string(kMaxDims) + " travel (reshape it in the next stage's first layer)");
  }
  auto header = torch::zeros({2 + static_cast<std::int64_t>(kMaxDims)}, torch::kInt64);
  auto* values = header.data_ptr<std::int64_t>();
  values[0] = static_cast<std::int64_t>(message_dtype(tensor.scalar_type()));
  values[1] = tensor.dim();
  for (std::int64_t d = 0; d < tensor.dim(); ++d) values[2 + d] = tensor.size(d);
  send(link, header.to(tensor.device()));
}

PipelineRunner::Shape PipelineRunner::receive_shape(Link& link) {
  std::vector<torch::Tensor> none;
  Shape header_shape{{2 + static_cast<std::int64_t>(kMaxDims)}, c10::ScalarType::Long};
  Incoming incoming = post_receive(link, header_shape, none);
  const torch::Tensor header = take(incoming).cpu();
  const auto* values = header.data_ptr<std::int64_t>();
  Shape shape;
  shape.type = to_scalar_type(static_cast<core::DType>(values[0]));
  shape.sizes.assign(values + 2, values + 2 + values[1]);
  return shape;
}

void PipelineRunner::send(Link& link, const torch::Tensor& tensor) {
  const torch::Tensor data = tensor.contiguous();
  auto work = link.comm->send_async(data.data_ptr(), static_cast<std::size_t>(data.numel()),
                                    message_dtype(data.scalar_type()), link.peer);
  sends_.emplace_back(data, std::move(work));
}

PipelineRunner::Incoming PipelineRunner::post_receive(Link& link, const Shape& shape, std::vector<torch::Tensor>& pool) {
  Incoming incoming;
  if (!pool.empty()) {
    incoming.buffer = std::move(pool.back());
    pool.pop_back();
  } else {
    incoming.buffer = torch::empty(shape.sizes, torch::TensorOptions().dtype(shape.type).device(device_));
  }
  incoming.work = link.comm->recv_async(incoming.buffer.data_ptr(), static_cast<std::size_t>(incoming.buffer.numel()),
                                        message_dtype(shape.type), link.peer);
  return incoming;
}

torch::Tensor PipelineRunner::take(Incoming& incoming) {
  incoming.work->wait();
  incoming.work.reset();
  return std::move(incoming.buffer);
}

double PipelineRunner::train(const std::vector<torch::Tensor>& inputs, const std::vector<torch::Tensor>& targets,
                             std::int64_t micro_batches) {
  check_batch(inputs, targets, micro_batches);
  const auto count = static_cast<std::size_t>(micro_batches);
  micro_batches_ = micro_batches;
  stage_inputs_.assign(count, {});
  outputs_.assign(count, {});
  loss_sum_ = 0;
  compute_seconds_ = 0;
  held_ = peak_in_flight_ = 0;
  activations_posted_ = gradients_posted_ = 0;
  if (stage_ > 0) {
    if (!input_agreed_) {
      input_shape_ = receive_shape(activations_in_);
      input_agreed_ = true;
    }
    next_activation_ = post_receive(activations_in_, input_shape_, activation_pool_);
    activations_posted_ = 1;
  }
  for (const auto& op : schedule_1f1b(stages_, stage_, micro_batches)) {
    if (op.kind == PipeOp::Kind::kForward) {
      forward(op.micro_batch, inputs, targets);
    } else {
      backward(op.micro_batch);
    }
  }
  return finish(loss_sum_, micro_batches);
}

void PipelineRunner::forward(std::int64_t micro, const std::vector<torch::Tensor>& inputs,
                             const std::vector<torch::Tensor>& targets) {
  const auto index = static_cast<std::size_t>(micro);
  torch::Tensor input;
  if (stage_ == 0) {
    input = inputs[index];
  } else {
    input = take(next_activation_);
    if (activations_posted_ < micro_batches_) {
      next_activation_ = post_receive(activations_in_, input_shape_, activation_pool_);
      ++activations_posted_;
    }
    input.requires_grad_(true);
  }
  stage_inputs_[index] = input;
  peak_in_flight_ = std::max(peak_in_flight_, ++held_);
  torch::Tensor output;
  {
    const Stopwatch compute(compute_seconds_);
    output = module_.forward(input);
    if (stage_ == stages_ - 1) outputs_[index] = module_.loss(output, targets[index]);
  }
  if (stage_ == stages_ - 1) {
    loss_sum_ += outputs_[index].detach().item<double>();
    return;
  }
  if (!output_agreed_) {
    output_shape_ = {output.sizes().vec(), output.scalar_type()};
    send_shape(activations_out_, output);
    output_agreed_ = true;
  } else if (output.sizes().vec() != output_shape_.sizes || output.scalar_type() != output_shape_.type) {
    throw ConfigError("pipeline stage " + std::to_string(stage_) + " returned " + describe(output.sizes().vec()) +
                      " for micro-batch " + std::to_string(micro) + ", not " + describe(output_shape_.sizes) +
                      " as at its first; the activations between stages keep one shape and type (pad the "
                      "inputs to one length, and drop or pad a last short batch)");
  }
  outputs_[index] = output;
  send(activations_out_, output.detach());
  if (gradients_posted_ == 0) {
    next_gradient_ = post_receive(gradients_in_, output_shape_, gradient_pool_);
    gradients_posted_ = 1;
  }
}

void PipelineRunner::backward(std::int64_t micro) {
  const AutocastPause pause;  // backward runs in the types forward chose
  const auto index = static_cast<std::size_t>(micro);
  if (stage_ == stages_ - 1) {
    const Stopwatch compute(compute_seconds_);
    (outputs_[index] / static_cast<double>(micro_batches_)).backward();
  } else {
    torch::Tensor gradient = take(next_gradient_);
    if (gradients_posted_ < micro_batches_) {
      next_gradient_ = post_receive(gradients_in_, output_shape_, gradient_pool_);
      ++gradients_posted_;
    }
    {
      const Stopwatch compute(compute_seconds_);
      outputs_[index].backward(gradient);
    }
    gradient_pool_.push_back(std::move(gradient));
  }
  if (stage_ > 0) {
    torch::Tensor input = std::move(stage_inputs_[index]);
    if (!input.grad().defined()) {
      throw ConfigError("pipeline stage " + std::to_string(stage_) +
                        "'s output does not depend on its input, so no gradient can go back to stage " +
                        std::to_string(stage_ - 1));
    }
    send(gradients_out_, input.grad());
    input.mutable_grad().reset();
    input.requires_grad_(false);
    activation_pool_.push_back(std::move(input));
  }
  stage_inputs_[index] = torch::Tensor();
  outputs_[index] = torch::Tensor();
  --held_;
  // Sends that are done give their tensors back; the rest stay alive until they are.
  while (!sends_.empty() && sends_.front().second->wait(std::chrono::milliseconds(0))) sends_.pop_front();
}

double PipelineRunner::finish(double loss_sum, std::int64_t micro_batches) {
  while (!sends_.empty()) {
    sends_.front().second->wait();
    sends_.pop_front();
  }
  // The last stage's mean loss, to every stage (over the host).
  double mean = loss_sum / static_cast<double>(micro_batches);
  std::string bytes(reinterpret_cast<const char*>(&mean), sizeof mean);
  pipe_.broadcast(bytes, stages_ - 1);
  std::memcpy(&mean, bytes.data(), sizeof mean);
  return mean;
}

double PipelineRunner::clip_grad_norm(double max_norm) {
  std::vector<torch::Tensor> gradients;
  double squares = 0;
  for (const auto& parameter : module_.parameters()) {
    if (!parameter.grad().defined()) continue;
    gradients.push_back(parameter.grad());
    squares += parameter.grad().to(torch::kFloat64).pow(2).sum().item<double>();
  }
  const double norm = std::sqrt(sum_over_stages(squares));
  const double factor = max_norm / (norm + 1e-6);
  if (factor < 1) {
    for (auto& gradient : gradients) gradient.mul_(factor);
  }
  return norm;
}

// Every stage's value, summed over the host (the pipe may be a device communicator), in stage
// order: the same sum on every stage.
double PipelineRunner::sum_over_stages(double value) {
  double total = 0;
  for (const auto& bytes : pipe_.allgather(std::string(reinterpret_cast<const char*>(&value), sizeof value))) {
    double part = 0;
    std::memcpy(&part, bytes.data(), sizeof part);
    total += part;
  }
  return total;
}

double PipelineRunner::evaluate(const std::vector<torch::Tensor>& inputs, const std::vector<torch::Tensor>& targets,
                                std::int64_t micro_batches) {
  check_batch(inputs, targets, micro_batches);
  const torch::NoGradGuard no_grad;
  double loss_sum = 0;
  std::vector<torch::Tensor> none;
  for (std::int64_t micro = 0; micro < micro_batches; ++micro) {
    const auto index = static_cast<std::size_t>(micro);
    torch::Tensor input;
    if (stage_ == 0) {
      input = inputs[index];
    } else {
      // Each micro-batch's shape travels with it: a validation set may end in a short batch.
      const Shape shape = receive_shape(activations_in_);
      Incoming incoming = post_receive(activations_in_, shape, none);
      input = take(incoming);
    }
    const torch::Tensor output = module_.forward(input);
    if (stage_ == stages_ - 1) {
      loss_sum += module_.loss(output, targets[index]).item<double>();
    } else {
      send_shape(activations_out_, output);
      send(activations_out_, output);
    }
  }
  return finish(loss_sum, micro_batches);
}

}  // namespace hpctrial::trainer::detail
