// A rank's folder in node memory: made private, its leftovers removed, held while the rank lives.
#include "hpctrial/rank/node_memory.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#include "hpctrial/core/error.h"
#include "hpctrial/core/layout.h"
#include "hpctrial/core/logging.h"

namespace fs = std::filesystem;

namespace hpctrial::rank {
namespace {


// `path` is a directory of this user's, not a link to one (a folder in /dev/shm, which everyone
// may write, could be anyone's); made 0700 when it is missing.
void own_directory(const std::string& path) {
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) core::throw_errno("cannot make " + path, errno);
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) core::throw_errno("cannot read " + path, errno);
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::getuid()) {
    throw IoError(path + " is not a directory of this user's (uid " + std::to_string(::getuid()) +
                  "), so hpctrial will not keep copies of a trial's state in it; remove it, or set "
                  "checkpoint_levels.memory.dir to another node-local directory");
  }
  if ((st.st_mode & 077) != 0 && ::chmod(path.c_str(), 0700) != 0) core::throw_errno("cannot make " + path + " private", errno);
}

// The newest modification time of the session's lock and of anything in it.
fs::file_time_type last_used(const fs::path& session) {
  std::error_code ec;
  fs::file_time_type newest = fs::last_write_time(core::NodeMemoryLayout::lock_file(session.string()), ec);
  if (ec) newest = fs::file_time_type::min();
  for (fs::recursive_directory_iterator it(session, ec), end; !ec && it != end; it.increment(ec)) {
    const auto t = fs::last_write_time(it->path(), ec);
    if (!ec && t > newest) newest = t;
    ec.clear();
  }
  return newest;
}

// Whether a session of another trial was left over: no rank holds it, and it was last used over
// `stale_after` ago. Takes its lock while it looks, so that a rank starting there waits.
bool left_over(const fs::path& session, std::chrono::seconds stale_after) {
  const std::string lock_path = core::NodeMemoryLayout::lock_file(session.string());
  const core::UniqueFd lock(::open(lock_path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW));
  if (lock.get() < 0) return errno == ENOENT && fs::file_time_type::clock::now() - last_used(session) > stale_after;
  if (!core::lock_file_exclusive(lock.get(), lock_path, core::LockWait::kTry)) return false;
  return fs::file_time_type::clock::now() - last_used(session) > stale_after;
}

void remove_tree(const fs::path& path, const char* why) {
  std::error_code ec;
  const auto removed = fs::remove_all(path, ec);
  if (ec) {
    core::log_warning("cannot remove {} ({}): {}", path.string(), why, ec.message());
  } else if (removed > 0) {
    core::log_debug("removed {} ({})", path.string(), why);
  }
}

// A name made of [A-Za-z0-9._-] and not "." or "..": one folder, never a path.
bool plain_name(const std::string& name) {
  if (name.empty() || name == "." || name == "..") return false;
  for (const char c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') return false;
  }
  return true;
}

// The user's folder locked against the other ranks of this user on this node while one of them
// looks for leftovers, makes its folders or removes them.
core::UniqueFd lock_user_dir(const std::string& user_dir) {
  const std::string path = core::NodeMemoryLayout::lock_file(user_dir);
  core::UniqueFd lock(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (lock.get() < 0) core::throw_errno("cannot open " + path, errno);
  core::lock_file_exclusive(lock.get(), path);
  return lock;
}

// The folders in `dir` (not links), listed before anything in it is removed.
std::vector<fs::path> subdirectories(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_directory(ec) && !it->is_symlink(ec)) out.push_back(it->path());
  }
  return out;
}

// Removes `dir` if it is empty (a trial's or experiment's folder whose last session went).
void remove_if_empty(const fs::path& dir) {
  std::error_code ec;
  if (fs::is_empty(dir, ec) && !ec) fs::remove(dir, ec);
}

}  // namespace

NodeMemory::NodeMemory(NodeMemoryPlace place, std::chrono::seconds stale_after) : place_(std::move(place)) {
  struct stat root {};
  if (::stat(place_.root.c_str(), &root) != 0 || !S_ISDIR(root.st_mode)) {
    throw IoError("checkpoint_levels.memory.dir " + place_.root + " is not a directory on this node; name a "
                  "node-local tmpfs, e.g. /dev/shm");
  }
  if (!plain_name(place_.experiment_id) || !plain_name(place_.session)) {
    throw IoError("cannot name a folder in node memory after experiment \"" + place_.experiment_id + "\" and run \"" +
                  place_.session + "\": each must be one name of letters, digits, '.', '_' and '-'");
  }
  const core::NodeMemoryLayout layout{place_.root, static_cast<unsigned>(::getuid()), place_.experiment_id,
                                      place_.trial, place_.session, place_.rank};
  user_dir_ = layout.user_dir();
  const fs::path experiment = layout.experiment_dir();
  trial_dir_ = layout.trial_dir();
  session_dir_ = layout.session_dir();
  dir_ = layout.rank_dir();
  own_directory(user_dir_);
  const core::UniqueFd user_lock = lock_user_dir(user_dir_);
  // What earlier runs left on this node.
  for (const fs::path& e : subdirectories(user_dir_)) {
    for (const fs::path& t : subdirectories(e)) {
      for (const fs::path& session : subdirectories(t)) {
        const bool this_trial = t == fs::path(trial_dir_);
        if (this_trial && session.filename() == place_.session) continue;  // this run's, from an earlier attempt
        if (this_trial) {
          remove_tree(session, "an earlier run of this trial left it");
        } else if (left_over(session, stale_after)) {
          remove_tree(session, "left by a run that ended without removing it");
        }
      }
      remove_if_empty(t);
    }
    remove_if_empty(e);
  }
  for (const std::string& dir : {experiment.string(), trial_dir_, session_dir_, dir_}) own_directory(dir);
  const std::string lock_path = core::NodeMemoryLayout::lock_file(session_dir_);
  lock_ = core::UniqueFd(::open(lock_path.c_str(), O_RDONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (lock_.get() < 0) core::throw_errno("cannot open " + lock_path, errno);
  core::lock_file_shared(lock_.get(), lock_path);
  touch();
}

void NodeMemory::touch() const {
  const std::string lock_path = core::NodeMemoryLayout::lock_file(session_dir_);
  ::utimensat(AT_FDCWD, lock_path.c_str(), nullptr, 0);
}

void NodeMemory::remove() {
  const core::UniqueFd user_lock = lock_user_dir(user_dir_);
  remove_tree(dir_, "the trial's run ended");
  // The last rank of the session on this node takes the session with it.
  if (subdirectories(session_dir_).empty()) {
    lock_ = core::UniqueFd();
    remove_tree(session_dir_, "the trial's run ended");
    remove_if_empty(trial_dir_);
    remove_if_empty(fs::path(trial_dir_).parent_path());
  }
}

std::uint64_t NodeMemory::node_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemTotal:") return kib * 1024;
  }
  return 0;
}

std::uint64_t NodeMemory::free_bytes(const std::string& dir) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return 0;
  return static_cast<std::uint64_t>(st.f_bavail) * st.f_frsize;
}

}  // namespace hpctrial::rank
