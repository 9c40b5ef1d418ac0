// Files of each rank's own in a checkpoint (Trial::save_files, EngineTrial::save): each rank's
// files are datasets "rank_files/<rank>/<relative path>" (uint8), written by that rank as pieces
// of the one file, and "meta/rank_files" says how many ranks saved them. No LibTorch.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

#include "hpctrial/checkpoint/format.h"

namespace hpctrial::trainer::detail {

// A directory only this process can read (0700) under the temporary directory ($TMPDIR), removed
// with everything in it when the object goes.
class PrivateDirectory {
 public:
  explicit PrivateDirectory(const std::string& purpose);
  ~PrivateDirectory();
  PrivateDirectory(const PrivateDirectory&) = delete;
  PrivateDirectory& operator=(const PrivateDirectory&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// The files under `directory` as rank `rank`'s datasets, and, from the chief (or any rank with
// `counted`: a copy of its own, checkpoint_levels.memory), the count of ranks. ConfigError naming
// the file for anything but regular files and directories, or a name that cannot travel (a
// control character).
checkpoint::Contents capture_rank_files(const std::filesystem::path& directory, int rank, int ranks,
                                        bool counted = false);

// The number of ranks whose files `contents` holds; none when it holds none.
std::optional<int> rank_files_ranks(const checkpoint::Contents& contents, const std::string& path);

// Writes rank `rank`'s files of `contents` under `directory` (mode 0600). CheckpointError naming
// the checkpoint for a name that is not a safe relative path.
void extract_rank_files(const checkpoint::Contents& contents, int rank, const std::filesystem::path& directory,
                        const std::string& path);

}  // namespace hpctrial::trainer::detail
