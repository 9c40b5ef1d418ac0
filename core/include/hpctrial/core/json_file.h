// JSON records of the experiment directory (experiment.json, launcher-state.json), read whole
// and published atomically.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace hpctrial::core {

// The object in `path`; an empty object when the file does not exist or holds no object.
// IoError naming the file when it is not JSON.
nlohmann::json read_json_file(const std::string& path);
// Publishes `value` at `path` atomically (write_file_atomic); text that is not UTF-8 is written
// with replacement characters.
void write_json_file(const std::string& path, const nlohmann::json& value);

}  // namespace hpctrial::core
