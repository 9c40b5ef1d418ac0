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
#include "watchdog_channels.h"

namespace hpctrial::comm {
namespace {

using namespace watchdog_detail;

constexpr int kHeartbeatTag = 1;
constexpr int kGoodbyeTag = 2;


// SplitMix64's finalizer: a well-mixed 64-bit value of its input.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// What `beat` entered in `channel`; false when the rank is not in it as far as it says.
bool entered_in(const Watchdog::Heartbeat& beat, std::uint64_t channel, std::uint64_t& entered) {
  if (channel == Watchdog::kWorld) {
    entered = beat.entered;
    return true;
  }
  for (std::uint64_t i = 0; i < beat.channels && i < Watchdog::kChannels; ++i) {
    if (beat.counts[i].channel == channel) {
      entered = beat.counts[i].entered;
      return true;
    }
  }
  entered = 0;
  return false;
}

// "allreduce (collective #7, step 3)", "recv (message #2 from rank 1 to rank 0, step 3)".
std::string describe(const Watchdog::Heartbeat& beat, const std::string& group) {
  const auto channel = beat.pending_channel;
  if (channel == Watchdog::kWorld) {
    return fmt::format("{} (collective #{}, step {})", beat.operation, beat.pending_id, beat.pending_step);
  }
  if (is_message(channel)) {
    return fmt::format("{} (message #{} from rank {} to rank {}, step {})", beat.operation, beat.pending_id,
                       message_from(channel), message_to(channel), beat.pending_step);
  }
  return fmt::format("{} (collective #{} of the group of ranks {}, step {})", beat.operation, beat.pending_id,
                     group.empty() ? "?" : group, beat.pending_step);
}

// What a rank that did not arrive has done in the channel.
std::string progress(int rank, const Watchdog::Heartbeat& beat, std::uint64_t channel, std::uint64_t entered) {
  if (channel == Watchdog::kWorld) {
    return fmt::format("rank {} is at step {} and has entered {} collectives", rank, beat.step, entered);
  }
  if (is_message(channel)) {
    return rank == message_from(channel)
               ? fmt::format("rank {} is at step {} and has sent {} messages to rank {}", rank, beat.step, entered,
                             message_to(channel))
               : fmt::format("rank {} is at step {} and has received {} messages from rank {}", rank, beat.step,
                             entered, message_from(channel));
  }
  return fmt::format("rank {} is at step {} and has entered {} collectives of that group", rank, beat.step, entered);
}

}  // namespace

std::uint64_t Watchdog::group_channel(std::uint64_t parent, std::uint64_t split, int color) {
  const std::uint64_t channel =
      mix(mix(parent ^ 0x6a09e667f3bcc909ull) ^ (split * 0x100000001b3ull) ^ static_cast<std::uint32_t>(color)) &
      ~kMessageBit;
  return channel == kWorld ? 1 : channel;
}

std::uint64_t Watchdog::message_channel(std::uint64_t communicator, int from, int to) {
  return kMessageBit | ((mix(communicator) & 0x7fff) << 48) | ((static_cast<std::uint64_t>(from) & kRankMask) << 24) |
         (static_cast<std::uint64_t>(to) & kRankMask);
}

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

void Watchdog::join_channel(std::uint64_t channel) {
  if (channel == kWorld) return;
  std::lock_guard<std::mutex> lock(mutex_);
  channels_.try_emplace(channel);
}

std::uint64_t Watchdog::enter(const char* operation, std::uint64_t channel, std::uint64_t bytes) {
  return begin(operation, channel, count(channel), bytes);
}

std::uint64_t Watchdog::count(std::uint64_t channel) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (channel == kWorld) return ++world_entered_;
  Channel& entry = channels_[channel];
  entry.last_id = entered_ + 1;  // the next operation's id: orders the channels by use
  return ++entry.entered;
}

std::uint64_t Watchdog::begin(const char* operation, std::uint64_t channel, std::uint64_t number,
                               std::uint64_t bytes) {
  const char* phase = options_.phase != nullptr ? options_.phase() : "";
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  const std::uint64_t id = ++entered_;
  pending_.emplace(id, Pending{operation, step(), now, channel, number});
  // The slot of an empty entry, else of the oldest finished one; with every one pending, the
  // newest pending one gives way, so that the oldest - where a hang is - stay.
  Flight* slot = nullptr;
  for (Flight& flight : ring_) {
    if (flight.id == 0) {
      slot = &flight;
      break;
    }
    const bool finished = flight.ended != Clock::time_point{};
    if (finished && (slot == nullptr || slot->ended == Clock::time_point{} || flight.id < slot->id)) slot = &flight;
  }
  if (slot == nullptr) {
    slot = &*std::max_element(std::begin(ring_), std::end(ring_),
                              [](const Flight& a, const Flight& b) { return a.id < b.id; });
  }
  *slot = Flight{id, operation, phase, channel, number, bytes, step(), now, {}};
  return id;
}

void Watchdog::leave(std::uint64_t id) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  pending_.erase(id);
  for (Flight& flight : ring_) {
    if (flight.id == id) flight.ended = now;
  }
}

void Watchdog::add_abort_hook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  abort_hooks_.push_back(std::move(hook));
}

Watchdog::Heartbeat Watchdog::snapshot(Clock::time_point now) {
  Heartbeat beat;
  beat.step = step();
  std::lock_guard<std::mutex> lock(mutex_);
  beat.entered = world_entered_;
  if (!pending_.empty()) {
    const auto& [id, pending] = *pending_.begin();
    beat.pending_id = pending.number;
    beat.pending_channel = pending.channel;
    beat.pending_step = pending.step;
    beat.pending_age_s = seconds(now - pending.start);
    std::strncpy(beat.operation, pending.operation, sizeof(beat.operation) - 1);
  }
  // The pending operation's channel first, then the most recently used.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> order;  // (rank in the heartbeat, channel)
  for (const auto& [channel, entry] : channels_) {
    const bool first = channel == beat.pending_channel;
    order.emplace_back(first ? 0 : ~entry.last_id, channel);
  }
  std::sort(order.begin(), order.end());
  for (const auto& [place, channel] : order) {
    if (beat.channels == kChannels) break;
    beat.counts[beat.channels++] = {channel, channels_[channel].entered};
  }
  std::vector<const Flight*> flights;
  for (const Flight& flight : ring_) {
    if (flight.id != 0) flights.push_back(&flight);
  }
  std::sort(flights.begin(), flights.end(), [](const Flight* a, const Flight* b) { return a->id < b->id; });
  for (const Flight* entry : flights) {
    const Flight& flight = *entry;
    Recent& recent = beat.recent[beat.recent_count++];
    std::strncpy(recent.operation, flight.operation, sizeof(recent.operation) - 1);
    std::strncpy(recent.phase, flight.phase, sizeof(recent.phase) - 1);
    recent.channel = flight.channel;
    recent.number = flight.number;
    recent.bytes = flight.bytes;
    recent.step = flight.step;
    recent.began_s = seconds(now - flight.began);
    recent.seconds = flight.ended == Clock::time_point{} ? -1 : seconds(flight.ended - flight.began);
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
  // The rank that has waited longest in an operation, if longer than the timeout.
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
  Heartbeat stuck = peers_[static_cast<std::size_t>(waiter)].last;
  Verdict verdict = judge(stuck, now);
  std::string message = fmt::format("watchdog: {} has not finished after {:.0f} s "
                                    "(optimizations.collective_timeout is {:.0f} s); ",
                                    describe(stuck, members_of(stuck.pending_channel)), longest, timeout);
  // A rank that did not arrive because it waits in another operation itself leads to the cause.
  for (int hops = 0; hops < size_ && verdict.culprits.size() == 1; ++hops) {
    const int culprit = verdict.culprits.front();
    const PeerState& peer = peers_[static_cast<std::size_t>(culprit)];
    if (!peer.heard_ever || seconds(now - peer.heard) > timeout || peer.last.pending_id == 0) break;
    stuck = peer.last;
    verdict = judge(stuck, now);
    message += fmt::format("rank {} did not arrive: it waits in {}; ", culprit,
                           describe(stuck, members_of(stuck.pending_channel)));
  }
  if (!verdict.absent.empty()) {
    message += fmt::format("rank{} {} did not arrive: {}", verdict.absent.size() > 1 ? "s" : "",
                           join(verdict.absent, ", "), join(verdict.details, "; "));
  } else {
    message += fmt::format("every rank entered it, so the transport between ranks {} is stuck",
                           join(verdict.waiting, ", "));
  }
  abort_job(message, verdict.culprits, flight(now, nullptr));
}

// The ranks whose heartbeats say they are in `channel`, for a message.
std::string Watchdog::members_of(std::uint64_t channel) const {
  std::vector<std::string> members;
  for (int r = 0; r < size_; ++r) {
    std::uint64_t entered = 0;
    if (entered_in(peers_[static_cast<std::size_t>(r)].last, channel, entered)) members.push_back(std::to_string(r));
  }
  return join(members, ", ");
}

// A silent rank did not arrive wherever it is; a rank in the stuck operation's channel did not
// when it has entered fewer of the channel's operations, and waits in it when its own oldest
// operation is that one or an earlier one of the channel.
Watchdog::Verdict Watchdog::judge(const Heartbeat& stuck, Clock::time_point now) const {
  const double timeout = seconds(options_.timeout);
  const std::uint64_t channel = stuck.pending_channel;
  Verdict verdict;
  for (int r = 0; r < size_; ++r) {
    const PeerState& peer = peers_[static_cast<std::size_t>(r)];
    const double silent = seconds(now - (peer.heard_ever ? peer.heard : started_));
    std::uint64_t entered = 0;
    const bool listed = entered_in(peer.last, channel, entered);
    const bool member = is_message(channel) ? r == message_from(channel) || r == message_to(channel) : listed;
    if (!peer.heard_ever || silent > timeout) {
      verdict.absent.push_back(std::to_string(r));
      verdict.culprits.push_back(r);
      verdict.details.push_back(
          fmt::format("rank {} has sent no heartbeat for {:.1f} s (stopped, or its node is gone)", r, silent));
    } else if (member && entered < stuck.pending_id) {
      verdict.absent.push_back(std::to_string(r));
      verdict.culprits.push_back(r);
      verdict.details.push_back(progress(r, peer.last, channel, entered));
    } else if (member && peer.last.pending_id != 0 && peer.last.pending_channel == channel &&
               peer.last.pending_id <= stuck.pending_id) {
      verdict.waiting.push_back(std::to_string(r));
    }
  }
  return verdict;
}

void Watchdog::check_alone(const Heartbeat& mine) {
  // The chief decides with the whole picture; a rank acts alone only when the chief has had
  // ample time and did nothing - then the chief is the one that is stuck.
  const double grace = std::max(5.0, 3 * seconds(options_.interval));
  const double timeout = seconds(options_.timeout);
  if (mine.pending_id == 0 || mine.pending_age_s <= timeout + grace) return;
  abort_job(fmt::format("watchdog: {} has not finished after {:.0f} s "
                        "(optimizations.collective_timeout is {:.0f} s) and the chief has not ended the job: "
                        "rank 0 probably did not arrive (stopped, or its node is gone)",
                        describe(mine, std::to_string(rank_) + " and others"), mine.pending_age_s, timeout),
            {0}, flight(Clock::now(), &mine));
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
      peers_[0].last = snapshot(now);  // the chief's own operations, as they are now
      peers_[0].heard = now;
      abort_job("watchdog: the chief has finished but rank(s) " + join(missing, ", ") +
                " did not finish with it within optimizations.collective_timeout", culprits, flight(now, nullptr));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

void Watchdog::abort_job(const std::string& message, const std::vector<int>& culprits,
                         const std::vector<std::pair<int, std::string>>& flight) {
  if (!options_.verdict_path.empty()) {
    try {
      core::write_file_atomic(options_.verdict_path, core::encode_verdict({culprits, message, flight}));
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
  for (const auto& [rank, operations] : flight) core::log_error("watchdog: rank {}'s last operations: {}", rank, operations);
  MPI_Abort(MPI_COMM_WORLD, options_.exit_code);
  std::_Exit(options_.exit_code);
}

}  // namespace hpctrial::comm
