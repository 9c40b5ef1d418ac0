// The lines of a trial's metrics.jsonl that two runs of the same training share: without the
// wall-clock time of each line, the timings line and the system metrics (measurements of the
// machine, taken by the clock).
#pragma once

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>
#include <vector>

namespace hpctrial::testing_support {

inline std::vector<std::string> comparable_metric_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == "timings" || j["kind"] == "system") continue;
    j.erase("time");
    out.push_back(j.dump());
  }
  return out;
}

}  // namespace hpctrial::testing_support
