// The ranks' replicas compared: every rank holds the same parameters, and the same state of
// each optimizer that ZeRO does not shard; a chief-only change (a callback that sets the
// learning rate on rank 0 alone) or a rank that computes differently makes them differ, and
// training on would average gradients of different models without a sign.
//
// Each replicated tensor's checksum is the integer sum of its bits (exact and independent of
// the order of summation, so equal tensors give equal sums on any device); each optimizer's
// options and scalars are a CRC-32C of their text. One all-reduce of 2 x N integers compares
// them; only on a difference is the first differing entry gathered from every rank, to name the
// ranks that hold another value than the most of them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "state/checkpointing.h"

namespace hpctrial {
class TrialContext;
namespace comm {
class Communicator;
}
}  // namespace hpctrial

namespace hpctrial::trainer::detail {

struct ReplicaChecksums {
  std::vector<std::string> names;  // as the checkpoint names them: model/0/fc1.weight, optimizer/0/param_groups
  std::vector<std::int64_t> sums;
};

// This rank's checksums of its replicated state; the sharded optimizers are left out.
ReplicaChecksums replica_checksums(TrialContext& context, const ShardedOptimizers& sharded);

// Compares `mine` across the ranks (every rank calls it, with the same names). Throws
// DivergenceError on every rank when any entry differs, naming the first one, the ranks and
// `when` ("at batch 500", "before the checkpoint at batch 500").
// `comm`: the replicas (the world, or a data-parallel group); `world_rank` names this rank in the
// message (its rank in `comm` when negative).
void check_replicas(comm::Communicator& comm, const ReplicaChecksums& mine, const std::string& when,
                    int world_rank = -1);

}  // namespace hpctrial::trainer::detail
