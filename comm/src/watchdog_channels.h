// What the collective watchdog's sources share (comm/src/watchdog.cpp, watchdog_flight.cpp): the
// layout of a message channel's number, and small text helpers. Internal to comm.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace hpctrial::comm::watchdog_detail {

inline double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

inline std::string join(const std::vector<std::string>& parts, const char* separator) {
  std::string out;
  for (const auto& part : parts) out += (out.empty() ? "" : separator) + part;
  return out;
}

// A message channel: the bit, 15 bits of its communicator's channel, the ranks in 24 bits each.
constexpr std::uint64_t kMessageBit = std::uint64_t{1} << 63;
constexpr std::uint64_t kRankMask = 0xffffff;
inline bool is_message(std::uint64_t channel) { return (channel & kMessageBit) != 0; }
inline int message_from(std::uint64_t channel) { return static_cast<int>((channel >> 24) & kRankMask); }
inline int message_to(std::uint64_t channel) { return static_cast<int>(channel & kRankMask); }

}  // namespace hpctrial::comm::watchdog_detail
