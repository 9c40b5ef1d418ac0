#include "hpctrial/comm/watchdog.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/comm/mpi_check.h"

namespace hpctrial::comm {
namespace {

constexpr int kHeartbeatTag = 1;
constexpr int kGoodbyeTag = 2;

double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string join(const std::vector<std::string>& parts, const char* separator) {
  std::string out;
  for (const auto& part : parts) out += (out.empty() ? "" : separator) + part;
  return out;
}

}  // namespace

Watchdog::Watchdog(MPI_Comm world, Options options) : options_(options), started_(Clock::now()) {
  if (options_.timeout.count() <= 0) throw CommError("the watchdog timeout must be positive");
  if (options_.interval.count() <= 0) {
    options_.interval = std::max(std::chrono::milliseconds(10),
                                 std::min(options_.timeout / 4, std::chrono::milliseconds(1000)));
  }
  comm_ = MpiComm::dup(world);
  HPCTRIAL_MPI_CHECK(MPI_Comm_rank(comm_.get(), &rank_));
  HPCTRIAL_MPI_CHECK(MPI_Comm_size(comm_.get(), &size_));
  char name[MPI_MAX_PROCESSOR_NAME];
  int length = 0;
  HPCTRIAL_MPI_CHECK(MPI_Get_processor_name(name, &length));
  hostname_.assign(name, static_cast<std::size_t>(length));
  if (size_ == 1) return;  // nobody to wait for
  if (rank_ == 0) peers_.resize(static_cast<std::size_t>(size_));
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  stop_thread();  // then comm_ is freed
}

void Watchdog::stop_thread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::finish() {
  if (size_ == 1 || !thread_.joinable()) return;
  stop_thread();
  shut_down();
}

std::uint64_t Watchdog::enter(const char* operation) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::uint64_t id = ++entered_;
  pending_.emplace(id, Pending{operation, step(), Clock::now()});
  return id;
}

void Watchdog::leave(std::uint64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  pending_.erase(id);
}

void Watchdog::add_abort_hook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  abort_hooks_.push_back(std::move(hook));
}

Watchdog::Heartbeat Watchdog::snapshot(Clock::time_point now) {
  Heartbeat beat;
  beat.step = step();
  std::lock_guard<std::mutex> lock(mutex_);
  beat.entered = entered_;
  if (!pending_.empty()) {
    const auto& [id, pending] = *pending_.begin();
    beat.pending_id = id;
    beat.pending_step = pending.step;
    beat.pending_age_s = seconds(now - pending.start);
    std::strncpy(beat.operation, pending.operation, sizeof(beat.operation) - 1);
  }
  return beat;
}

void Watchdog::run() {
  try {
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (wake_.wait_for(lock, options_.interval, [&] { return stopping_; })) break;
      }
      const auto now = Clock::now();
      const Heartbeat mine = snapshot(now);
      if (rank_ == 0) {
        receive_heartbeats(now);
        peers_[0].last = mine;
        peers_[0].heard = now;
        peers_[0].heard_ever = true;
        check_as_chief(now);
      } else {
        send_heartbeat(mine, kHeartbeatTag);
        check_alone(mine);
      }
    }
  } catch (const std::exception& e) {
    core::log_warning("the collective watchdog stopped: {}", e.what());
  }
}

void Watchdog::send_heartbeat(const Heartbeat& heartbeat, int tag) {
  if (send_request_ != MPI_REQUEST_NULL) {
    int done = 0;
    HPCTRIAL_MPI_CHECK(MPI_Test(&send_request_, &done, MPI_STATUS_IGNORE));
    if (!done) return;  // the chief has not taken the last one yet
  }
  send_buffer_ = heartbeat;
  HPCTRIAL_MPI_CHECK(MPI_Isend(&send_buffer_, sizeof(Heartbeat), MPI_BYTE, 0, tag, comm_.get(), &send_request_));
}

void Watchdog::receive_heartbeats(Clock::time_point now) {
  while (true) {
    int arrived = 0;
    MPI_Status status;
    HPCTRIAL_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_.get(), &arrived, &status));
    if (!arrived) return;
    Heartbeat beat;
    HPCTRIAL_MPI_CHECK(MPI_Recv(&beat, sizeof(Heartbeat), MPI_BYTE, status.MPI_SOURCE, status.MPI_TAG,
                                comm_.get(), MPI_STATUS_IGNORE));
    PeerState& peer = peers_[static_cast<std::size_t>(status.MPI_SOURCE)];
    if (status.MPI_TAG == kGoodbyeTag) {
      peer.gone = true;
      continue;
    }
    peer.last = beat;
    peer.last.operation[sizeof(beat.operation) - 1] = '\0';
    peer.heard = now;
    peer.heard_ever = true;
  }
}

void Watchdog::check_as_chief(Clock::time_point now) {
  const double timeout = seconds(options_.timeout);
  // The rank that has waited longest in a collective, if longer than the timeout.
  int waiter = -1;
  double longest = 0;
  for (int r = 0; r < size_; ++r) {
    const PeerState& peer = peers_[static_cast<std::size_t>(r)];
    if (!peer.heard_ever || peer.gone || peer.last.pending_id == 0) continue;
    const double age = peer.last.pending_age_s + seconds(now - peer.heard);
    if (age > timeout && age > longest) {
      longest = age;
      waiter = r;
    }
  }
  if (waiter < 0) return;
  const Heartbeat stuck = peers_[static_cast<std::size_t>(waiter)].last;

  std::vector<std::string> absent, details, waiting;
  std::vector<int> culprits;
  for (int r = 0; r < size_; ++r) {
    const PeerState& peer = peers_[static_cast<std::size_t>(r)];
    const double silent = seconds(now - (peer.heard_ever ? peer.heard : started_));
    if (!peer.heard_ever || silent > timeout) {
      absent.push_back(std::to_string(r));
      culprits.push_back(r);
      details.push_back(fmt::format("rank {} has sent no heartbeat for {:.1f} s (stopped, or its node is gone)",
                                    r, silent));
    } else if (peer.last.entered < stuck.pending_id) {
      absent.push_back(std::to_string(r));
      culprits.push_back(r);
      details.push_back(fmt::format("rank {} is at step {} and has entered {} collectives", r, peer.last.step,
                                    peer.last.entered));
    } else if (peer.last.pending_id != 0 && peer.last.pending_id <= stuck.pending_id) {
      waiting.push_back(std::to_string(r));
    }
  }
  std::string message = fmt::format(
      "watchdog: {} (collective #{}, step {}) has not finished after {:.0f} s "
      "(optimizations.collective_timeout is {:.0f} s); ",
      stuck.operation, stuck.pending_id, stuck.pending_step, longest, timeout);
  if (!absent.empty()) {
    message += fmt::format("rank{} {} did not arrive: {}", absent.size() > 1 ? "s" : "", join(absent, ", "),
                           join(details, "; "));
  } else {
    message += fmt::format("every rank entered it, so the transport between ranks {} is stuck",
                           join(waiting, ", "));
  }
  abort_job(message, culprits);
}

void Watchdog::check_alone(const Heartbeat& mine) {
  // The chief decides with the whole picture; a rank acts alone only when the chief has had
  // ample time and did nothing - then the chief is the one that is stuck.
  const double grace = std::max(5.0, 3 * seconds(options_.interval));
  const double timeout = seconds(options_.timeout);
  if (mine.pending_id == 0 || mine.pending_age_s <= timeout + grace) return;
  abort_job(fmt::format(
      "watchdog: {} (collective #{}, step {}) has not finished after {:.0f} s "
      "(optimizations.collective_timeout is {:.0f} s) and the chief has not ended the job: rank 0 "
      "probably did not arrive (stopped, or its node is gone)",
      mine.operation, mine.pending_id, mine.pending_step, mine.pending_age_s, timeout), {0});
}

void Watchdog::shut_down() {
  if (rank_ != 0) {
    if (send_request_ != MPI_REQUEST_NULL) HPCTRIAL_MPI_CHECK(MPI_Wait(&send_request_, MPI_STATUS_IGNORE));
    Heartbeat goodbye;
    HPCTRIAL_MPI_CHECK(MPI_Send(&goodbye, sizeof(Heartbeat), MPI_BYTE, 0, kGoodbyeTag, comm_.get()));
    return;
  }
  // Take every rank's goodbye so that no message is left unmatched when MPI finalizes.
  const auto start = Clock::now();
  while (true) {
    const auto now = Clock::now();
    receive_heartbeats(now);
    const bool all_gone = std::all_of(peers_.begin() + 1, peers_.end(), [](const PeerState& p) { return p.gone; });
    if (all_gone) return;
    if (now - start > options_.timeout) {
      std::vector<std::string> missing;
      std::vector<int> culprits;
      for (int r = 1; r < size_; ++r) {
        if (!peers_[static_cast<std::size_t>(r)].gone) {
          missing.push_back(std::to_string(r));
          culprits.push_back(r);
        }
      }
      abort_job("watchdog: the chief has finished but rank(s) " + join(missing, ", ") +
                " did not finish with it within optimizations.collective_timeout", culprits);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

void Watchdog::abort_job(const std::string& message, const std::vector<int>& culprits) {
  if (!options_.verdict_path.empty()) {
    try {
      core::write_file_atomic(options_.verdict_path, core::encode_verdict({culprits, message}));
    } catch (const std::exception& e) {
      core::log_warning("watchdog: cannot write its verdict: {}", e.what());
    }
  }
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    hooks = abort_hooks_;
  }
  for (auto& hook : hooks) {
    try {
      hook();
    } catch (const std::exception& e) {
      core::log_warning("watchdog: an abort hook failed: {}", e.what());
    }
  }
  core::log_error("{} (detected on {}); ending the job", message, hostname_);
  MPI_Abort(MPI_COMM_WORLD, options_.exit_code);
  std::_Exit(options_.exit_code);
}

}  // namespace hpctrial::comm
