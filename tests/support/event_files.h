// TensorBoard event files read back by tests/python/read_events.py, a reader independent of
// hpctrial's writer (its own CRC-32C, Debian's python3-protobuf): every record's framing and CRCs
// checked, each event as a JSON object.
#pragma once

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hpctrial/core/subprocess.h"

#ifndef HPCTRIAL_PYTHON_PROTO_DIR
#error "HPCTRIAL_PYTHON_PROTO_DIR: the folder of the generated tensorboard_pb2.py"
#endif

namespace hpctrial::testing_support {

// The event files directly in `dir`, by name (TensorBoard's order: by creation time).
inline std::vector<std::string> event_files(const std::filesystem::path& dir) {
  std::vector<std::string> files;
  if (!std::filesystem::is_directory(dir)) return files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind("events.out.tfevents.", 0) == 0) files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

struct EventsRead {
  bool ok = false;
  std::string error;  // the reader's complaint when !ok
  std::vector<nlohmann::json> events;
};

inline EventsRead read_events(const std::vector<std::string>& files) {
  std::vector<std::string> argv = {"/usr/bin/python3", HPCTRIAL_SOURCE_DIR "/tests/python/read_events.py",
                                   HPCTRIAL_PYTHON_PROTO_DIR};
  argv.insert(argv.end(), files.begin(), files.end());
  core::RunOptions options;
  options.timeout = std::chrono::seconds(120);
  const core::RunResult r = core::run_process(argv, options);
  EventsRead read;
  read.ok = r.ok();
  read.error = r.describe() + "\n" + r.err;
  std::size_t start = 0, end;
  while ((end = r.out.find('\n', start)) != std::string::npos) {
    read.events.push_back(nlohmann::json::parse(r.out.substr(start, end - start)));
    start = end + 1;
  }
  return read;
}

// The scalars tagged `tag` in the events, as (step, value) in file order.
inline std::vector<std::pair<std::int64_t, double>> scalars(const std::vector<nlohmann::json>& events,
                                                            const std::string& tag) {
  std::vector<std::pair<std::int64_t, double>> out;
  for (const auto& e : events) {
    if (!e.contains("values")) continue;
    for (const auto& v : e["values"]) {
      if (v["tag"] == tag && v.contains("scalar")) out.emplace_back(e["step"].get<std::int64_t>(), v["scalar"].get<double>());
    }
  }
  return out;
}

}  // namespace hpctrial::testing_support
