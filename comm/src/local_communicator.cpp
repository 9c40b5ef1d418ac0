// What every communicator shares (the argument checks, a finished Work, `any`) and the world of
// one rank, whose collectives are copies or nothing.
#include <climits>
#include <cstring>
#include <memory>

#include "checks.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/core/error.h"

namespace hpctrial::comm {
namespace detail {

bool is_floating(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat64 || dtype == DType::kFloat16 ||
         dtype == DType::kBFloat16;
}

void check_reduction(DType dtype, ReduceOp op) {
  if (op == ReduceOp::kAvg && !is_floating(dtype)) {
    throw CommError(std::string("allreduce: an average of ") + to_string(dtype) +
                    " values is not defined; reduce with sum and divide, or use a floating-point type");
  }
}

void check_color(int color) {
  if (color < 0) throw CommError("split: color " + std::to_string(color) + " is negative; colors are 0 or more");
}

void check_root(int root, int size, const char* operation) {
  if (root < 0 || root >= size) {
    throw CommError(std::string(operation) + ": root rank " + std::to_string(root) + " is not in 0.." +
                    std::to_string(size - 1));
  }
}
int message_bytes(std::size_t count, DType dtype, int peer, int rank, int size, const char* operation) {
  if (peer < 0 || peer >= size || peer == rank) {
    throw CommError(std::string(operation) + ": peer rank " + std::to_string(peer) + " is not another rank of 0.." +
                    std::to_string(size - 1) + " (this is rank " + std::to_string(rank) + ")");
  }
  const std::size_t bytes = count * dtype_size(dtype);
  if (bytes > static_cast<std::size_t>(INT_MAX)) {
    throw CommError(std::string(operation) + " of " + std::to_string(bytes) +
                    " bytes: too large for one message; send it in parts below 2 GiB");
  }
  return static_cast<int>(bytes);
}

}  // namespace detail

namespace {

using detail::check_color;
using detail::check_reduction;
using detail::check_root;

class CompletedWork final : public Work {
 public:
  bool wait(std::chrono::milliseconds) override { return true; }
};

}  // namespace

void Work::wait() {
  while (!wait(std::chrono::hours(1))) {
  }
}

WorkHandle completed_work() {
  static const WorkHandle done = std::make_shared<CompletedWork>();
  return done;
}

bool Communicator::any(bool local) {
  std::int64_t flag = local ? 1 : 0;
  allreduce(&flag, 1, DType::kInt64, ReduceOp::kMax);
  return flag != 0;
}

// --- LocalCommunicator --------------------------------------------------------------------------

WorkHandle LocalCommunicator::allreduce_async(void*, std::size_t, DType dtype, ReduceOp op) {
  check_reduction(dtype, op);
  return completed_work();
}

WorkHandle LocalCommunicator::broadcast_async(void*, std::size_t, int root) {
  check_root(root, 1, "broadcast");
  return completed_work();
}

WorkHandle LocalCommunicator::reduce_scatter_async(const void* send, void* recv, std::size_t count, DType dtype,
                                                   ReduceOp op) {
  check_reduction(dtype, op);
  if (send != recv) std::memcpy(recv, send, count * dtype_size(dtype));
  return completed_work();
}

WorkHandle LocalCommunicator::allgather_async(const void* send, void* recv, std::size_t count, DType dtype) {
  if (send != recv) std::memcpy(recv, send, count * dtype_size(dtype));
  return completed_work();
}

WorkHandle LocalCommunicator::send_async(const void*, std::size_t count, DType dtype, int peer) {
  detail::message_bytes(count, dtype, peer, 0, 1, "send");
  return completed_work();
}

WorkHandle LocalCommunicator::recv_async(void*, std::size_t count, DType dtype, int peer) {
  detail::message_bytes(count, dtype, peer, 0, 1, "recv");
  return completed_work();
}

void LocalCommunicator::broadcast(std::string&, int root) { check_root(root, 1, "broadcast"); }

std::vector<std::string> LocalCommunicator::gather(const std::string& bytes, int root) {
  check_root(root, 1, "gather");
  return {bytes};
}

std::unique_ptr<Communicator> LocalCommunicator::split(int color, int /*key*/) {
  check_color(color);
  return std::make_unique<LocalCommunicator>();
}

}  // namespace hpctrial::comm
