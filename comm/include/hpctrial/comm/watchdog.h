// The collective watchdog: a collective that has not finished on every rank within the
// timeout ends the job, with a message naming the operation, the step and the ranks that did
// not arrive - instead of a job that hangs until the scheduler's time limit.
//
// Every rank constructs one (collectively), and its communicators report each collective to
// it: enter() when the rank issues it, leave() when it finishes here. A background thread on
// each rank sends a small heartbeat to the chief every `interval` (what this rank has entered,
// its oldest unfinished collective and its age, its step). The chief's thread compares them:
// when some rank has waited longer than `timeout`, the ranks that have not entered that
// collective (or have fallen silent) are the culprits; the chief runs the abort hooks (NCCL's
// ncclCommAbort) and calls MPI_Abort. Should the chief itself be silent, a waiting rank ends
// the job on its own a little later. Heartbeats travel on a communicator of their own, so the
// watchdog works while the training thread is blocked inside MPI.
//
// Operations are counted by channel: the collectives of the world (the communicator the watchdog
// was built on, and every communicator built on it directly), those of each group split from it
// (Communicator::split; every rank of the group joins its channel as the group is made), and the
// messages in one direction between two ranks (Communicator::send_async / recv_async; a send
// and its receive are the same message of the channel). A channel's operations are entered in
// the same order on every rank in it (they are, or MPI would deadlock anyway), so its n-th
// operation on one rank is its n-th on every other: a rank that has entered fewer did not arrive.
// enter/leave/set_step are thread-safe. finish() is collective: every rank calls it once
// training has ended well, and the chief takes every rank's goodbye. The destructor never waits
// for a peer: a rank that fails destroys its watchdog (or aborts) without finish().
//
// Before it aborts the job, the watchdog writes its verdict (the ranks it found stuck, and its
// message; core/launch_contract.h) to Options::verdict_path, for the launcher's failure record.
//
// The flight recorder (PyTorch's, for MPI and NCCL): each rank keeps its last kRecent operations
// (operation, number in its channel, bytes, step, phase, when it began, how long it took or that
// it has not finished; an unfinished one gives way to a newer one only when all are unfinished,
// and then to the newest) and sends them with its heartbeat; the verdict lists every rank's, so
// that the failure record says where each rank was when the job was ended, not only the stuck one.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "hpctrial/comm/mpi_comm.h"

namespace hpctrial::comm {

class Watchdog {
 public:
  struct Options {
    std::chrono::milliseconds timeout = std::chrono::minutes(30);
    // Between heartbeats; zero picks min(timeout / 4, 1 s).
    std::chrono::milliseconds interval{0};
    int exit_code = 1;
    std::string verdict_path;  // empty: none written
    // The phase the rank is in (the flight recorder's), called as an operation begins, from any
    // thread; null: none.
    const char* (*phase)() = nullptr;
  };

  Watchdog(MPI_Comm world, Options options);
  ~Watchdog();
  // The collective end of a good run: the goodbyes, so that no message is left unmatched when
  // MPI finalizes. Ends the job if a rank does not say goodbye within the timeout.
  void finish();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // The world's channel; a group split from channel `parent` by its `split`-th split (counted on
  // the parent's communicator), for the ranks of `color`: the same on every rank of the group;
  // the messages of the communicator on channel `communicator` from world rank `from` to world
  // rank `to` (ranks below 2^24).
  static constexpr std::uint64_t kWorld = 0;
  static std::uint64_t group_channel(std::uint64_t parent, std::uint64_t split, int color);
  static std::uint64_t message_channel(std::uint64_t communicator, int from, int to);
  // This rank is in the group of `channel` (before its first operation, so that a rank that never
  // arrives is seen to be in it).
  void join_channel(std::uint64_t channel);
  // The communicator the watchdog's ranks are numbered in (to translate a group's ranks).
  MPI_Comm world() const { return comm_.get(); }

  // Reports an operation issued by this rank on `channel`; returns the id for leave().
  // `operation` must be a string literal (it is kept, not copied).
  // `bytes`: what this rank sends or contributes (the flight recorder's; 0 if not known).
  std::uint64_t enter(const char* operation, std::uint64_t channel = kWorld, std::uint64_t bytes = 0);
  // enter() in two parts, for a message, which is done when its peer has taken it but is only
  // seen to be done when the rank waits for it: count() when it is posted (its number in the
  // channel), begin() when the rank first waits for it (it is pending from then on; the id for
  // leave()).
  std::uint64_t count(std::uint64_t channel);
  std::uint64_t begin(const char* operation, std::uint64_t channel, std::uint64_t number, std::uint64_t bytes = 0);
  void leave(std::uint64_t id);
  void set_step(std::int64_t step) { step_.store(step, std::memory_order_relaxed); }
  std::int64_t step() const { return step_.load(std::memory_order_relaxed); }
  // Run (on the watchdog's thread) before the job is aborted, e.g. to abort NCCL communicators.
  void add_abort_hook(std::function<void()> hook);
  std::chrono::milliseconds timeout() const { return options_.timeout; }

  // enter() on construction, leave() on destruction; a null watchdog makes it a no-op.
  class Scope {
   public:
    Scope(Watchdog* watchdog, const char* operation, std::uint64_t channel = kWorld, std::uint64_t bytes = 0)
        : watchdog_(watchdog), id_(watchdog ? watchdog->enter(operation, channel, bytes) : 0) {}
    ~Scope() {
      if (watchdog_) watchdog_->leave(id_);
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Watchdog* watchdog_;
    std::uint64_t id_;
  };

  // What a rank tells the chief (fixed size, sent as bytes).
  struct ChannelCount {
    std::uint64_t channel = 0;
    std::uint64_t entered = 0;
  };
  static constexpr std::size_t kChannels = 12;  // besides the world's
  // One operation of the flight recorder, as a heartbeat carries it.
  static constexpr std::size_t kRecent = 8;
  struct Recent {
    char operation[16] = {};
    char phase[16] = {};
    std::uint64_t channel = kWorld;
    std::uint64_t number = 0;  // in its channel
    std::uint64_t bytes = 0;
    std::int64_t step = -1;
    double began_s = 0;   // before the heartbeat was sent
    double seconds = -1;  // how long it took; -1: not finished
  };
  struct Heartbeat {
    std::uint64_t entered = 0;     // world collectives entered so far
    std::uint64_t pending_id = 0;  // oldest unfinished operation: its number in its channel, 0 if none
    std::uint64_t pending_channel = kWorld;
    std::int64_t step = -1;        // the step the rank is at
    std::int64_t pending_step = -1;
    double pending_age_s = 0;
    char operation[32] = {};
    // The other channels this rank is in and the operations it entered in each: all of them, or
    // the pending one's and the most recently used when there are more than kChannels.
    std::uint64_t channels = 0;
    ChannelCount counts[kChannels] = {};
    std::uint64_t recent_count = 0;  // the flight recorder's operations, oldest first
    Recent recent[kRecent] = {};
  };
  static_assert(std::is_trivially_copyable_v<Heartbeat>, "a heartbeat travels as bytes");
  // A heartbeat's operations, for a verdict: "allreduce #41 (step 12, batch, 4.0 KiB) began
  // 31.2 s ago, took 0.001 s; broadcast #42 (...) began 30.1 s ago, not finished"; `heard_s`
  // is how long ago the heartbeat came.
  static std::string describe_recent(const Heartbeat& beat, double heard_s);

 private:
  using Clock = std::chrono::steady_clock;
  struct Pending {
    const char* operation;
    std::int64_t step;
    Clock::time_point start;
    std::uint64_t channel;
    std::uint64_t number;  // in its channel
  };
  struct Channel {
    std::uint64_t entered = 0;
    std::uint64_t last_id = 0;  // of its latest operation
  };
  struct Flight {
    std::uint64_t id = 0;  // 0: an empty slot
    const char* operation = "";
    const char* phase = "";
    std::uint64_t channel = kWorld;
    std::uint64_t number = 0;
    std::uint64_t bytes = 0;
    std::int64_t step = -1;
    Clock::time_point began{};
    Clock::time_point ended{};  // {}: not finished
  };
  struct PeerState {
    Heartbeat last;
    Clock::time_point heard{};
    bool heard_ever = false;
    bool gone = false;  // said goodbye
  };

  void run();
  Heartbeat snapshot(Clock::time_point now);
  void send_heartbeat(const Heartbeat& heartbeat, int tag);
  void receive_heartbeats(Clock::time_point now);
  void check_as_chief(Clock::time_point now);
  // The ranks that have not arrived at the stuck operation, and why; the ranks waiting in it.
  struct Verdict {
    std::vector<std::string> absent, details, waiting;
    std::vector<int> culprits;
  };
  Verdict judge(const Heartbeat& stuck, Clock::time_point now) const;
  std::string members_of(std::uint64_t channel) const;
  void check_alone(const Heartbeat& mine);
  void stop_thread();
  void shut_down();
  // Every rank's flight recorder, as the chief last heard it (a rank: its own).
  std::vector<std::pair<int, std::string>> flight(Clock::time_point now, const Heartbeat* mine) const;
  [[noreturn]] void abort_job(const std::string& message, const std::vector<int>& culprits,
                              const std::vector<std::pair<int, std::string>>& flight);

  Options options_;
  MpiComm comm_;
  int rank_ = 0;
  int size_ = 1;
  std::string hostname_;
  Clock::time_point started_;

  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::uint64_t entered_ = 0;                   // operations of every channel: the ids
  std::map<std::uint64_t, Channel> channels_;   // every channel but the world's
  std::uint64_t world_entered_ = 0;
  std::map<std::uint64_t, Pending> pending_;
  Flight ring_[kRecent];  // the flight recorder's operations, in no order (their ids order them)
  std::vector<std::function<void()>> abort_hooks_;
  std::atomic<std::int64_t> step_{-1};

  // Owned by the watchdog thread.
  std::vector<PeerState> peers_;  // chief only
  MPI_Request send_request_ = MPI_REQUEST_NULL;
  Heartbeat send_buffer_;
  std::thread thread_;
};

}  // namespace hpctrial::comm
