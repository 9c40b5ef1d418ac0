#include "observe/metrics_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <ctime>

#include <fmt/core.h>

#include "hpctrial/core/json_file.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/tensorboard/event_writer.h"

namespace hpctrial::trainer::detail {

std::string iso_time_now() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
  const auto millis = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm utc{};
  gmtime_r(&seconds, &utc);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%S", &utc);
  return fmt::format("{}.{:03d}Z", text, static_cast<int>(millis));
}

MetricsLog::MetricsLog(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (fd_ < 0) core::throw_errno("cannot open the metrics file " + path, errno);
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) {
    ::fsync(fd_);
    ::close(fd_);
  }
}

namespace {

// One scalar per number in `value`, tagged with the path to it.
void add_scalars(tensorboard::EventWriter& events, const std::string& tag, const nlohmann::json& value,
                 std::int64_t step) {
  if (value.is_number()) {
    events.add_scalar(tag, value.get<double>(), step);
  } else if (value.is_array()) {
    for (std::size_t i = 0; i < value.size(); ++i) add_scalars(events, tag + "/" + std::to_string(i), value[i], step);
  } else if (value.is_object()) {
    for (auto it = value.begin(); it != value.end(); ++it) add_scalars(events, tag + "/" + it.key(), it.value(), step);
  }
}

}  // namespace

void MetricsLog::write(const std::string& kind, std::int64_t batches, std::int64_t epoch,
                       std::int64_t records, const MetricValues& metrics,
                       const nlohmann::json& extra) {
  nlohmann::json line = {{"kind", kind}, {"batches", batches}, {"epoch", epoch},
                         {"records", records}, {"time", iso_time_now()}};
  line["metrics"] = nlohmann::json::object();
  for (const auto& [name, value] : metrics) line["metrics"][name] = value.to_json();
  if (!extra.is_null()) {
    for (auto it = extra.begin(); it != extra.end(); ++it) line[it.key()] = it.value();
  }
  core::write_fully(fd_, line.dump() + "\n", "to the metrics file " + path_);
  if (events_ != nullptr && (!events_enabled_ || events_enabled_())) {
    for (const auto& [name, value] : metrics) add_scalars(*events_, kind + "/" + name, value.value(), batches);
  }
}

void MetricsLog::sync() {
  if (::fsync(fd_) != 0) core::throw_errno("cannot flush the metrics file " + path_, errno);
}

double PhaseTimings::total_s(const std::string& phase) const {
  for (const auto& p : phases_) {
    if (p.name == phase) return p.total_s;
  }
  return 0;
}

void PhaseTimings::add(std::string_view phase, Clock::duration elapsed) {
  Phase* target = nullptr;
  for (auto& p : phases_) {
    if (p.name == phase) {
      target = &p;
      break;
    }
  }
  if (target == nullptr) {
    phases_.emplace_back();
    phases_.back().name = phase;
    target = &phases_.back();
  }
  target->total_s += std::chrono::duration<double>(elapsed).count();
  ++target->count;
}

std::vector<std::pair<std::string, double>> PhaseTimings::period_means_ms() {
  std::vector<std::pair<std::string, double>> out;
  for (auto& p : phases_) {
    const std::int64_t count = p.count - p.reported_count;
    if (count > 0) out.emplace_back(p.name, 1000.0 * (p.total_s - p.reported_s) / static_cast<double>(count));
    p.reported_s = p.total_s;
    p.reported_count = p.count;
  }
  return out;
}

nlohmann::json PhaseTimings::summary() const {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& p : phases_) {
    out[p.name] = {{"total_s", p.total_s},
                   {"mean_ms", p.count > 0 ? 1000.0 * p.total_s / static_cast<double>(p.count) : 0.0},
                   {"count", p.count}};
  }
  return out;
}

std::string PhaseTimings::table() const {
  std::string text = fmt::format("{:<20} {:>10} {:>10} {:>8}\n", "phase", "total s", "mean ms", "count");
  for (const auto& p : phases_) {
    text += fmt::format("{:<20} {:>10.3f} {:>10.3f} {:>8}\n", p.name, p.total_s,
                        p.count > 0 ? 1000.0 * p.total_s / static_cast<double>(p.count) : 0.0, p.count);
  }
  return text;
}

Progress::Progress(std::int64_t total_batches, std::int64_t global_batch_size, double interval_s,
                   bool enabled)
    : total_(total_batches),
      global_batch_size_(global_batch_size),
      interval_s_(interval_s),
      enabled_(enabled),
      tty_(::isatty(STDERR_FILENO) == 1),
      start_(std::chrono::steady_clock::now()),
      last_(start_) {}

void Progress::update(std::int64_t batches, std::int64_t epoch, double loss, bool force) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  const double since_last = std::chrono::duration<double>(now - last_).count();
  if (!force && since_last < interval_s_) return;
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double rate = since_last > 0 ? static_cast<double>((batches - last_batches_) * global_batch_size_) / since_last : 0.0;
  const double per_batch = batches > 0 ? elapsed / static_cast<double>(batches) : 0.0;
  const auto eta = static_cast<std::int64_t>(per_batch * static_cast<double>(total_ - batches));
  std::string line = fmt::format(
      "batch {}/{} ({:.0f}%) | epoch {} | {:.0f} samples/s | loss {} | ETA {:02d}:{:02d}:{:02d}",
      batches, total_, total_ > 0 ? 100.0 * static_cast<double>(batches) / static_cast<double>(total_) : 100.0,
      epoch, rate, std::isnan(loss) ? std::string("-") : fmt::format("{:.4f}", loss), eta / 3600,
      (eta / 60) % 60, eta % 60);
  line = tty_ ? "\r\033[K" + line : line + "\n";
  const ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
  printed_ = true;
  last_ = now;
  last_batches_ = batches;
}

void Progress::finish() {
  if (enabled_ && tty_ && printed_) {
    const ssize_t ignored = ::write(STDERR_FILENO, "\n", 1);
    (void)ignored;
  }
}

}  // namespace hpctrial::trainer::detail
