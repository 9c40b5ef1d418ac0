// The code an experiment runs, frozen when the experiment is made (Determined uploads its context
// directory at `det experiment create`): the entrypoint's program or trial library copied into
// <experiment>/code/<sha256>/<name>, which every later start of the experiment runs, whatever is
// at the original path by then. experiment.json records it ("code": source, digest, path) and
// each deliberate change ("code_changes"); the ranks get the digest (HPCTRIAL_CODE_DIGEST), which
// runs.jsonl and every checkpoint record.
#pragma once

#include <optional>
#include <string>

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

}  // namespace hpctrial::core
