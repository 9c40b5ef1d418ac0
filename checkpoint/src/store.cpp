#include "hpctrial/checkpoint/store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>

#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/metric_order.h"

namespace hpctrial::checkpoint {
namespace {

namespace fs = std::filesystem;

constexpr const char* kLatest = "latest";

std::optional<double> metric_of(const std::map<std::string, std::string>& attributes) {
  const auto it = attributes.find(kMetricAttribute);
  if (it == attributes.end()) return std::nullopt;
  try {
    return std::stod(it->second);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace

std::optional<std::int64_t> checkpoint_batches(const std::string& name) {
  static const std::regex pattern("ckpt-([0-9]{1,18})\\.h5");
  std::smatch match;
  if (!std::regex_match(name, match, pattern)) return std::nullopt;
  return std::stoll(match[1]);
}

CheckpointStore::CheckpointStore(std::string dir, StoreOptions options) : dir_(std::move(dir)), options_(options) {
  core::create_directories(dir_, options_.dir_mode);
}

FileSystem& CheckpointStore::fs() const { return options_.fs != nullptr ? *options_.fs : posix_file_system(); }

std::string CheckpointStore::path_for(std::int64_t batches) const {
  return (fs::path(dir_) / ("ckpt-" + std::to_string(batches) + ".h5")).string();
}

std::optional<std::string> CheckpointStore::latest_file() const {
  std::ifstream in(fs::path(dir_) / kLatest);
  std::string name;
  if (!in || !std::getline(in, name) || !checkpoint_batches(name)) return std::nullopt;
  return name;
}

void CheckpointStore::publish(const Contents& contents) {
  const auto batches_it = contents.attributes.find(kBatchesAttribute);
  if (batches_it == contents.attributes.end()) throw InternalError("publish: the contents carry no 'batches'");
  const std::int64_t batches = std::stoll(batches_it->second);
  const std::string path = path_for(batches);
  write_checkpoint(path, contents, write_options());
  point_latest_at(path);
}

WriteOptions CheckpointStore::write_options() const {
  WriteOptions write;
  write.mode = options_.file_mode;
  write.direct_io = options_.direct_io;
  write.fs = options_.fs;
  return write;
}

FilePlan CheckpointStore::plan(std::vector<DatasetSpec> datasets, std::map<std::string, std::string> attributes) const {
  const auto batches_it = attributes.find(kBatchesAttribute);
  if (batches_it == attributes.end()) throw InternalError("plan: the attributes carry no 'batches'");
  return plan_checkpoint(path_for(std::stoll(batches_it->second)), std::move(datasets), std::move(attributes),
                         write_options());
}

void CheckpointStore::publish_planned(const FilePlan& plan, const std::vector<std::uint32_t>& crcs) {
  finish_checkpoint(plan, crcs, write_options());
  point_latest_at(plan.path);
}

void CheckpointStore::abandon(const FilePlan& plan) const { abandon_checkpoint(plan, write_options()); }

void CheckpointStore::point_latest_at(const std::string& path) {
  // The pointer, through the same seam.
  const std::string name = fs::path(path).filename().string();
  const std::string pointer = (fs::path(dir_) / kLatest).string();
  try {
    core::write_file_atomic(pointer, name + "\n", options_.file_mode, fs());
  } catch (const IoError& e) {
    throw IoError(std::string(e.what()) + " (the checkpoint " + path + " is complete, but " + kLatest +
                  " still names the previous one)");
  }
  apply_retention(name);
}

void CheckpointStore::apply_retention(const std::string& keep) {
  std::vector<CheckpointInfo> all = list(/*verify=*/false);
  std::set<std::string> kept = {keep};
  int newest = 0;
  for (const auto& info : all) {  // newest first
    if (!info.valid) continue;
    if (newest++ < options_.keep_latest) kept.insert(info.file);
  }
  std::vector<const CheckpointInfo*> scored;
  for (const auto& info : all) {
    if (info.valid && info.metric) scored.push_back(&info);
  }
  // Non-finite metrics (a diverged run's NaN) rank last: never kept as the best over a real one.
  std::stable_sort(scored.begin(), scored.end(), [&](const CheckpointInfo* a, const CheckpointInfo* b) {
    return core::metric_better(*a->metric, *b->metric, options_.smaller_is_better);
  });
  for (int i = 0; i < options_.keep_best && i < static_cast<int>(scored.size()); ++i) kept.insert(scored[static_cast<std::size_t>(i)]->file);
  for (const auto& info : all) {
    if (kept.count(info.file) != 0) continue;
    if (!info.valid) continue;  // not ours to judge: left for the user (`hpctrial checkpoint list`)
    const std::string path = (fs::path(dir_) / info.file).string();
    if (fs().unlink(path) != 0) core::log_warning("cannot delete the old checkpoint {}: {}", path, std::strerror(errno));
  }
}

std::vector<CheckpointInfo> CheckpointStore::list(bool verify) const {
  std::vector<CheckpointInfo> out;
  const auto latest = latest_file();
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    const auto batches = checkpoint_batches(name);
    if (!batches) continue;
    CheckpointInfo info;
    info.file = name;
    info.batches = *batches;
    info.latest = latest && *latest == name;
    struct stat st {};
    if (::stat(entry.path().c_str(), &st) == 0) {
      info.size = static_cast<std::uint64_t>(st.st_size);
      info.modified = st.st_mtime;
    }
    try {
      if (verify) {
        info.metric = metric_of(read_checkpoint(entry.path().string()).attributes);
      } else {
        info.metric = metric_of(read_summary(entry.path().string()).attributes);
      }
      info.valid = true;
    } catch (const Error& e) {
      info.problem = e.what();
    }
    out.push_back(std::move(info));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.batches > b.batches; });
  return out;
}

std::optional<CheckpointStore::Loaded> CheckpointStore::load_latest(std::vector<std::string>* problems,
                                                                    const Acceptor& accept,
                                                                    const ReadOptions& options) const {
  std::vector<std::string> candidates;
  if (const auto latest = latest_file()) {
    candidates.push_back(*latest);
  } else if (fs::exists(fs::path(dir_) / kLatest)) {
    problems->push_back((fs::path(dir_) / kLatest).string() + ": does not name a checkpoint file");
  }
  std::vector<std::pair<std::int64_t, std::string>> others;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    const auto batches = checkpoint_batches(name);
    if (batches && (candidates.empty() || name != candidates.front())) others.emplace_back(*batches, name);
  }
  std::sort(others.rbegin(), others.rend());
  for (const auto& [batches, name] : others) candidates.push_back(name);
  for (const auto& name : candidates) {
    const std::string path = (fs::path(dir_) / name).string();
    try {
      Loaded loaded{path, *checkpoint_batches(name), read_checkpoint(path, options)};
      if (accept) accept(loaded);
      return loaded;
    } catch (const ConfigError&) {
      throw;  // the acceptor's verdict on the whole store
    } catch (const Error& e) {
      problems->push_back(e.what());
    }
  }
  return std::nullopt;
}

void CheckpointStore::remove_temporaries() const {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 5 && name.front() == '.' && name.compare(name.size() - 4, 4, ".tmp") == 0) {
      core::log_info("removing {}, left by a save that did not finish", entry.path().string());
      fs().unlink(entry.path().string());
    }
  }
}

CheckpointStore::Loaded load_checkpoint_at(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    std::vector<std::string> problems;
    auto loaded = CheckpointStore(path, {}).load_latest(&problems);
    if (!loaded) {
      std::string why = path + " holds no usable checkpoint";
      for (const auto& problem : problems) why += "; " + problem;
      throw CheckpointError(why);
    }
    return std::move(*loaded);
  }
  if (!std::filesystem::exists(path, ec)) {
    throw CheckpointError(path + " does not exist (give a checkpoint file or a trial's checkpoint directory)");
  }
  CheckpointStore::Loaded loaded;
  loaded.path = path;
  loaded.contents = read_checkpoint(path);
  const auto batches = loaded.contents.attributes.find(kBatchesAttribute);
  if (batches != loaded.contents.attributes.end()) {
    try {
      loaded.batches = std::stoll(batches->second);
    } catch (const std::exception&) {
      throw CheckpointError(path + ": its attribute " + kBatchesAttribute + " is not a number: " + batches->second);
    }
  }
  return loaded;
}

}  // namespace hpctrial::checkpoint
