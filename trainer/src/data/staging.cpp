#include "data/staging.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/layout.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/paths.h"

namespace hpctrial::trainer::detail {
namespace {

namespace fs = std::filesystem;
constexpr std::size_t kChunk = 8u << 20;

struct StagedFile {
  std::string path;  // relative to the staged file or folder ("" for a file itself)
  std::uint64_t size = 0;
  std::int64_t mtime_ns = 0;
  std::uint32_t crc = 0;
};

std::string system_reason() { return std::strerror(errno); }

std::int64_t mtime_ns(const fs::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw IoError(path.string() + ": cannot be read: " + system_reason());
  return static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

// The regular files of `source`: itself, or those below it (links followed), by path.
std::vector<StagedFile> list_source(const fs::path& source) {
  std::vector<StagedFile> files;
  std::error_code ec;
  if (fs::is_regular_file(source, ec)) {
    files.push_back({"", fs::file_size(source), mtime_ns(source), 0});
    return files;
  }
  fs::recursive_directory_iterator it(source, fs::directory_options::follow_directory_symlink, ec);
  if (ec) throw IoError(source.string() + ": cannot be listed: " + ec.message());
  for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) throw IoError(source.string() + ": cannot be listed: " + ec.message());
    if (!it->is_regular_file()) continue;
    files.push_back({fs::relative(it->path(), source).string(), it->file_size(), mtime_ns(it->path()), 0});
  }
  std::sort(files.begin(), files.end(), [](const auto& a, const auto& b) { return a.path < b.path; });
  return files;
}

class Fd {
 public:
  Fd(const fs::path& path, int flags, mode_t mode = 0) : fd_(::open(path.c_str(), flags | O_CLOEXEC, mode)) {
    if (fd_ < 0) throw IoError(path.string() + ": cannot be opened: " + system_reason());
  }
  ~Fd() { ::close(fd_); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// How far the staging of one key is, logged every 10 s once it has taken 10 s: the bytes read
// of those it reads (the source and the copy read back, or the copy checked for reuse).
class Progress {
 public:
  Progress(std::string what, std::uint64_t total) : what_(std::move(what)), total_(total) {}
  void add(std::uint64_t bytes) {
    done_ += bytes;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_ < std::chrono::seconds(10)) return;
    last_ = now;
    const double seconds = std::chrono::duration<double>(now - start_).count();
    core::log_info("data.stage: {}: {:.0f} of {:.0f} MB read ({:.0f} MB/s)", what_, static_cast<double>(done_) / 1e6,
                   static_cast<double>(total_) / 1e6, static_cast<double>(done_) / 1e6 / seconds);
  }

 private:
  std::string what_;
  std::uint64_t total_, done_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), last_ = start_;
};

// Reads `from` whole (into `to` when given, written through to the device), returning its
// CRC-32C; IoError when it does not hold `size` bytes. `from_device`: what the page cache holds
// of it is dropped first, so that the bytes checked are those on the device.
std::uint32_t read_file(const fs::path& from, std::uint64_t size, const fs::path* to, Progress& progress,
                        bool from_device = false) {
  const Fd in(from, O_RDONLY);
  if (from_device) ::posix_fadvise(in.get(), 0, 0, POSIX_FADV_DONTNEED);
  std::unique_ptr<Fd> out;
  if (to) out = std::make_unique<Fd>(*to, O_WRONLY | O_CREAT | O_TRUNC, 0400);
  std::vector<char> buffer(kChunk);
  std::uint32_t crc = 0;
  std::uint64_t total = 0;
  while (true) {
    const ssize_t n = ::read(in.get(), buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError(from.string() + ": cannot be read: " + system_reason());
    if (n == 0) break;
    crc = checkpoint::crc32c(buffer.data(), static_cast<std::size_t>(n), crc);
    total += static_cast<std::uint64_t>(n);
    progress.add(static_cast<std::uint64_t>(n));
    for (ssize_t done = 0; out && done < n;) {
      const ssize_t w = ::write(out->get(), buffer.data() + done, static_cast<std::size_t>(n - done));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) throw IoError(to->string() + ": cannot be written: " + system_reason());
      done += w;
    }
  }
  if (total != size) {
    throw IoError(fmt::format("{} holds {} bytes where {} were expected (it changed while being staged, or the "
                              "copy is damaged)", from.string(), total, size));
  }
  if (out && ::fdatasync(out->get()) != 0) throw IoError(to->string() + ": cannot be written: " + system_reason());
  return crc;
}

nlohmann::json manifest_of(const std::string& source, const std::vector<StagedFile>& files) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& f : files) {
    list.push_back({{"path", f.path}, {"size", f.size}, {"mtime_ns", f.mtime_ns}, {"crc32c", f.crc}});
  }
  return {{"source", source}, {"files", list}};
}

// Whether the copy in `copy` (with its manifest) is of `source` as it is now, every file with
// its checksum; fills the files' checksums when it is.
bool reusable(const fs::path& copy, const fs::path& manifest, const std::string& source,
              std::vector<StagedFile>& files, Progress& progress) {
  std::error_code ec;
  if (!fs::exists(manifest, ec) || !fs::exists(copy, ec)) return false;
  nlohmann::json recorded;
  try {
    recorded = core::read_json_file(manifest.string());
    if (recorded.at("source") != source || recorded.at("files").size() != files.size()) return false;
    for (std::size_t i = 0; i < files.size(); ++i) {
      const auto& r = recorded["files"][i];
      if (r.at("path") != files[i].path || r.at("size") != files[i].size || r.at("mtime_ns") != files[i].mtime_ns) {
        return false;
      }
      files[i].crc = r.at("crc32c").get<std::uint32_t>();
    }
  } catch (const std::exception& e) {
    core::log_warning("data.stage: {} is not a manifest hpctrial can read ({}); the data is copied again",
                      manifest.string(), e.what());
    return false;
  }
  for (const auto& f : files) {
    const fs::path file = f.path.empty() ? copy : copy / f.path;
    bool same = fs::is_regular_file(file, ec) && fs::file_size(file, ec) == f.size;
    try {
      same = same && read_file(file, f.size, nullptr, progress, /*from_device=*/true) == f.crc;
    } catch (const IoError& e) {
      core::log_warning("data.stage: {}", e.what());
      same = false;
    }
    if (!same) {
      core::log_warning("data.stage: the staged {} differs from its manifest; the data is copied again", file.string());
      return false;
    }
  }
  return true;
}

void check_space(const fs::path& root, std::uint64_t needed, const std::string& key) {
  struct statvfs st {};
  if (::statvfs(root.c_str(), &st) != 0) return;
  const std::uint64_t free = static_cast<std::uint64_t>(st.f_bavail) * st.f_frsize;
  if (free < needed) {
    throw IoError(fmt::format("data.{} needs {} bytes and {} has {} free; stage to a larger place (data.stage.to) or "
                              "free some", key, needed, root.string(), free));
  }
}

// The three places of a staging folder: the copies, their manifests and the copies being made,
// apart, so that no key's name is another's manifest or temporary.
fs::path copies_of(const fs::path& folder) { return folder / "data"; }
fs::path manifests_of(const fs::path& folder) { return folder / "manifests"; }
fs::path partials_of(const fs::path& folder) { return folder / "partial"; }

// Copies `source` to `copy` (data/<key>/<name>) by way of a partial folder, reading the copy back
// to compare.
void copy_source(const fs::path& source, const fs::path& copy, const fs::path& folder, std::vector<StagedFile>& files,
                 Progress& progress) {
  const fs::path partial = partials_of(folder) / copy.parent_path().filename();
  fs::remove_all(partial);
  core::create_directories(partial.string());
  const fs::path target = partial / copy.filename();
  for (auto& f : files) {
    const fs::path from = f.path.empty() ? source : source / f.path;
    const fs::path to = f.path.empty() ? target : target / f.path;
    core::create_directories(to.parent_path().string());
    f.crc = read_file(from, f.size, &to, progress);
    if (read_file(to, f.size, nullptr, progress, /*from_device=*/true) != f.crc) {
      throw IoError("the copy " + to.string() + " of " + from.string() + " reads back with another checksum (a "
                    "failing disk or memory on this node)");
    }
  }
  core::publish_file(partial.string(), copy.parent_path().string());  // the manifest, written next, says it is whole
}

// Stages one key; returns what was done, for the log.
std::string stage_key(const std::string& key, const fs::path& source, const fs::path& folder) {
  std::error_code ec;
  if (!fs::exists(source, ec)) {
    throw ConfigError("data." + key + " names " + source.string() + ", which does not exist; fix the path or leave " +
                      "the key out of data.stage.keys");
  }
  std::vector<StagedFile> files = list_source(source);
  std::uint64_t bytes = 0;
  for (const auto& f : files) bytes += f.size;
  const fs::path copy = copies_of(folder) / key / source.filename();
  const fs::path manifest = manifests_of(folder) / (key + ".json");
  const std::string size = fmt::format("{:.1f} MB in {} file{}", static_cast<double>(bytes) / 1e6, files.size(),
                                       files.size() == 1 ? "" : "s");
  const auto start = std::chrono::steady_clock::now();
  Progress checked("data." + key + ": checking the copy " + copy.string(), bytes);
  if (reusable(copy, manifest, source.string(), files, checked)) {
    return "reused " + copy.string() + " (" + size + ", checksums verified)";
  }
  fs::remove(manifest, ec);
  fs::remove_all(copy.parent_path());  // a stale copy: its space is the new one's
  check_space(folder, bytes, key);
  Progress copied("data." + key + ": copying " + source.string() + " and reading the copy back", 2 * bytes);
  copy_source(source, copy, folder, files, copied);
  core::write_file_atomic(manifest.string(), manifest_of(source.string(), files).dump(1) + "\n");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return fmt::format("copied to {} ({}, {:.2f} s, checksums verified)", copy.string(), size, seconds);
}

// The node's staging folder, made private (0700) where it is not there; one that is there is used
// only when it is a folder (no link) of this user that no one else may write: whoever could
// write it could replace a copy and its manifest together.
void make_own_folder(const fs::path& folder) {
  core::create_directories(folder.parent_path().string());
  if (::mkdir(folder.c_str(), 0700) != 0 && errno != EEXIST) {
    throw IoError(folder.string() + " cannot be made: " + system_reason());
  }
  struct stat st {};
  if (::lstat(folder.c_str(), &st) != 0) throw IoError(folder.string() + " cannot be read: " + system_reason());
  std::string wrong;
  if (!S_ISDIR(st.st_mode)) {
    wrong = "is not a folder";
  } else if (st.st_uid != ::geteuid()) {
    wrong = "belongs to user id " + std::to_string(st.st_uid) + ", not to this user (" + std::to_string(::geteuid()) + ")";
  } else if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    wrong = fmt::format("may be written by others (mode {:04o})", st.st_mode & 07777);
  }
  if (!wrong.empty()) {
    // A ConfigError: no restart makes it right.
    throw ConfigError("data.stage: " + folder.string() + " " + wrong + ": hpctrial stages only into a folder of the "
                  "user's own that no one else may write. Remove it (or ask its owner to), or stage elsewhere "
                  "(data.stage.to)");
  }
}

// The first error of any rank, on every rank ('?' before a ConfigError's).
std::string agree(comm::Communicator& world, const std::string& mine) {
  std::string first;
  for (const auto& e : world.gather(mine, 0)) {
    if (first.empty()) first = e;
  }
  world.broadcast(first, 0);
  return first;
}

// data.stage.keys, or every key holding an absolute path that exists here.
std::vector<std::pair<std::string, std::string>> chosen_keys(const core::ExperimentConfig& config) {
  std::vector<std::pair<std::string, std::string>> keys;
  if (config.stage.keys.empty()) {
    for (const auto& entry : config.data.entries()) {
      std::error_code ec;
      if (entry.key == "stage" || !entry.value.is_scalar() || entry.value.text().empty()) continue;
      if (entry.value.text().front() == '/' && fs::exists(entry.value.text(), ec)) {
        keys.emplace_back(entry.key, entry.value.text());
      }
    }
    return keys;
  }
  for (const auto& key : config.stage.keys) {
    const core::ConfigNode* value = config.data.find(key);
    if (value == nullptr || !value->is_scalar()) {
      throw ConfigError("data.stage.keys names \"" + key + "\", which is not a key of data holding a path");
    }
    keys.emplace_back(key, value->text());
  }
  return keys;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> keys_to_stage(const core::ExperimentConfig& config) {
  std::vector<std::pair<std::string, std::string>> keys = chosen_keys(config);
  for (const auto& [key, path] : keys) {
    if (!core::is_safe_file_name(key)) {  // it names the copy's folder
      throw ConfigError("data." + key + " is staged, and its key cannot name a folder; rename the key so that it "
                        "holds no '/' and is not '.' or '..'");
    }
  }
  return keys;
}

std::string stage_owner(const core::ExperimentIdentity& identity, int trial_id) {
  return identity.id + "-trial-" + std::to_string(trial_id);
}

std::string stage_root(const core::DataStage& stage) {
  using To = core::DataStage::To;
  if (stage.to == To::kShm) return "/dev/shm";
  if (stage.to == To::kPath) return stage.path;
  const char* tmpdir = std::getenv("TMPDIR");
  std::error_code ec;
  if (tmpdir != nullptr && tmpdir[0] == '/' && fs::is_directory(tmpdir, ec)) return tmpdir;
  return "/tmp";
}

std::string stage_data(core::ExperimentConfig& config, comm::Communicator& world, bool stager,
                       const std::string& owner, const std::string& node_name, int node_index) {
  if (config.stage.to == core::DataStage::To::kNone) return "";
  // The chief's choice of keys, for every rank.
  std::string chosen;
  if (world.rank() == 0) {
    try {
      nlohmann::json list = nlohmann::json::array();
      for (const auto& [key, path] : keys_to_stage(config)) {
        fs::path source = core::resolve_user_path(path, fs::current_path(), "data." + key);
        if (source.filename().empty()) source = source.parent_path();  // "/data/set/"
        list.push_back({key, source.string()});
      }
      chosen = list.dump();
    } catch (const ConfigError& e) {
      chosen = std::string("?") + e.what();
    }
  }
  world.broadcast(chosen, 0);
  if (chosen.front() == '?') throw ConfigError(chosen.substr(1));
  const auto keys = nlohmann::json::parse(chosen);
  if (keys.empty()) {
    if (world.rank() == 0) {
      core::log_warning("data.stage is set, and no key of data holds the absolute path of a file or folder here; "
                        "nothing is staged (list them: data.stage.keys)");
    }
    return "";
  }
  // One name a node. Where two of MPI's nodes go by one name (aliases of one host), each gets
  // its index too: a folder has one stager.
  std::string named = node_name;
  for (const std::string& other : world.allgather(node_name + "\n" + std::to_string(node_index))) {
    if (other.substr(0, other.find('\n')) == node_name && other.substr(other.find('\n') + 1) != std::to_string(node_index)) {
      named = node_name + "-" + std::to_string(node_index);
    }
  }
  const fs::path folder = fs::path(stage_root(config.stage)) / ("hpctrial-stage-" + owner + "-" + named);
  std::string error;
  if (stager) {
    try {
      make_own_folder(folder);
      for (const fs::path& place : {copies_of(folder), manifests_of(folder), partials_of(folder)}) {
        core::create_directories(place.string());
      }
      for (const auto& k : keys) {
        const std::string key = k[0];
        core::log_info("data.stage: node {}: data.{} {}", named, key, stage_key(key, k[1].get<std::string>(), folder));
      }
    } catch (const ConfigError& e) {
      error = "?node " + named + ": " + e.what();
    } catch (const std::exception& e) {
      error = "node " + named + ": data.stage: " + e.what();
    }
  }
  error = agree(world, error);
  if (!error.empty() && error.front() == '?') throw ConfigError(error.substr(1));
  if (!error.empty()) throw IoError(error);
  for (const auto& k : keys) {
    const std::string key = k[0];
    core::ConfigNode* value = config.data.find(key);
    *value = core::ConfigNode::scalar((copies_of(folder) / key / fs::path(k[1].get<std::string>()).filename()).string(),
                                      value->where(), true);
  }
  return folder.string();
}

void remove_staged_data(const std::string& folder, comm::Communicator& world, bool stager) {
  if (folder.empty()) return;
  world.barrier();
  if (!stager) return;
  std::error_code ec;
  fs::remove_all(folder, ec);
  if (ec) core::log_warning("data.stage: {} could not be removed: {}", folder, ec.message());
}

}  // namespace hpctrial::trainer::detail
