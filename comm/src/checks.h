// The argument checks every communicator makes alike (internal to the comm library).
#pragma once

#include "hpctrial/comm/communicator.h"

namespace hpctrial::comm::detail {

bool is_floating(DType dtype);
// CommError for an average of integers.
void check_reduction(DType dtype, ReduceOp op);
// CommError for a negative split color.
void check_color(int color);
// CommError for a root outside 0..size-1.
void check_root(int root, int size, const char* operation);
// The bytes of a message of `count` values to or from `peer`; CommError for a peer outside
// 0..size-1, the rank itself, or a message of 2 GiB or more.
int message_bytes(std::size_t count, DType dtype, int peer, int rank, int size, const char* operation);
// The rank in `world` of each rank of `comm`.
std::vector<int> world_ranks(MPI_Comm comm, MPI_Comm world);

}  // namespace hpctrial::comm::detail
