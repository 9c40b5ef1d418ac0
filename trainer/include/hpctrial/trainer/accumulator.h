// AdaptDL's Accumulator, in C++: named values summed across all ranks of the job and across any
// number of checkpoint-restarts, whatever the number of ranks after each.
//
//   auto accum = context.make_accumulator("validation");   // TrialContext or CoreContext
//   for (const auto& batch : my_share_of_the_data) {        // accumulation mode
//     accum["loss_sum"] += loss_of(batch);
//     accum["total"] += batch.size();
//   }
//   {
//     auto synchronized = accum.synchronized();  // every rank, here: the sums of all ranks
//     accum["loss_avg"] = accum["loss_sum"] / accum["total"];
//     report(accum.at("loss_avg"));
//   }                                           // back to accumulation mode
//
// Accumulation mode (the default): `accum[key] += x`, `-=`, update(), subtract(), `accum += {..}`
// and `accum -= {..}` add to this rank's pending updates; each rank may add different keys and
// values. Reading a value, the size or the keys in this mode throws: the sums are not known until
// the ranks synchronize (AdaptDL's accumulator reads as an empty dict there instead, which hides
// the mistake).
//
// Synchronized mode, inside the guard synchronized() returns: entering it is a collective (all
// ranks, the same accumulators, in the same order), after which every rank holds the sums of all
// ranks' updates and reads and writes like a std::map<std::string, double>. Writes there must
// be the same on every rank: they are not summed again.
//
// Pending updates are also summed at every checkpoint (a collective the harness makes), and the
// sums are saved in it; after a restart, on any number of ranks, the sums are what they would
// have been without the restart. Sums are taken in rank order, so every rank holds the same bits.
//
// Replay after a restart (CoreContext's accumulators, as AdaptDL's): a restarted program runs
// the epoch it saved in again from its start, so code between its data loops (a synchronized
// block after the training loop) runs a second time. Each synchronized() outside a data loop
// (CoreContext::data_loop) records the sums it entered with, per epoch; after a restart the
// first synchronizations of that epoch get those recorded sums instead (without a collective),
// and the updates made before them are dropped: nothing counts twice. Synchronizations inside a
// data loop are neither recorded nor replayed (the loop resumes where it saved). The Trial API's
// accumulators never replay: its loop resumes at the step it saved, running nothing again.
//
// Values are doubles (integers up to 2^53 are exact). Not thread-safe: one thread per process
// uses an accumulator. Misuse (a read in accumulation mode, a key never added,
// ranks that synchronize different accumulators) throws ConfigError naming the accumulator and key.
// A synchronized() inside another's guard is part of it, as AdaptDL's nested `with
// accum.synchronized()` is: no collective, not counted for replay, and the outer guard ends the mode.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace hpctrial::comm {
class Communicator;
}

namespace hpctrial::trainer {

namespace detail {
// What decides a replay (CoreContext's): the running epoch and whether a data loop is running.
struct ReplayClock {
  const std::optional<std::int64_t>* epoch = nullptr;
  int data_loops = 0;
};
}  // namespace detail

class Accumulator {
 public:
  using Values = std::map<std::string, double>;

  // `name` identifies it in checkpoints; `communicator` sums across ranks and must outlive it.
  // Made by TrialContext::make_accumulator or CoreContext::make_accumulator, which save it.
  // `clock`: replay after restarts (CoreContext); null: never (the Trial API). `initial`: the sums
  // it starts with (AdaptDL's Accumulator(*args, **kwargs)), the same on every rank.
  Accumulator(std::string name, comm::Communicator& communicator, const detail::ReplayClock* clock = nullptr,
              Values initial = {});
  Accumulator(const Accumulator&) = delete;
  Accumulator& operator=(const Accumulator&) = delete;

  // accum[key]: `+= x` and `-= x` in either mode; `= x` and reading in synchronized mode only.
  class Entry {
   public:
    Entry& operator+=(double value);
    Entry& operator-=(double value);
    Entry& operator=(double value);
    Entry& operator=(const Entry& other) { return *this = other.value(); }
    operator double() const { return value(); }
    double value() const;

   private:
    friend class Accumulator;
    Entry(Accumulator& owner, std::string key) : owner_(owner), key_(std::move(key)) {}
    Accumulator& owner_;
    std::string key_;
  };
  Entry operator[](const std::string& key) { return Entry(*this, key); }

  // Adds (subtract: takes away) each value to its key: to the pending updates in accumulation
  // mode, to the sums in synchronized mode.
  void update(const Values& updates);
  void update(std::initializer_list<std::pair<const std::string, double>> updates) { update(Values(updates)); }
  void subtract(const Values& updates);
  void subtract(std::initializer_list<std::pair<const std::string, double>> updates) { subtract(Values(updates)); }
  Accumulator& operator+=(const Values& updates) {
    update(updates);
    return *this;
  }
  Accumulator& operator-=(const Values& updates) {
    subtract(updates);
    return *this;
  }

  // Synchronized mode, until the guard goes. Collective: every rank calls it at the same point.
  class Synchronized {
   public:
    Synchronized(Synchronized&& other) noexcept : owner_(std::exchange(other.owner_, nullptr)) {}
    Synchronized& operator=(Synchronized&&) = delete;
    ~Synchronized();

   private:
    friend class Accumulator;
    explicit Synchronized(Accumulator* owner) : owner_(owner) {}
    Accumulator* owner_;
  };
  [[nodiscard]] Synchronized synchronized();
  bool is_synchronized() const { return synchronized_; }

  // Reads (synchronized mode only; ConfigError otherwise).
  double at(const std::string& key) const;
  bool contains(const std::string& key) const;
  std::size_t size() const;
  const Values& values() const;
  // Removes a key (synchronized mode only).
  void erase(const std::string& key);

  const std::string& name() const { return name_; }

  // --- for the harness (TrialContext, CoreContext) -----------------------------------------
  // This rank's pending updates and the sums so far, as they stand.
  const Values& pending() const { return pending_; }
  // Adds every rank's updates (`updates`, in rank order) to the sums and forgets the pending ones.
  void fold(const std::vector<Values>& updates);
  // The sums, as JSON (non-finite values as the strings "nan", "inf", "-inf"); with recorded
  // synchronizations to replay, {"sums": {..}, "replay": {"<epoch>" or "none": [{..}, ..]}}.
  nlohmann::json state_dict() const;
  // Sums from state_dict(); pending updates are dropped. ConfigError for a malformed state.
  void load_state_dict(const nlohmann::json& state);

 private:
  void require_synchronized(const char* what, const std::string& key = {}) const;
  [[noreturn]] void missing(const std::string& key) const;

  // What synchronized mode reads and writes: the sums, or the recorded ones being replayed.
  Values& view() { return replaying_ ? *replaying_ : sums_; }
  const Values& view() const { return replaying_ ? *replaying_ : sums_; }
  // The recorded sums this synchronization replays, if it is one to replay; records it otherwise.
  bool replay();

  std::string name_;
  comm::Communicator& communicator_;
  const detail::ReplayClock* clock_;
  Values sums_;      // the same on every rank
  Values pending_;   // this rank's, since the last synchronization
  bool synchronized_ = false;
  std::map<std::string, std::vector<Values>> history_;  // by epoch: the sums each synchronization entered with
  std::map<std::string, std::size_t> synchronizations_;  // by epoch, in this run
  std::optional<Values> replaying_;
};

namespace detail {

// The accumulators of one process, in creation order, and what a checkpoint saved of them.
class Accumulators {
 public:
  explicit Accumulators(comm::Communicator& communicator, const ReplayClock* clock = nullptr)
      : communicator_(communicator), clock_(clock) {}

  // A new accumulator; an empty name is "accumulator<i>" (i: the number made before). Its sums
  // are `initial`, or the restored state's when that has one of the name (as AdaptDL's
  // load_state replaces the initial dict). ConfigError for a name in use.
  std::shared_ptr<Accumulator> make(std::string name, Accumulator::Values initial = {});
  // Collective: folds every rank's pending updates of every accumulator into its sums. Throws
  // ConfigError on every rank when the ranks have made different accumulators.
  void synchronize_all();
  // {name: sums} of every accumulator (after synchronize_all()), plus restored ones not yet made.
  nlohmann::json state_dict() const;
  void load_state_dict(const nlohmann::json& state);
  bool empty() const { return made_.empty() && restored_.empty(); }

 private:
  comm::Communicator& communicator_;
  const ReplayClock* clock_;
  std::vector<std::shared_ptr<Accumulator>> made_;
  nlohmann::json restored_ = nlohmann::json::object();
};

// Encodes a name and values into bytes for a collective, and back (exact doubles).
std::string encode_values(const std::string& name, const Accumulator::Values& values);
std::pair<std::string, Accumulator::Values> decode_values(const std::string& bytes);

}  // namespace detail
}  // namespace hpctrial::trainer
