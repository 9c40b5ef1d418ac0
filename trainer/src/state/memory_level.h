// checkpoint_levels.memory: each rank's state copied into node memory, where a restart inside the
// job finds it after a rank failed: two slot files a rank (checkpoint/memory_slots.h), written by
// turns, so that a copy torn by the failure never leaves a rank without a good one, in a folder
// that rank/node_memory.h places and removes. The level's thread has the live tensors copied
// straight into the slot, by a copier at the idle scheduling class and by training when its
// optimizer must wait for them (and only then), then copies the rest and commits the copy. A
// checkpoint on the shared filesystem may be written from a copy (pinned_copy): no second copy
// of the live state.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "hpctrial/checkpoint/memory_slots.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/rank/node_memory.h"
#include "hpctrial/rank/partner_copies.h"
#include "state/checkpointing.h"

namespace hpctrial::trainer::detail {

class MemoryLevel {
 public:
  // `ranks_on_node`: this node's ranks, whose copies share its memory.
  MemoryLevel(const core::CheckpointLevels& levels, rank::NodeMemoryPlace place, int ranks_on_node);
  ~MemoryLevel();
  MemoryLevel(const MemoryLevel&) = delete;
  MemoryLevel& operator=(const MemoryLevel&) = delete;

  // Hands the snapshot to the level's thread (after the previous copy is written, rethrowing its
  // error). The first one's size is checked: ConfigError when two copies a rank on this node
  // would take more than max_share of its memory, or more than its memory directory has free.
  void submit(Snapshot snapshot);
  // Returns once the deferred tensors of the last snapshot are in their slot (training may step).
  // What the level's thread has not copied yet, the caller copies (at its own priority).
  void wait_for_copies();
  // Without waiting: the seconds training waited for the last copy (wait_for_copies: its tensors
  // copied), once the copy is committed, and only once; nullopt while it is still being written.
  std::optional<double> take_wait_seconds();
  // Whether a copy of `batches` submitted now would wait for a checkpoint being written from a
  // copy in its slot (pinned_copy): the loop holds it back then. Conservative while a copy is in
  // flight.
  bool next_copy_would_wait(std::int64_t batches);
  // The copy of `batches` (the last submitted) as a checkpoint's contents, for a checkpoint on the
  // shared filesystem written from it: a function that, called on another thread, waits for the
  // copy to be committed and gives its datasets as views of its slot (CheckpointError when the
  // copy failed or the level closed). From now until the function and the views are gone, the
  // level's thread writes no copy into that slot: it waits.
  std::function<checkpoint::Contents()> pinned_copy(std::int64_t batches);

  // checkpoint_levels.partner: from the next copy on, the level's thread sends each copy to
  // `partners.send_to` over `comm` (the level's own) and keeps those of `partners.receive_from`
  // in this rank's folder. Before the first copy.
  void set_partners(std::unique_ptr<comm::Communicator> comm, rank::Partners partners);
  bool has_partners() const { return partner_comm_ != nullptr; }

  // The batches of the copies this rank holds, newest first (by their headers and manifests; a
  // copy is read whole and verified when it is loaded).
  std::vector<std::int64_t> held() const;
  // The batches of the copies this rank keeps for others (a partner's, maybe of an earlier
  // attempt with other partners), by their rank.
  std::map<int, std::vector<std::int64_t>> kept();
  // At a restart, every rank: each (owner, keeper) in `moves` sends the keeper's copy of the
  // owner's state at `batches` to the owner, which holds it from then on as its own. Over the
  // partners' communicator, while the thread is idle. CheckpointError when this rank's copy does
  // not arrive whole, or this rank has none to send (its owner's arrives as none).
  void restore(const std::vector<std::pair<int, int>>& moves, std::int64_t batches);
  // Removes the copies kept for ranks that are no longer this rank's sources (after a restart).
  void drop_kept_of_others();
  // This rank's copy at `batches`, read and verified; CheckpointError when it is not good.
  checkpoint::CheckpointStore::Loaded load(std::int64_t batches) const;
  const std::string& dir() const { return memory_.dir(); }
  // Waits for the thread and removes this rank's copies (the trial's run ended).
  void remove();

 private:
  void check_fits(std::uint64_t bytes) const;
  void run();
  void write(Snapshot& snapshot);
  void write_own(Snapshot& snapshot, std::int64_t batches);
  void exchange(std::int64_t batches, bool have_copy);
  checkpoint::MemorySlots& kept_slots(int source);
  void stop_thread();
  void copy_pieces();

  // What a checkpoint written from a copy waits on, and the copies it keeps from being replaced:
  // shared with the functions pinned_copy gives, which may outlive the level.
  struct Progress {
    std::mutex mutex;
    std::condition_variable changed;
    std::int64_t finished = -1;  // the batch of the last copy committed or failed
    std::int64_t failed = -1;    // the batch of the last copy that failed, and why
    std::string error;
    bool closed = false;
    std::multiset<std::int64_t> pinned;
  };
  // The live tensors' bytes to copy into a slot, in pieces that the copier and a training thread
  // waiting for them (wait_for_copies) both take, each the next one not taken.
  struct CopyWork {
    struct Piece {
      std::size_t tensor = 0;
      std::size_t offset = 0, size = 0;
      std::uint32_t crc = 0;
    };
    std::vector<const char*> from;
    std::vector<char*> to;
    std::vector<Piece> pieces;
    std::atomic<std::size_t> next{0};
    std::atomic<std::size_t> done{0};
    std::exception_ptr error;  // the first piece's that failed (under the level's mutex)
    // Copies pieces until none is left to take.
    void take(std::mutex& mutex, std::condition_variable& changed);
  };
  void finished(std::int64_t batches, const std::exception_ptr& error);
  void wait_until_unpinned(std::int64_t batches);

  core::CheckpointLevels levels_;
  int ranks_on_node_;
  rank::NodeMemory memory_;
  std::shared_ptr<checkpoint::MemorySlots> slots_;
  std::shared_ptr<Progress> progress_ = std::make_shared<Progress>();
  std::unique_ptr<comm::Communicator> partner_comm_;
  rank::Partners partners_;
  std::map<int, std::unique_ptr<checkpoint::MemorySlots>> kept_;  // by the rank whose copies they are
  bool checked_ = false;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::optional<Snapshot> pending_;
  bool busy_ = false;
  bool copying_ = false;  // the deferred tensors of the current snapshot are not all in their slot
  std::shared_ptr<CopyWork> work_;  // their pieces, while they are being copied
  bool stopping_ = false;
  bool copier_stopping_ = false;  // set once the level's thread has ended
  std::exception_ptr error_;
  double waited_s_ = 0;                  // by training, for the copy being written
  std::optional<double> wait_seconds_;  // for the last copy committed
  std::thread thread_;
  std::thread copier_;  // at the idle scheduling class: copy_pieces
};

}  // namespace hpctrial::trainer::detail
