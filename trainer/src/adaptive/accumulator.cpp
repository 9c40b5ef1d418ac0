#include "hpctrial/trainer/accumulator.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/core/error.h"

namespace hpctrial::trainer {
namespace {

using json = nlohmann::json;

void put_u32(std::string& out, std::uint32_t value) { out.append(reinterpret_cast<const char*>(&value), 4); }

void put_text(std::string& out, const std::string& text) {
  put_u32(out, static_cast<std::uint32_t>(text.size()));
  out += text;
}

class Cursor {
 public:
  explicit Cursor(const std::string& bytes) : bytes_(bytes) {}
  void take(void* into, std::size_t n) {
    if (bytes_.size() - at_ < n) throw InternalError("an accumulator's message from another rank is truncated");
    std::memcpy(into, bytes_.data() + at_, n);
    at_ += n;
  }
  std::uint32_t u32() {
    std::uint32_t value = 0;
    take(&value, 4);
    return value;
  }
  std::string text() {
    const std::uint32_t n = u32();
    if (bytes_.size() - at_ < n) throw InternalError("an accumulator's message from another rank is truncated");
    std::string out = bytes_.substr(at_, n);
    at_ += n;
    return out;
  }
  bool done() const { return at_ == bytes_.size(); }

 private:
  const std::string& bytes_;
  std::size_t at_ = 0;
};

void encode_into(std::string& out, const std::string& name, const Accumulator::Values& values) {
  put_text(out, name);
  put_u32(out, static_cast<std::uint32_t>(values.size()));
  for (const auto& [key, value] : values) {
    put_text(out, key);
    out.append(reinterpret_cast<const char*>(&value), sizeof value);
  }
}

std::pair<std::string, Accumulator::Values> decode_from(Cursor& in) {
  std::pair<std::string, Accumulator::Values> out;
  out.first = in.text();
  const std::uint32_t count = in.u32();
  for (std::uint32_t i = 0; i < count; ++i) {
    std::string key = in.text();
    double value = 0;
    in.take(&value, sizeof value);
    out.second.emplace(std::move(key), value);
  }
  return out;
}

json value_to_json(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  return value;
}

double value_from_json(const json& value, const std::string& where) {
  if (value.is_number()) return value.get<double>();
  if (value == "nan") return std::numeric_limits<double>::quiet_NaN();
  if (value == "inf") return std::numeric_limits<double>::infinity();
  if (value == "-inf") return -std::numeric_limits<double>::infinity();
  throw ConfigError(where + " is " + value.dump() + ", not a number");
}

}  // namespace

Accumulator::Accumulator(std::string name, comm::Communicator& communicator, const detail::ReplayClock* clock,
                         Values initial)
    : name_(std::move(name)), communicator_(communicator), clock_(clock), sums_(std::move(initial)) {}

Accumulator::Entry& Accumulator::Entry::operator+=(double value) {
  (owner_.synchronized_ ? owner_.view() : owner_.pending_)[key_] += value;
  return *this;
}

Accumulator::Entry& Accumulator::Entry::operator-=(double value) {
  (owner_.synchronized_ ? owner_.view() : owner_.pending_)[key_] -= value;
  return *this;
}

Accumulator::Entry& Accumulator::Entry::operator=(double value) {
  owner_.require_synchronized("assigning to", key_);
  owner_.view()[key_] = value;
  return *this;
}

double Accumulator::Entry::value() const { return owner_.at(key_); }

void Accumulator::update(const Values& updates) {
  Values& into = synchronized_ ? view() : pending_;
  for (const auto& [key, value] : updates) into[key] += value;
}

void Accumulator::subtract(const Values& updates) {
  Values& into = synchronized_ ? view() : pending_;
  for (const auto& [key, value] : updates) into[key] -= value;
}

Accumulator::Synchronized Accumulator::synchronized() {
  // Inside another guard: part of that synchronization (AdaptDL's nested synchronized() yields at
  // once). A guard that owns nothing, so the outer one ends the mode.
  if (synchronized_) return Synchronized(nullptr);
  if (replay()) {
    synchronized_ = true;
    return Synchronized(this);
  }
  const std::vector<std::string> all = communicator_.allgather(detail::encode_values(name_, pending_));
  std::vector<Values> updates;
  for (std::size_t rank = 0; rank < all.size(); ++rank) {
    auto [name, values] = detail::decode_values(all[rank]);
    if (name != name_) {
      throw ConfigError("ranks synchronize different accumulators at the same point: rank " +
                        std::to_string(communicator_.rank()) + " '" + name_ + "', rank " + std::to_string(rank) +
                        " '" + name + "'; every rank must call synchronized() on the same accumulators in the "
                        "same order");
    }
    updates.push_back(std::move(values));
  }
  fold(updates);
  if (clock_ != nullptr && clock_->data_loops == 0) {
    const std::optional<std::int64_t>& epoch = *clock_->epoch;
    history_[epoch ? std::to_string(*epoch) : "none"].push_back(sums_);
  }
  synchronized_ = true;
  return Synchronized(this);
}

// AdaptDL's rule: the n-th synchronization of an epoch replays the n-th recorded one, while
// there is one; the records of epochs before this one go (they are never replayed again).
bool Accumulator::replay() {
  if (clock_ == nullptr || clock_->data_loops > 0) return false;
  const std::optional<std::int64_t>& epoch = *clock_->epoch;
  const std::string key = epoch ? std::to_string(*epoch) : "none";
  for (auto it = history_.begin(); it != history_.end();) {
    const bool earlier = epoch && it->first != "none" && std::stoll(it->first) < *epoch;
    it = earlier ? history_.erase(it) : std::next(it);
  }
  const std::size_t count = synchronizations_[key]++;
  const auto recorded = history_.find(key);
  if (recorded == history_.end() || count >= recorded->second.size()) return false;
  replaying_ = recorded->second[count];
  pending_.clear();  // made again by the code that ran before the restart too: dropped
  return true;
}

Accumulator::Synchronized::~Synchronized() {
  if (owner_ != nullptr) {
    owner_->synchronized_ = false;
    owner_->replaying_.reset();
  }
}

void Accumulator::fold(const std::vector<Values>& updates) {
  // Rank order, key by key: every rank adds the same numbers in the same order.
  for (const Values& values : updates) {
    for (const auto& [key, value] : values) sums_[key] += value;
  }
  pending_.clear();
}

void Accumulator::require_synchronized(const char* what, const std::string& key) const {
  if (synchronized_) return;
  throw ConfigError("accumulator '" + name_ + "': " + what + (key.empty() ? "" : " '" + key + "'") +
                    " in accumulation mode; the sums of all ranks are known only in synchronized mode: "
                    "`auto guard = accumulator.synchronized();` on every rank first (in accumulation mode "
                    "use += and -=)");
}

void Accumulator::missing(const std::string& key) const {
  throw ConfigError("accumulator '" + name_ + "' has no '" + key + "': no rank added to it and it was not "
                    "assigned (keys: " + std::to_string(view().size()) + ")");
}

double Accumulator::at(const std::string& key) const {
  require_synchronized("reading", key);
  const auto it = view().find(key);
  if (it == view().end()) missing(key);
  return it->second;
}

bool Accumulator::contains(const std::string& key) const {
  require_synchronized("looking up", key);
  return view().count(key) > 0;
}

std::size_t Accumulator::size() const {
  require_synchronized("taking the size");
  return view().size();
}

const Accumulator::Values& Accumulator::values() const {
  require_synchronized("reading the values");
  return view();
}

void Accumulator::erase(const std::string& key) {
  require_synchronized("erasing", key);
  if (view().erase(key) == 0) missing(key);
}

namespace {

json values_to_json(const Accumulator::Values& values) {
  json out = json::object();
  for (const auto& [key, value] : values) out[key] = value_to_json(value);
  return out;
}

Accumulator::Values values_from_json(const json& state, const std::string& name) {
  if (!state.is_object()) throw ConfigError("accumulator '" + name + "': the saved state is not an object");
  Accumulator::Values values;
  for (auto it = state.begin(); it != state.end(); ++it) {
    values[it.key()] = value_from_json(it.value(), "accumulator '" + name + "': '" + it.key() + "'");
  }
  return values;
}

}  // namespace

json Accumulator::state_dict() const {
  if (history_.empty()) return values_to_json(sums_);
  json replay = json::object();
  for (const auto& [epoch, list] : history_) {
    for (const Values& values : list) replay[epoch].push_back(values_to_json(values));
  }
  return {{"sums", values_to_json(sums_)}, {"replay", replay}};
}

void Accumulator::load_state_dict(const json& state) {
  history_.clear();
  // {"sums", "replay"} with recorded synchronizations; the sums alone (numbers) without.
  const bool with_replay = state.is_object() && state.contains("sums") && state.at("sums").is_object();
  sums_ = values_from_json(with_replay ? state.at("sums") : state, name_);
  if (with_replay && state.contains("replay")) {
    for (const auto& [epoch, list] : state.at("replay").items()) {
      const bool number = !epoch.empty() && epoch.find_first_not_of("0123456789") == std::string::npos;
      if ((!number && epoch != "none") || !list.is_array()) {
        throw ConfigError("accumulator '" + name_ + "': the replay of epoch '" + epoch + "' is not a list of sums by epoch");
      }
      for (const auto& values : list) history_[epoch].push_back(values_from_json(values, name_));
    }
  }
  synchronizations_.clear();
  pending_.clear();
}

namespace detail {

std::string encode_values(const std::string& name, const Accumulator::Values& values) {
  std::string out;
  encode_into(out, name, values);
  return out;
}

std::pair<std::string, Accumulator::Values> decode_values(const std::string& bytes) {
  Cursor in(bytes);
  auto out = decode_from(in);
  if (!in.done()) throw InternalError("an accumulator's message from another rank has trailing bytes");
  return out;
}

std::shared_ptr<Accumulator> Accumulators::make(std::string name, Accumulator::Values initial) {
  if (name.empty()) name = "accumulator" + std::to_string(made_.size());
  for (const auto& accumulator : made_) {
    if (accumulator->name() == name) {
      throw ConfigError("an accumulator named '" + name + "' exists already: give each accumulator its own name");
    }
  }
  auto accumulator = std::make_shared<Accumulator>(name, communicator_, clock_, std::move(initial));
  if (restored_.contains(name)) {
    accumulator->load_state_dict(restored_.at(name));
    restored_.erase(name);
  }
  made_.push_back(accumulator);
  return accumulator;
}

void Accumulators::synchronize_all() {
  std::string mine;
  put_u32(mine, static_cast<std::uint32_t>(made_.size()));
  // One in synchronized mode has no pending updates: folding it changes nothing.
  for (const auto& accumulator : made_) encode_into(mine, accumulator->name(), accumulator->pending());
  const std::vector<std::string> all = communicator_.allgather(mine);
  std::vector<std::vector<Accumulator::Values>> updates(made_.size());
  for (std::size_t rank = 0; rank < all.size(); ++rank) {
    Cursor in(all[rank]);
    const std::uint32_t count = in.u32();
    std::vector<std::string> names;
    for (std::uint32_t i = 0; i < count; ++i) {
      auto [name, values] = decode_from(in);
      names.push_back(name);
      if (i < made_.size() && made_[i]->name() == name) updates[i].push_back(std::move(values));
    }
    bool same = names.size() == made_.size();
    for (std::size_t i = 0; same && i < names.size(); ++i) same = names[i] == made_[i]->name();
    if (!same) {
      std::string theirs;
      for (const auto& name : names) theirs += (theirs.empty() ? "'" : ", '") + name + "'";
      std::string ours;
      for (const auto& a : made_) ours += (ours.empty() ? "'" : ", '") + a->name() + "'";
      throw ConfigError("the ranks made different accumulators: rank " + std::to_string(communicator_.rank()) +
                        " has [" + ours + "], rank " + std::to_string(rank) + " has [" + theirs +
                        "]; make the same accumulators in the same order on every rank");
    }
  }
  for (std::size_t i = 0; i < made_.size(); ++i) made_[i]->fold(updates[i]);
}

json Accumulators::state_dict() const {
  json out = restored_;
  for (const auto& accumulator : made_) out[accumulator->name()] = accumulator->state_dict();
  return out;
}

void Accumulators::load_state_dict(const json& state) {
  if (!state.is_object()) throw ConfigError("the saved accumulators are not an object");
  restored_ = json::object();
  for (auto it = state.begin(); it != state.end(); ++it) {
    bool made = false;
    for (const auto& accumulator : made_) {
      if (accumulator->name() == it.key()) {
        accumulator->load_state_dict(it.value());
        made = true;
      }
    }
    if (!made) restored_[it.key()] = it.value();
  }
}

}  // namespace detail
}  // namespace hpctrial::trainer
