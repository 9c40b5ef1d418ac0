// TensorBoard from a trial (Determined's get_tensorboard_writer(), torch.utils.tensorboard's
// SummaryWriter): the same calls, writing into the trial's event files under
// <trial dir>/tensorboard/, beside every training and validation metric and the phase timings the
// harness writes there itself.
//
//   auto& writer = context.tensorboard_writer();
//   writer.add_scalar("lr", optimizer->param_groups()[0].options().get_lr());
//   writer.add_histogram("fc1/weight", model_->fc1->weight);
//   writer.add_image("input", batch.data[0]);  // CHW, floats in [0, 1] or uint8
//
// The step defaults to the batches trained so far, the step the harness's metrics use. Only the
// chief writes: on the other ranks (and without a trial directory) every call does nothing, so a
// trial need not ask which rank it is. From the training thread only.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

namespace hpctrial::tensorboard {
class EventWriter;
}

namespace hpctrial::trainer {

class SummaryWriter {
 public:
  // Writes under `log_dir` (nothing when it is empty); `current_step` gives the default step.
  SummaryWriter(std::string log_dir, std::function<std::int64_t()> current_step);
  ~SummaryWriter();
  SummaryWriter(const SummaryWriter&) = delete;
  SummaryWriter& operator=(const SummaryWriter&) = delete;

  using Step = std::optional<std::int64_t>;
  void add_scalar(const std::string& tag, double value, Step step = std::nullopt);
  // Several curves in one chart, as torch.utils.tensorboard does it: each value goes to the run
  // `<log dir>/<main_tag>_<name>` (each '/' made '_') under the tag `main_tag`.
  void add_scalars(const std::string& main_tag, const std::map<std::string, double>& values,
                   Step step = std::nullopt);
  // The values of a tensor of any shape, in `bins` equal buckets from its smallest to its largest.
  void add_histogram(const std::string& tag, const torch::Tensor& values, Step step = std::nullopt,
                     int bins = 64);
  // An image of shape CHW (or HWC: dataformats "HWC"; or HW, grey) with 1, 3 or 4 channels:
  // floating-point values in [0, 1] (clamped) or uint8. ConfigError naming the tag otherwise.
  void add_image(const std::string& tag, const torch::Tensor& image, Step step = std::nullopt,
                 const std::string& dataformats = "CHW");
  void add_text(const std::string& tag, const std::string& text, Step step = std::nullopt);
  // Writes what is buffered (the harness does it at each metrics report and checkpoint).
  void flush();

  // Whether calls write anything (the chief, with a trial directory).
  bool enabled() const { return !log_dir_.empty(); }
  // The folder to point TensorBoard at for this trial; empty where nothing is written.
  const std::string& log_dir() const { return log_dir_; }

  // For the harness: the event file its metrics share with the trial's calls (null when disabled).
  tensorboard::EventWriter* events();

 private:
  std::int64_t step_or_current(Step step) const;
  tensorboard::EventWriter& writer_for(const std::string& run);

  std::string log_dir_;
  std::function<std::int64_t()> current_step_;
  std::unique_ptr<tensorboard::EventWriter> main_;
  std::map<std::string, std::unique_ptr<tensorboard::EventWriter>> runs_;  // add_scalars' runs
};

}  // namespace hpctrial::trainer
