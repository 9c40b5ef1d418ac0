// A checkpoint that every rank writes part of: the chief its datasets, each rank its pieces of
// the sharded optimizers' state (internal to the trainer; checkpoint/shared_write.h is the file
// side). A collective:
//
//   1. every rank sends the chief where its pieces go and their checksums;
//   2. the chief lays the file out (CheckpointStore::plan) and tells every rank the offsets;
//   3. every rank writes its pieces and makes them durable;
//   4. the chief, told that every rank succeeded, writes its own datasets, combines the pieces'
//      checksums into each dataset's, and publishes the file (`latest`, retention).
//
// A failure anywhere (a rank's disk full, a layout that fails) is told to every rank, which all
// throw the same CheckpointError naming the rank; the temporary file is removed and nothing is
// published, so no half-written checkpoint is ever taken for a good one.
#pragma once

#include <string>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/comm/communicator.h"
#include "zero.h"

namespace hpctrial::trainer::detail {

// `store` and `contents` are the chief's (ignored elsewhere); `mine` is this rank's share, whose
// `datasets` are the same on every rank. `pieces` are the options this rank writes its pieces
// with (the store's, or a test's failing filesystem). Returns the published path on every rank.
std::string write_sharded_checkpoint(comm::Communicator& comm, checkpoint::CheckpointStore* store,
                                     const checkpoint::Contents& contents, const ShardedSave& mine,
                                     const checkpoint::WriteOptions& pieces);

}  // namespace hpctrial::trainer::detail
