#include "hpctrial/tensorboard/event_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <filesystem>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "tensorboard.pb.h"

namespace hpctrial::tensorboard {

namespace {

namespace pb = hpctrial::tensorboard::proto;

// Buffered records are written once this many bytes wait.
constexpr std::size_t kFlushBytes = 1 << 16;

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

pb::Event event_at(std::int64_t step) {
  pb::Event event;
  event.set_wall_time(wall_time());
  event.set_step(step);
  return event;
}

void put_le(std::string& out, std::uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

}  // namespace

std::uint32_t masked_crc32c(std::string_view data) {
  const std::uint32_t crc = checkpoint::crc32c(data.data(), data.size());
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

Histogram make_histogram(const std::vector<double>& values, int bins) {
  if (bins < 1) throw InternalError("make_histogram: bins must be at least 1, not " + std::to_string(bins));
  Histogram h;
  bool first = true;
  for (const double v : values) {
    if (!std::isfinite(v)) continue;
    h.min = first ? v : std::min(h.min, v);
    h.max = first ? v : std::max(h.max, v);
    first = false;
    h.num += 1;
    h.sum += v;
    h.sum_squares += v * v;
  }
  if (h.num == 0) return h;
  if (h.max == h.min) bins = 1;
  const double width = (h.max - h.min) / bins;
  h.bucket.assign(static_cast<std::size_t>(bins), 0.0);
  for (int i = 0; i < bins; ++i) h.bucket_limit.push_back(i + 1 == bins ? h.max : h.min + width * (i + 1));
  for (const double v : values) {
    if (!std::isfinite(v)) continue;
    int i = width > 0 ? static_cast<int>((v - h.min) / width) : 0;
    // (limit[i-1], limit[i]]: a value on an edge belongs to the bucket below it.
    if (i > 0 && v <= h.bucket_limit[static_cast<std::size_t>(i - 1)]) --i;
    h.bucket[static_cast<std::size_t>(std::min(i, bins - 1))] += 1;
  }
  return h;
}

EventWriter::EventWriter(std::string log_dir) : log_dir_(std::move(log_dir)) {
  if (::mkdir(log_dir_.c_str(), 0700) == 0) {
    ::chmod(log_dir_.c_str(), 0700);  // exactly, whatever the umask
  } else if (errno != EEXIST) {
    core::throw_errno("cannot create the TensorBoard folder " + log_dir_, errno);
  }
  open();
  flush();
}

EventWriter::~EventWriter() {
  try {
    flush();
  } catch (const std::exception&) {
    // The destructor of a failing run: the records are lost, the failure is already reported.
  }
  if (fd_ >= 0) ::close(fd_);
}

void EventWriter::open() {
  static std::atomic<int> files{0};
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch()).count();
  path_ = (std::filesystem::path(log_dir_) / ("events.out.tfevents." + std::to_string(seconds) + "." + host_name() +
                                              "." + std::to_string(::getpid()) + "." + std::to_string(files++)))
              .string();
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0600);
  if (fd_ < 0) core::throw_errno("cannot create the TensorBoard event file " + path_, errno);
  pb::Event version = event_at(0);
  version.set_file_version("brain.Event:2");
  write_event(version.SerializeAsString());
}

void EventWriter::write_event(const std::string& serialized) {
  std::string length;
  put_le(length, serialized.size(), 8);
  buffer_ += length;
  put_le(buffer_, masked_crc32c(length), 4);
  buffer_ += serialized;
  put_le(buffer_, masked_crc32c(serialized), 4);
  if (buffer_.size() >= kFlushBytes) flush();
}

void EventWriter::flush() {
  if (buffer_.empty()) return;
  const std::string data = std::move(buffer_);
  buffer_.clear();
  core::write_fully(fd_, data, "to the TensorBoard event file " + path_);
}

void EventWriter::add_scalar(const std::string& tag, double value, std::int64_t step) {
  pb::Event event = event_at(step);
  pb::Summary::Value* v = event.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(static_cast<float>(value));
  write_event(event.SerializeAsString());
}

void EventWriter::add_histogram(const std::string& tag, const Histogram& histogram, std::int64_t step) {
  pb::Event event = event_at(step);
  pb::Summary::Value* v = event.mutable_summary()->add_value();
  v->set_tag(tag);
  pb::HistogramProto* h = v->mutable_histo();
  h->set_min(histogram.min);
  h->set_max(histogram.max);
  h->set_num(histogram.num);
  h->set_sum(histogram.sum);
  h->set_sum_squares(histogram.sum_squares);
  for (const double limit : histogram.bucket_limit) h->add_bucket_limit(limit);
  for (const double count : histogram.bucket) h->add_bucket(count);
  write_event(event.SerializeAsString());
}

void EventWriter::add_image(const std::string& tag, const Image& image, std::int64_t step) {
  pb::Event event = event_at(step);
  pb::Summary::Value* v = event.mutable_summary()->add_value();
  v->set_tag(tag);
  pb::Summary::Image* i = v->mutable_image();
  i->set_height(image.height);
  i->set_width(image.width);
  i->set_colorspace(image.channels);
  i->set_encoded_image_string(encode_png(image));
  write_event(event.SerializeAsString());
}

void EventWriter::add_text(const std::string& tag, const std::string& text, std::int64_t step) {
  constexpr int kStringType = 7;  // TensorFlow's DT_STRING
  pb::Event event = event_at(step);
  pb::Summary::Value* v = event.mutable_summary()->add_value();
  v->set_tag(tag);
  v->mutable_metadata()->mutable_plugin_data()->set_plugin_name("text");
  pb::TensorProto* t = v->mutable_tensor();
  t->set_dtype(kStringType);
  t->mutable_tensor_shape()->add_dim()->set_size(1);
  t->add_string_val(text);
  write_event(event.SerializeAsString());
}

void EventWriter::purge_from(std::int64_t step) {
  pb::Event event = event_at(step);
  event.mutable_session_log()->set_status(pb::SessionLog::START);
  write_event(event.SerializeAsString());
}

}  // namespace hpctrial::tensorboard
