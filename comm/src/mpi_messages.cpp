// MpiCommunicator's messages: MPI_Isend / MPI_Irecv on a communicator of their own, posted by
// the caller and completed by wait(), each reported to the watchdog on the channel of its
// direction.
#include <climits>
#include <thread>

#include "checks.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/mpi_check.h"
#include "hpctrial/comm/watchdog.h"
#include "hpctrial/core/error.h"

namespace hpctrial::comm {
namespace detail {

std::vector<int> world_ranks(MPI_Comm comm, MPI_Comm world) {
  MPI_Group group = MPI_GROUP_NULL, world_group = MPI_GROUP_NULL;
  HPCTRIAL_MPI_CHECK(MPI_Comm_group(comm, &group));
  HPCTRIAL_MPI_CHECK(MPI_Comm_group(world, &world_group));
  int size = 0;
  HPCTRIAL_MPI_CHECK(MPI_Group_size(group, &size));
  std::vector<int> ranks(static_cast<std::size_t>(size)), translated(ranks.size());
  for (int r = 0; r < size; ++r) ranks[static_cast<std::size_t>(r)] = r;
  const int rc = MPI_Group_translate_ranks(group, size, ranks.data(), world_group, translated.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  HPCTRIAL_MPI_CHECK(rc);
  return translated;
}

}  // namespace detail

std::uint64_t MpiCommunicator::message_channel(int from, int to) const {
  if (world_ranks_.empty()) return Watchdog::kWorld;  // no watchdog
  return Watchdog::message_channel(channel_, world_ranks_.at(static_cast<std::size_t>(from)),
                                   world_ranks_.at(static_cast<std::size_t>(to)));
}

// A send or a receive in flight: posted at once, completed by whichever thread waits for it.
// It counts in the watchdog's channel when posted and is pending there from its first wait: a
// send the peer has taken is done, though this rank only sees it when it waits.
class MpiCommunicator::Message final : public Work {
 public:
  Message(Watchdog* watchdog, const char* operation, std::uint64_t channel, bool receive, std::uint64_t bytes)
      : watchdog_(watchdog),
        operation_(operation),
        channel_(channel),
        bytes_(bytes),
        number_(watchdog ? watchdog->count(channel) : 0),
        receive_(receive) {}
  ~Message() override {
    if (finished_) return;
    // Only after a failure elsewhere (the job is ending): a receive nobody waits for is cancelled.
    if (request_ != MPI_REQUEST_NULL) {
      if (receive_) MPI_Cancel(&request_);
      MPI_Request_free(&request_);
    }
    if (pending_ != 0) watchdog_->leave(pending_);
  }
  MPI_Request* request() { return &request_; }

  bool wait(std::chrono::milliseconds timeout) override {
    if (finished_) return true;
    if (watchdog_ != nullptr && pending_ == 0) pending_ = watchdog_->begin(operation_, channel_, number_, bytes_);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int polls = 0;; ++polls) {
      int done = 0;
      HPCTRIAL_MPI_CHECK(MPI_Test(&request_, &done, MPI_STATUS_IGNORE));
      if (done) break;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      // A message of a pipeline's neighbour is usually microseconds away; then give the core up.
      if (polls < 1000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    finished_ = true;
    if (pending_ != 0) watchdog_->leave(pending_);
    pending_ = 0;
    return true;
  }

 private:
  Watchdog* watchdog_;
  const char* operation_;
  std::uint64_t channel_;
  std::uint64_t bytes_;
  std::uint64_t number_;
  bool receive_;
  MPI_Request request_ = MPI_REQUEST_NULL;
  std::uint64_t pending_ = 0;  // the watchdog's id while this rank waits for it
  bool finished_ = false;
};

WorkHandle MpiCommunicator::send_async(const void* data, std::size_t count, DType dtype, int peer) {
  const int bytes = detail::message_bytes(count, dtype, peer, rank_, size_, "send");
  auto message = std::make_shared<Message>(watchdog_, "send", message_channel(rank_, peer), false,
                                            static_cast<std::uint64_t>(bytes));
  HPCTRIAL_MPI_CHECK(MPI_Isend(data, bytes, MPI_BYTE, peer, 0, message_comm_.get(), message->request()));
  return message;
}

WorkHandle MpiCommunicator::recv_async(void* data, std::size_t count, DType dtype, int peer) {
  const int bytes = detail::message_bytes(count, dtype, peer, rank_, size_, "recv");
  auto message = std::make_shared<Message>(watchdog_, "recv", message_channel(peer, rank_), true,
                                            static_cast<std::uint64_t>(bytes));
  HPCTRIAL_MPI_CHECK(MPI_Irecv(data, bytes, MPI_BYTE, peer, 0, message_comm_.get(), message->request()));
  return message;
}

}  // namespace hpctrial::comm
