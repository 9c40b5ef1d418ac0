// Small text helpers shared by the libraries.
#pragma once

#include <ctime>
#include <string>
#include <string_view>

namespace hpctrial::core {

// `text` without leading and trailing spaces, tabs, CRs and newlines.
std::string trim(std::string_view text);

// The current time in UTC as ISO 8601 with a Z, to the second: "2026-11-21T04:00:00Z".
std::string utc_now_iso();
// The time `t` the same way.
std::string utc_iso(std::time_t t);

}  // namespace hpctrial::core
