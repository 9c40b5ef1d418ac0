#include "state/rank_files.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <vector>

#include <nlohmann/json.hpp>

#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/paths.h"

namespace hpctrial::trainer::detail {
namespace fs = std::filesystem;

namespace {

const std::string kMeta = "meta/rank_files";

std::string prefix_of(int rank) { return "rank_files/" + std::to_string(rank) + "/"; }

}  // namespace

PrivateDirectory::PrivateDirectory(const std::string& purpose) {
  // mkdtemp fills in the Xs (mode 0700); $TMPDIR is honoured.
  std::string templ = (fs::temp_directory_path() / ("hpctrial-" + purpose + "-XXXXXX")).string();
  if (::mkdtemp(templ.data()) == nullptr) {
    core::throw_errno("cannot make a private directory for " + purpose + " in " + fs::temp_directory_path().string() +
                          " (set TMPDIR to a writable directory)",
                      errno);
  }
  path_ = templ;
}

PrivateDirectory::~PrivateDirectory() {
  std::error_code ignored;
  fs::remove_all(path_, ignored);
}

checkpoint::Contents capture_rank_files(const fs::path& directory, int rank, int ranks, bool counted) {
  checkpoint::Contents out;
  std::error_code error;
  for (auto it = fs::recursive_directory_iterator(directory, error); !error && it != fs::recursive_directory_iterator();
       it.increment(error)) {
    const fs::path& file = it->path();
    const fs::path relative = file.lexically_relative(directory);
    for (const auto& part : relative) {
      if (!core::is_safe_file_name(part.string())) {
        throw ConfigError("save_files: the file " + file.string() + " has a name that cannot travel in a checkpoint "
                          "(a control character); rename it");
      }
    }
    const fs::file_status status = it->symlink_status();
    if (fs::is_directory(status)) continue;
    if (!fs::is_regular_file(status)) {
      throw ConfigError("save_files: " + file.string() + " is not a regular file (a link, a socket or a device); a "
                        "checkpoint holds regular files and directories only: copy what it points to instead");
    }
    std::ifstream in(file, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) throw IoError("save_files: cannot read " + file.string());
    out.add(prefix_of(rank) + relative.generic_string(), checkpoint::DType::kUInt8,
            {static_cast<std::int64_t>(bytes.size())}, bytes.data());
  }
  if (error) throw IoError("save_files: cannot list " + directory.string() + ": " + error.message());
  if (rank == 0 || counted) out.add_text(kMeta, nlohmann::json{{"ranks", ranks}}.dump());
  return out;
}

std::optional<int> rank_files_ranks(const checkpoint::Contents& contents, const std::string& path) {
  const checkpoint::Dataset* meta = contents.find(kMeta);
  if (meta == nullptr) return std::nullopt;
  try {
    return nlohmann::json::parse(meta->text()).at("ranks").get<int>();
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(path + ": " + kMeta + " is malformed: " + e.what());
  }
}

void extract_rank_files(const checkpoint::Contents& contents, int rank, const fs::path& directory,
                        const std::string& path) {
  const std::string prefix = prefix_of(rank);
  for (const auto& dataset : contents.datasets) {
    if (dataset.name.compare(0, prefix.size(), prefix) != 0) continue;
    const fs::path relative(dataset.name.substr(prefix.size()));
    for (const auto& part : relative) {
      if (!core::is_safe_file_name(part.string())) {
        throw CheckpointError(path + ": the rank file " + dataset.name + " is not a safe relative path; the "
                              "checkpoint was not written by hpctrial or was altered");
      }
    }
    const fs::path file = directory / relative;
    core::create_directories(file.parent_path().string());
    const char* bytes = dataset.data ? static_cast<const char*>(dataset.data->data()) : "";
    core::write_file_atomic(file.string(), std::string_view(bytes, dataset.nbytes()));
  }
}

}  // namespace hpctrial::trainer::detail
