#include "hpctrial/core/allocation.h"

#include <regex>

namespace hpctrial::core {

int Allocation::total_slots() const {
  int total = 0;
  for (const auto& host : hosts) total += host.slots;
  return total;
}

CommandRunner real_command_runner() {
  return [](const std::vector<std::string>& argv) {
    RunOptions options;
    options.timeout = std::chrono::seconds(60);
    return run_process(argv, options);
  };
}

bool is_valid_host_name(const std::string& name) {
  static const std::regex pattern(R"([A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?)");
  return std::regex_match(name, pattern);
}

}  // namespace hpctrial::core
