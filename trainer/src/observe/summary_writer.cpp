#include "hpctrial/trainer/summary_writer.h"

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>

#include "hpctrial/core/error.h"
#include "hpctrial/tensorboard/event_writer.h"

namespace hpctrial::trainer {

namespace {

// The image as 8-bit HWC pixels.
tensorboard::Image to_image(const std::string& tag, const torch::Tensor& image, const std::string& dataformats) {
  const auto fail = [&](const std::string& why) {
    throw ConfigError("add_image('" + tag + "'): " + why);
  };
  torch::Tensor t = image.detach().to(torch::kCPU);
  if (dataformats == "HW") {
    if (t.dim() != 2) fail("dataformats HW needs a 2-dimensional tensor, not " + std::to_string(t.dim()));
    t = t.unsqueeze(2);
  } else if (dataformats == "CHW") {
    if (t.dim() != 3) fail("dataformats CHW needs a 3-dimensional tensor, not " + std::to_string(t.dim()));
    t = t.permute({1, 2, 0});
  } else if (dataformats == "HWC") {
    if (t.dim() != 3) fail("dataformats HWC needs a 3-dimensional tensor, not " + std::to_string(t.dim()));
  } else {
    fail("dataformats is '" + dataformats + "'; use CHW, HWC or HW");
  }
  const auto channels = t.size(2);
  if (channels != 1 && channels != 3 && channels != 4) {
    fail("an image has 1, 3 or 4 channels, not " + std::to_string(channels));
  }
  if (t.scalar_type() != torch::kUInt8) {
    if (!t.is_floating_point()) fail("the pixels are integers of a type other than uint8; give floats in [0, 1] or uint8");
    t = (t.to(torch::kFloat32).clamp(0, 1) * 255).round().to(torch::kUInt8);
  }
  t = t.contiguous();
  tensorboard::Image out;
  out.height = static_cast<int>(t.size(0));
  out.width = static_cast<int>(t.size(1));
  out.channels = static_cast<int>(channels);
  out.pixels.assign(t.data_ptr<std::uint8_t>(), t.data_ptr<std::uint8_t>() + t.numel());
  return out;
}

}  // namespace

SummaryWriter::SummaryWriter(std::string log_dir, std::function<std::int64_t()> current_step)
    : log_dir_(std::move(log_dir)), current_step_(std::move(current_step)) {}

SummaryWriter::~SummaryWriter() = default;

std::int64_t SummaryWriter::step_or_current(Step step) const {
  if (step) return *step;
  return current_step_ ? current_step_() : 0;
}

tensorboard::EventWriter* SummaryWriter::events() {
  if (!enabled()) return nullptr;
  if (!main_) main_ = std::make_unique<tensorboard::EventWriter>(log_dir_);
  return main_.get();
}

tensorboard::EventWriter& SummaryWriter::writer_for(const std::string& run) {
  auto& writer = runs_[run];
  if (!writer) {
    events();  // the log directory first: a run's folder is made inside it
    writer = std::make_unique<tensorboard::EventWriter>((std::filesystem::path(log_dir_) / run).string());
  }
  return *writer;
}

void SummaryWriter::add_scalar(const std::string& tag, double value, Step step) {
  if (!enabled()) return;
  events()->add_scalar(tag, value, step_or_current(step));
}

void SummaryWriter::add_scalars(const std::string& main_tag, const std::map<std::string, double>& values, Step step) {
  if (!enabled()) return;
  const std::int64_t at = step_or_current(step);
  // As torch.utils.tensorboard names the runs, '/' made '_': one folder each, inside log_dir.
  const auto flat = [](std::string text) {
    std::replace(text.begin(), text.end(), '/', '_');
    return text;
  };
  for (const auto& [name, value] : values) writer_for(flat(main_tag) + "_" + flat(name)).add_scalar(main_tag, value, at);
}

void SummaryWriter::add_histogram(const std::string& tag, const torch::Tensor& values, Step step, int bins) {
  if (!enabled()) return;
  if (bins < 1) throw ConfigError("add_histogram('" + tag + "'): bins must be at least 1, not " + std::to_string(bins));
  const torch::Tensor flat = values.detach().to(torch::kCPU, torch::kFloat64).contiguous().flatten();
  const std::vector<double> data(flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel());
  events()->add_histogram(tag, tensorboard::make_histogram(data, bins), step_or_current(step));
}

void SummaryWriter::add_image(const std::string& tag, const torch::Tensor& image, Step step,
                              const std::string& dataformats) {
  if (!enabled()) return;
  events()->add_image(tag, to_image(tag, image, dataformats), step_or_current(step));
}

void SummaryWriter::add_text(const std::string& tag, const std::string& text, Step step) {
  if (!enabled()) return;
  events()->add_text(tag, text, step_or_current(step));
}

void SummaryWriter::flush() {
  if (main_) main_->flush();
  for (auto& [run, writer] : runs_) writer->flush();
}

}  // namespace hpctrial::trainer
