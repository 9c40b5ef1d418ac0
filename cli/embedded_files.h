// Files compiled into the hpctrial command (cmake/EmbedFiles.cmake), such as the stand-alone
// trial project that `hpctrial new-trial` writes.
#pragma once

#include <cstddef>

namespace hpctrial::cli {

struct EmbeddedFile {
  const char* name;  // relative path
  const char* text;
};

// examples/standalone: CMakeLists.txt, my_trial.cpp, experiment.yaml, README.md.
extern const EmbeddedFile kStandaloneProject[];
extern const std::size_t kStandaloneProject_count;
// examples/standalone_engine: the same files, an engine trial.
extern const EmbeddedFile kStandaloneEngineProject[];
extern const std::size_t kStandaloneEngineProject_count;
// examples/standalone_pipeline: the same files, an engine trial in pipeline stages.
extern const EmbeddedFile kStandalonePipelineProject[];
extern const std::size_t kStandalonePipelineProject_count;

}  // namespace hpctrial::cli
