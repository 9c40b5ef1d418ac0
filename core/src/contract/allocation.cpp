#include "hpctrial/core/allocation.h"

#include <regex>

namespace hpctrial::core {

int Allocation::total_slots() const {
  int total = 0;
  for (const auto& host : hosts) total += host.slots;
  return total;
}

bool is_valid_host_name(const std::string& name) {
  static const std::regex pattern(R"([A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?)");
  return std::regex_match(name, pattern);
}

}  // namespace hpctrial::core
