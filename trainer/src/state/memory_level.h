// checkpoint_levels.memory: each rank's state copied into node memory, where a restart inside the
// job finds it after a rank failed. A store of the same checkpoint files as the shared
// filesystem's, one a rank (rank/node_memory.h says where and for how long), two copies kept so
// that a copy torn by the failure never leaves a rank without a good one; the loop copies the
// state (the only stall) and a thread of its own writes it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/rank/node_memory.h"
#include "state/checkpointing.h"

namespace hpctrial::trainer::detail {

class MemoryLevel {
 public:
  // `ranks_on_node`: this node's ranks, whose copies share its memory.
  MemoryLevel(const core::CheckpointLevels& levels, rank::NodeMemoryPlace place, int ranks_on_node);

  // Hands the snapshot to the writer (after the previous one is written). The first one's size
  // is checked: ConfigError when two copies a rank on this node would take more than
  // max_share of its memory, or more than its memory directory has free.
  void submit(Snapshot snapshot);
  // Returns once the deferred tensors of the last snapshot are copied (training may step).
  void wait_for_copies() { writer_->wait_for_copies(); }
  // Returns once the last copy is written (rethrowing its error).
  void wait() { writer_->wait(); }

  // The batches of the copies this rank holds, newest first (by their files' manifests; a copy
  // is read whole and verified when it is loaded).
  std::vector<std::int64_t> held() const;
  // This rank's copy at `batches`, read and verified; CheckpointError when it is not good.
  checkpoint::CheckpointStore::Loaded load(std::int64_t batches) const;
  const std::string& dir() const { return memory_.dir(); }
  // Waits for the writer and removes this rank's copies (the trial's run ended).
  void remove();

 private:
  void check_fits(std::uint64_t bytes) const;

  core::CheckpointLevels levels_;
  int ranks_on_node_;
  rank::NodeMemory memory_;
  std::unique_ptr<checkpoint::CheckpointStore> store_;
  std::unique_ptr<AsyncCheckpointWriter> writer_;
  bool checked_ = false;
};

}  // namespace hpctrial::trainer::detail
