// The loop's checkpoints that every rank writes part of (sharded_checkpoint.h).
#include "checkpointing.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/logging.h"
#include "loop.h"
#include "sharded_checkpoint.h"
#include "zero.h"

namespace hpctrial::trainer::detail {

// Every rank's parts of the sharded optimizers' state go straight from it into the file, in
// parallel: no rank gathers the whole state, and the chief writes the rest. Synchronous: the
// loop waits for it anyway (a stop, the end, `checkpoint_storage.async: false`).
void Loop::save_sharded_checkpoint(const detail::LoopState& state, const detail::ShardedOptimizers& sharded) {
  detail::ShardedSave mine;
  for (const auto& [index, optimizer] : sharded) optimizer->save_shards(mine, "optimizer/" + std::to_string(index));
  detail::Snapshot snapshot;
  if (chief()) {
    finish_checkpoint();  // the previous one, if still being written
    snapshot = detail::capture(*context_, *trial_, callbacks_, state, identity_, /*defer=*/false, &mine.whole);
  }
  const std::string path = detail::write_sharded_checkpoint(
      comm_, store_.get(), snapshot.contents, mine, store_ ? store_->write_options() : checkpoint::WriteOptions{});
  if (chief()) {
    result_.checkpoint_path = path;
    core::log_debug("checkpoint {} is durable (written by every rank)", path);
    call([&](Callback& c) { c.on_checkpoint_end(path); });
  }
}

}  // namespace hpctrial::trainer::detail
