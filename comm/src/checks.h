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

}  // namespace hpctrial::comm::detail
