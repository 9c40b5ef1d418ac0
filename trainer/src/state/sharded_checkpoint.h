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
// write_sharded_checkpoint does all four while the loop waits. A periodic checkpoint does 1-2 at
// a step boundary and leaves 3-4 to threads (ShardedWriteInFlight, the chief's
// AsyncCheckpointWriter); the loop learns at each later step boundary whether every rank is done
// and then settles it: 4, or the failure.
//
// A failure anywhere (a rank's disk full, a layout that fails) is told to every rank, which all
// throw the same CheckpointError naming the rank; the temporary file is removed and nothing is
// published, so no half-written checkpoint is ever taken for a good one.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/checkpoint/shared_write.h"
#include "hpctrial/checkpoint/store.h"
#include "state/checkpointing.h"
#include "hpctrial/comm/communicator.h"
#include "parallel/zero.h"

namespace hpctrial::trainer::detail {

// Adds each of `part`'s datasets to `mine` as a piece of its own covering it whole (a rank that
// writes a part of a model split over ranks).
void add_whole_pieces(ShardedSave& mine, const checkpoint::Contents& part);

// Makes the ranks' datasets one list, the same on every rank: each name once, in rank order,
// and each rank's pieces pointing into it. Where the ranks' lists differ (the parts of a model
// split over ranks, ZeRO's shards of each part) a layout needs it first. A collective;
// InternalError for a name two ranks give different types or shapes.
void unite_datasets(comm::Communicator& comm, ShardedSave& mine);

// Where this rank's pieces go (steps 1-2).
struct PieceLayout {
  checkpoint::FilePlan plan;           // the chief's; empty elsewhere
  std::vector<std::string> gathered;   // the chief's: every rank's records of its pieces
  std::string temp;                    // the file every rank writes into
  std::vector<std::uint64_t> offsets;  // where each of ShardedSave::datasets starts in it
};

// Collective. `store`, `chief_datasets` (the chief's own, in the order it writes them) and
// `attributes` are the chief's. Throws the chief's CheckpointError on every rank when the layout
// fails.
PieceLayout lay_out_pieces(comm::Communicator& comm, checkpoint::CheckpointStore* store,
                           std::vector<checkpoint::DatasetSpec> chief_datasets,
                           std::map<std::string, std::string> attributes, const ShardedSave& mine);

// Step 3 on this rank: writes its pieces and makes them durable. Returns the error, or empty.
// `midway` runs when half of the pieces are written (the tests' fault hook).
std::string write_pieces(const PieceLayout& layout, const ShardedSave& mine, const checkpoint::WriteOptions& options,
                         const std::function<void()>& midway = {});

// The first failure any rank reports, as "rank R: what", or empty; every rank learns it.
std::string agree(comm::Communicator& comm, const std::string& mine);

// The chief's: the checksum of each shared dataset from the ranks' pieces, which must tile it.
std::vector<std::uint32_t> combine_piece_crcs(const std::vector<checkpoint::DatasetSpec>& datasets,
                                              const std::vector<std::string>& gathered);

// The chief's part of step 4: writes its datasets into the planned file and makes them durable;
// their checksums, in order.
std::vector<std::uint32_t> write_planned_datasets(const checkpoint::Contents& contents, const checkpoint::FilePlan& plan,
                                                  const checkpoint::WriteOptions& options);

// All four steps. `store` and `contents` are the chief's (ignored elsewhere); `mine` is this
// rank's share, whose `datasets` are the same on every rank. `pieces` are the options this rank
// writes its pieces with (the store's, or a test's failing filesystem). Returns the published
// path on every rank.
std::string write_sharded_checkpoint(comm::Communicator& comm, checkpoint::CheckpointStore* store,
                                     const checkpoint::Contents& contents, const ShardedSave& mine,
                                     const checkpoint::WriteOptions& pieces, const std::function<void()>& midway = {});

// Steps 3-4 of a checkpoint the loop does not wait for, on one rank: this rank's pieces written by
// a thread of its own, and on the chief its datasets by its AsyncCheckpointWriter (planned()).
class ShardedWriteInFlight {
 public:
  ShardedWriteInFlight(PieceLayout layout, ShardedSave mine, const checkpoint::WriteOptions& options,
                       std::function<void()> midway, bool chief);
  // Waits for the thread; a chief's writer still waiting for the pieces is told to abandon.
  ~ShardedWriteInFlight();
  ShardedWriteInFlight(const ShardedWriteInFlight&) = delete;
  ShardedWriteInFlight& operator=(const ShardedWriteInFlight&) = delete;

  // Whether every part this rank writes is durable or has failed.
  bool done() const;
  // Once done: the first error of this rank's parts, or empty.
  std::string wait();
  const PieceLayout& layout() const { return layout_; }
  const ShardedSave& mine() const { return mine_; }

  // The chief's: for its writer, and then what the writer does once every rank is done.
  PlannedWrite planned();
  void publish(std::vector<std::uint32_t> crcs);
  void abandon(const std::string& why);

 private:
  struct Shared {
    std::mutex mutex;
    std::condition_variable changed;
    int outstanding = 0;
    std::string error;
    std::promise<std::vector<std::uint32_t>> crcs;
    bool settled = false;
  };
  static void part_done(Shared& shared, const std::string& error);

  PieceLayout layout_;
  ShardedSave mine_;
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  std::thread thread_;
};

}  // namespace hpctrial::trainer::detail
