// Where a rank keeps its copies in node memory (checkpoint_levels.memory), who may read them and
// when they go. A copy outlives the rank's process, so that a restart inside the job finds it:
//
//   <root>/hpctrial-<uid>/<experiment id>/trial-<N>/<session>/rank-<R>/   folders 0700, files 0600
//
// <root> is a node-local tmpfs (/dev/shm); <session> is the launcher's run of the trial
// (HPCTRIAL_SESSION), the same for each of its attempts. Every rank holds a shared lock on its
// session's `.lock` for its life and touches it at each copy. What a rank finds when it starts:
//   - an earlier session of its own trial is over (one launcher runs a trial at a time): removed;
//   - another trial's session that no rank holds and that was last used over `stale_after` ago
//     was left by a job that ended without removing it: removed. (A session between two of its
//     attempts holds no lock; one last used long ago may go then, and its trial resumes from the
//     next level: never wrong, only slower.)
// Nothing here reads a copy: another experiment's is never opened. Free of LibTorch.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "hpctrial/core/files.h"

namespace hpctrial::rank {

struct NodeMemoryPlace {
  std::string root;           // checkpoint_levels.memory.dir, absolute
  std::string experiment_id;  // the experiment's identity (a file name's characters)
  int trial = 0;
  std::string session;        // HPCTRIAL_SESSION
  int rank = 0;
};

class NodeMemory {
 public:
  // Makes this rank's folder after removing what is left over (above). IoError naming the path
  // when the root is not a directory, or the user's folder in it is not the user's own.
  explicit NodeMemory(NodeMemoryPlace place, std::chrono::seconds stale_after = std::chrono::seconds(60));
  NodeMemory(const NodeMemory&) = delete;
  NodeMemory& operator=(const NodeMemory&) = delete;

  // This rank's folder.
  const std::string& dir() const { return dir_; }
  // Marks the session as in use now (each copy does).
  void touch() const;
  // Removes this rank's folder, and the trial's on this node once no rank's is left (the
  // trial ended: its copies are of no more use).
  void remove();

  // The node's memory (MemTotal of /proc/meminfo), in bytes; 0 when it cannot be read.
  static std::uint64_t node_bytes();
  // The bytes the file system of `dir` has free for this user (statvfs); 0 when unknown.
  static std::uint64_t free_bytes(const std::string& dir);

 private:
  NodeMemoryPlace place_;
  std::string user_dir_;     // <root>/hpctrial-<uid>
  std::string trial_dir_;    // .../<experiment id>/trial-<N>
  std::string session_dir_;  // .../<session>
  std::string dir_;          // .../rank-<R>
  core::UniqueFd lock_;
};

}  // namespace hpctrial::rank
