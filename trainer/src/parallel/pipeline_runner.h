// One stage of a pipeline running the 1F1B schedule (pipeline_plan.h) over a global batch's
// micro-batches (internal to the trainer).
//
// Neighbouring stages pass activations forward and their gradients back as messages, each
// direction of each pair of stages on a communicator of its own (split from the pipe's), so that
// a device communicator's stream never holds a send behind one going the other way. The first
// activation a stage sends is preceded by its shape and dtype (agreed once: a later activation of
// another shape is an error); after that the receive buffers are reused, and each receive is
// posted as soon as the one before it is taken, so a message travels while the stage computes.
// The last stage computes the loss of each micro-batch; its mean reaches every stage. Gradients
// accumulate in the stage's parameters, each micro-batch's loss divided by their number, as one
// model's would over the same global batch.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/trainer/pipeline.h"

namespace hpctrial::trainer::detail {

class PipelineRunner {
 public:
  // `pipe`: the stages of this pipeline, ranked by stage (its size is the module's stages). A
  // collective of `pipe`.
  PipelineRunner(PipelineModuleImpl& module, comm::Communicator& pipe);
  ~PipelineRunner();
  PipelineRunner(const PipelineRunner&) = delete;
  PipelineRunner& operator=(const PipelineRunner&) = delete;

  // One global batch of `micro_batches`: `inputs` on the first stage, `targets` on the last
  // (one per micro-batch; empty elsewhere). Returns the mean loss, on every stage.
  double train(const std::vector<torch::Tensor>& inputs, const std::vector<torch::Tensor>& targets,
               std::int64_t micro_batches);
  // The same forward only, without gradients; micro-batches may differ in shape.
  double evaluate(const std::vector<torch::Tensor>& inputs, const std::vector<torch::Tensor>& targets,
                  std::int64_t micro_batches);
  // Scales the gradients of every stage's parameters together to a global L2 norm of at most
  // `max_norm`, as torch::nn::utils::clip_grad_norm_ does on one model; returns the norm before
  // (the same on every stage). A collective of the pipe.
  double clip_grad_norm(double max_norm);
  // `value` summed over the stages; the same on every stage. A collective of the pipe.
  double sum_over_stages(double value);
  // The most micro-batches whose activations this stage held at once in the last train().
  std::int64_t peak_in_flight() const { return peak_in_flight_; }
  // Seconds the last train() spent in this stage's forwards and backwards (the loss included),
  // not waiting for its neighbours (the benchmark's 1F1B ideal). On a GPU, what was launched.
  double compute_seconds() const { return compute_seconds_; }

 private:
  // One direction between this stage and a neighbour.
  struct Link {
    comm::Communicator* comm = nullptr;  // one of links_
    int peer = 0;
  };
  struct Shape {
    std::vector<std::int64_t> sizes;
    c10::ScalarType type = c10::ScalarType::Float;
  };
  // A receive in flight into a buffer.
  struct Incoming {
    torch::Tensor buffer;
    comm::WorkHandle work;
  };

  void check_batch(const std::vector<torch::Tensor>& inputs, const std::vector<torch::Tensor>& targets,
                   std::int64_t micro_batches) const;
  void send_shape(Link& link, const torch::Tensor& tensor);
  Shape receive_shape(Link& link);
  void send(Link& link, const torch::Tensor& tensor);
  Incoming post_receive(Link& link, const Shape& shape, std::vector<torch::Tensor>& pool);
  torch::Tensor take(Incoming& incoming);
  void forward(std::int64_t micro, const std::vector<torch::Tensor>& inputs, const std::vector<torch::Tensor>& targets);
  void backward(std::int64_t micro);
  double finish(double loss_sum, std::int64_t micro_batches);

  PipelineModuleImpl& module_;
  comm::Communicator& pipe_;
  int stage_ = 0, stages_ = 1;
  torch::Device device_{torch::kCPU};  // of the stage's parameters, where messages land
  Link activations_out_, activations_in_, gradients_out_, gradients_in_;
  std::vector<std::unique_ptr<comm::Communicator>> links_;  // the four splits
  bool input_agreed_ = false, output_agreed_ = false;
  Shape input_shape_, output_shape_;  // what this stage receives, and sends

  // One train() at a time.
  std::int64_t micro_batches_ = 0;
  std::vector<torch::Tensor> stage_inputs_, outputs_;
  std::vector<torch::Tensor> activation_pool_, gradient_pool_;
  Incoming next_activation_, next_gradient_;
  std::int64_t activations_posted_ = 0, gradients_posted_ = 0;
  std::deque<std::pair<torch::Tensor, comm::WorkHandle>> sends_;  // kept alive until sent
  double loss_sum_ = 0;
  std::int64_t held_ = 0, peak_in_flight_ = 0;
  double compute_seconds_ = 0;
};

}  // namespace hpctrial::trainer::detail
