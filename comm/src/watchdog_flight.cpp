// The collective watchdog's flight recorder, as text: each rank's last operations, for the
// verdict (comm/include/hpctrial/comm/watchdog.h).
#include <fmt/format.h>

#include <algorithm>
#include <iterator>

#include "hpctrial/comm/watchdog.h"
#include "watchdog_channels.h"

namespace hpctrial::comm {
namespace {

using namespace watchdog_detail;

// "512 B", "4.0 KiB", "25.0 MiB".
std::string bytes_text(std::uint64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  std::size_t unit = 0;
  while (value >= 1024 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  return unit == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.1f} {}", value, kUnits[unit]);
}

}  // namespace

std::string Watchdog::describe_recent(const Heartbeat& beat, double heard_s) {
  if (beat.recent_count == 0) return "no collective or message yet";
  std::vector<std::string> parts;
  for (std::uint64_t i = 0; i < beat.recent_count && i < kRecent; ++i) {
    Recent recent = beat.recent[i];
    recent.operation[sizeof(recent.operation) - 1] = '\0';
    recent.phase[sizeof(recent.phase) - 1] = '\0';
    std::string what = fmt::format("{} #{}", recent.operation, recent.number);
    if (is_message(recent.channel)) {
      what += fmt::format(" from rank {} to rank {}", message_from(recent.channel), message_to(recent.channel));
    } else if (recent.channel != kWorld) {
      what += " of a group";
    }
    std::string detail = fmt::format("step {}", recent.step);
    if (recent.phase[0] != '\0') detail += fmt::format(", {}", recent.phase);
    if (recent.bytes > 0) detail += ", " + bytes_text(recent.bytes);
    const double began = recent.began_s + heard_s;
    parts.push_back(recent.seconds >= 0
                        ? fmt::format("{} ({}) began {:.1f} s ago, took {:.3f} s", what, detail, began, recent.seconds)
                        : fmt::format("{} ({}) began {:.1f} s ago, not finished", what, detail, began));
  }
  return join(parts, "; ");
}

std::vector<std::pair<int, std::string>> Watchdog::flight(Clock::time_point now, const Heartbeat* mine) const {
  std::vector<std::pair<int, std::string>> out;
  if (mine != nullptr) {
    out.emplace_back(rank_, describe_recent(*mine, 0));
    return out;
  }
  for (int r = 0; r < size_; ++r) {
    const PeerState& peer = peers_[static_cast<std::size_t>(r)];
    if (!peer.heard_ever) {
      out.emplace_back(r, "never heard from");
      continue;
    }
    const double heard = seconds(now - peer.heard);
    std::string text = describe_recent(peer.last, heard);
    if (heard > 2 * seconds(options_.interval) + 1) text += fmt::format(" (heard from {:.1f} s ago)", heard);
    out.emplace_back(r, std::move(text));
  }
  return out;
}

}  // namespace hpctrial::comm
