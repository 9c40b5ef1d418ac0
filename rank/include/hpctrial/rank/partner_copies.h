// checkpoint_levels.partner: each rank's copies in node memory sent to a rank on another node,
// which keeps them, so that a node's loss loses no copy that a partner holds.
//
// The partners form a ring of the nodes: a rank sends its copies to the rank at the same place
// among the next node's ranks (modulo their number), and keeps the copies of the ranks whose
// partner it is. On one node there is no partner. A copy travels as its slot file has it
// (checkpoint/memory_slots.h): the header alone first, then the rest in pieces of at most 1 GiB
// (an MPI count is an int); a header that is not a complete copy's (the sender had none) is
// followed by nothing. The receiver writes it by the slots' rules, so a copy cut short by a
// failure on either side is never held. Free of LibTorch.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hpctrial/checkpoint/memory_slots.h"
#include "hpctrial/comm/communicator.h"

namespace hpctrial::rank {

struct Partners {
  int send_to = -1;               // the rank that keeps this rank's copies; -1: none (one node)
  std::vector<int> receive_from;  // the ranks whose copies this rank keeps
};

// The partners of `rank`, where `node_of_rank[r]` is rank r's node (any numbering; ranks of one
// node share it).
Partners partners_of(const std::vector<int>& node_of_rank, int rank);

// Sends `image` (nullopt: no copy; its header is sent as zeros) to `peer`; the sends are in
// flight until the handles are waited for, and the image must stay as it is until then.
std::vector<comm::WorkHandle> send_copy(comm::Communicator& comm, const std::optional<checkpoint::MemorySlots::Image>& image,
                                        int peer, std::vector<char>& no_header);
// Receives the copy `peer` sends into `slots`; returns its batch count, or nullopt when the peer
// had none. CheckpointError when what arrived is not a good copy (it is then not held).
std::optional<std::int64_t> receive_copy(comm::Communicator& comm, checkpoint::MemorySlots& slots, int peer);

// The folder in a rank's own one where it keeps the copies of rank `source`.
std::string partner_dir(const std::string& rank_dir, int source);
// The ranks whose copies are kept in `rank_dir` (its partner folders).
std::vector<int> partner_sources(const std::string& rank_dir);

}  // namespace hpctrial::rank
