// The code an experiment runs, frozen when the experiment is made (Determined uploads its context
// directory at `det experiment create`): the entrypoint's program or trial library copied into
// <experiment>/code/<sha256>/<name>, which every later start of the experiment runs, whatever is
// at the original path by then. experiment.json records it ("code": source, digest, path) and
// each deliberate change ("code_changes"); the ranks get the digest (HPCTRIAL_CODE_DIGEST), which
// runs.jsonl and every checkpoint record.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/layout.h"

namespace hpctrial::core {

struct FrozenCode {
  std::string source;  // the path the config named when it was frozen
  std::string digest;  // SHA-256 of its bytes
  std::string path;    // the frozen copy
};

// The entrypoint's program or library file: the library, or the program when it is a path (not a
// name looked up on PATH); empty otherwise.
std::string entrypoint_file(const Entrypoint& entrypoint);
void set_entrypoint_file(Entrypoint& entrypoint, const std::string& file);

// Whether `file` is a frozen copy in the experiment's code folder.
bool is_frozen(const ExperimentLayout& layout, const std::string& file);
// `recorded` with the file of `given`'s entrypoint where that is a frozen copy: another copy (or
// a first one, for an experiment made before code was frozen) is a change of code, which a
// command makes only when told (--update-code), not a change of the experiment.
// The context folder likewise.
ExperimentConfig code_as_given(const ExperimentLayout& layout, ExperimentConfig recorded, const ExperimentConfig& given);

// The code recorded in experiment.json, else (a record lost or damaged) the copy the recorded
// config names, its source unknown; nullopt for an experiment that froze none (made before code
// was frozen, or running in a container image).
std::optional<FrozenCode> frozen_code(const ExperimentLayout& layout);

// Copies `source` (whose digest is `digest`) into the code folder, once (a copy of these bytes is
// reused), private and executable; returns its path. IoError naming the paths.
std::string freeze_file(const ExperimentLayout& layout, const std::string& source, const std::string& digest);

// Records `code` as the code the experiment runs, under the experiment's lock; a digest other than
// the recorded one is appended to "code_changes" with the time.
void record_frozen_code(const ExperimentLayout& layout, const FrozenCode& code);

// The context folder (config `context:`, Determined's context directory): the files and folders
// under it that its .hpctrialignore (ignore_rules.h) leaves, frozen with the code into
// <experiment>/code/<sha256>/context, where every start of the experiment runs its ranks.
inline constexpr std::uintmax_t kContextLimit = std::uintmax_t{96} << 20;

struct ContextFolder {
  std::string root;
  std::vector<std::string> folders;  // relative to root, sorted
  std::vector<std::string> files;    // relative to root, sorted
  std::uintmax_t bytes = 0;
  std::string digest;  // SHA-256 over each folder's path, and each file's path, mode and bytes
};

// The folder as it would be frozen. ConfigError naming the path and the fix for a folder that is
// none, an entry that is neither a file nor a folder (a symbolic link), or more than `limit`
// bytes (naming the largest files); IoError for one that cannot be read.
ContextFolder scan_context(const std::string& root, std::uintmax_t limit = kContextLimit);
// Where the files of `digest` are frozen: <experiment>/code/<digest>/context.
std::string frozen_context_path(const ExperimentLayout& layout, const std::string& digest);
// Copies the scanned folder there, once (a copy of these files is reused), private; returns its
// path. IoError naming the paths, or for files that changed while they were copied.
std::string freeze_context(const ExperimentLayout& layout, const ContextFolder& context);
// The context recorded in experiment.json ("context": source, digest, path); nullopt for none.
std::optional<FrozenCode> frozen_context(const ExperimentLayout& layout);
// Records `context` as the experiment's, under its lock; another digest than the recorded one is
// appended to "context_changes" with the time.
void record_frozen_context(const ExperimentLayout& layout, const FrozenCode& context);

}  // namespace hpctrial::core
