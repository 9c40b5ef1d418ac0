#include "hpctrial/core/frozen_code.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>

#include "hpctrial/core/digest.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/text.h"

namespace hpctrial::core {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
constexpr const char* kCode = "code";
constexpr const char* kChanges = "code_changes";
constexpr const char* kContext = "context";
constexpr const char* kContextChanges = "context_changes";

// Records `code` under `key` of experiment.json, a change of digest appended to `changes`.
void record(const ExperimentLayout& layout, const char* key, const char* changes, const FrozenCode& code) {
  const UniqueFd lock = lock_experiment(layout);
  json state = read_json_file(layout.state());
  const json entry = {{"source", code.source}, {"digest", code.digest}, {"path", code.path}};
  if (state.contains(key) && state[key].is_object() && state[key].value("digest", "") != code.digest) {
    if (!state[changes].is_array()) state[changes] = json::array();
    state[changes].push_back({{"from", state[key].value("digest", "")}, {"to", code.digest},
                              {"source", code.source}, {"at", utc_now_iso()}});
  }
  state[key] = entry;
  write_json_file(layout.state(), state);
}
}  // namespace

std::string entrypoint_file(const Entrypoint& entrypoint) {
  if (entrypoint.kind == Entrypoint::Kind::kLibrary) return entrypoint.library;
  if (entrypoint.argv.empty() || entrypoint.argv.front().find('/') == std::string::npos) return "";
  return entrypoint.argv.front();
}

void set_entrypoint_file(Entrypoint& entrypoint, const std::string& file) {
  if (entrypoint.kind == Entrypoint::Kind::kLibrary) {
    entrypoint.library = file;
  } else if (!entrypoint.argv.empty()) {
    entrypoint.argv.front() = file;
  }
}

bool is_frozen(const ExperimentLayout& layout, const std::string& file) {
  const std::string folder = layout.code_dir() + "/";
  return !file.empty() && file.compare(0, folder.size(), folder) == 0;
}

ExperimentConfig code_as_given(const ExperimentLayout& layout, ExperimentConfig recorded, const ExperimentConfig& given) {
  // The file only: the program's arguments, or the trial class, are the experiment's still.
  const std::string file = entrypoint_file(given.entrypoint);
  if (is_frozen(layout, file) && recorded.entrypoint.kind == given.entrypoint.kind) {
    set_entrypoint_file(recorded.entrypoint, file);
  }
  if (is_frozen(layout, given.context) && is_frozen(layout, recorded.context)) recorded.context = given.context;
  return recorded;
}

std::optional<FrozenCode> frozen_code(const ExperimentLayout& layout) {
  std::error_code ec;
  try {
    const json state = fs::exists(layout.state(), ec) ? read_json_file(layout.state()) : json::object();
    if (state.contains(kCode)) {
      const json& code = state[kCode];
      FrozenCode out{code.is_object() ? code.value("source", "") : "", code.is_object() ? code.value("digest", "") : "",
                     code.is_object() ? code.value("path", "") : ""};
      if (!out.digest.empty() && !out.path.empty()) return out;
    }
  } catch (const Error&) {
    // A damaged record: the identity's check names it; the config still names the copy.
  }
  // Where the record is lost (rebuilt by `hpctrial experiment repair`), the recorded config's
  // entrypoint names the copy: code/<digest>/<name>.
  if (!fs::exists(layout.config(), ec)) return std::nullopt;
  const std::string file = entrypoint_file(load_experiment_config({layout.config(), "", {}}).entrypoint);
  if (!is_frozen(layout, file)) return std::nullopt;
  return FrozenCode{"", fs::path(file).parent_path().filename().string(), file};
}

std::string freeze_file(const ExperimentLayout& layout, const std::string& source, const std::string& digest) {
  const fs::path folder = fs::path(layout.code_dir()) / digest;
  const fs::path frozen = folder / fs::path(source).filename();
  std::error_code ec;
  if (fs::exists(frozen, ec) && file_sha256(frozen.string()) == digest) return frozen.string();
  create_directories(layout.code_dir(), 0700);
  create_directories(folder.string(), 0700);
  // A temporary of this process's own: two commands making the experiment at once each publish
  // whole bytes.
  const fs::path temp = folder / ("." + frozen.filename().string() + "." + std::to_string(::getpid()) + "." +
                                  std::to_string(std::random_device{}()) + ".tmp");
  fs::copy_file(source, temp, fs::copy_options::overwrite_existing, ec);
  if (ec) throw IoError("cannot copy " + source + " to " + temp.string() + ": " + ec.message());
  if (::chmod(temp.c_str(), 0700) != 0) throw_errno("cannot set the mode of " + temp.string(), errno);
  if (file_sha256(temp.string()) != digest) {
    fs::remove(temp, ec);
    throw IoError(source + " changed while it was copied into " + folder.string() + "; run the command again");
  }
  publish_file(temp.string(), frozen.string());
  return frozen.string();
}

void record_frozen_code(const ExperimentLayout& layout, const FrozenCode& code) {
  record(layout, kCode, kChanges, code);
}

void record_frozen_context(const ExperimentLayout& layout, const FrozenCode& context) {
  record(layout, kContext, kContextChanges, context);
}

std::optional<FrozenCode> frozen_context(const ExperimentLayout& layout) {
  std::error_code ec;
  if (!fs::exists(layout.state(), ec)) return std::nullopt;
  const json state = read_json_file(layout.state());
  if (!state.contains(kContext) || !state[kContext].is_object()) return std::nullopt;
  const json& entry = state[kContext];
  FrozenCode out{entry.value("source", ""), entry.value("digest", ""), entry.value("path", "")};
  if (out.digest.empty() || out.path.empty()) return std::nullopt;
  return out;
}

}  // namespace hpctrial::core
