#include "hpctrial/search/event_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string_view>

#include "hpctrial/core/json_file.h"
#include "hpctrial/core/text.h"

namespace hpctrial::search {
namespace {

using json = nlohmann::json;

const std::map<std::string, Event::Kind>& kinds() {
  static const std::map<std::string, Event::Kind> all = {
      {"search", Event::Kind::kSearch},     {"created", Event::Kind::kCreated}, {"started", Event::Kind::kStarted},
      {"rung", Event::Kind::kRung},         {"promoted", Event::Kind::kPromoted}, {"stopped", Event::Kind::kStopped},
      {"finished", Event::Kind::kFinished}, {"failed", Event::Kind::kFailed},
      {"invalid_hp", Event::Kind::kInvalid}};
  return all;
}

[[noreturn]] void throw_errno(const std::string& what) { throw IoError(what + ": " + std::strerror(errno)); }

// The lines the log writes are flat objects of strings and numbers: read at a few hundred
// nanoseconds a line here, so that a worker replays thousands of events within milliseconds.
// Anything else (nested values, odd escapes) returns nullopt: nlohmann reads it instead.
class FlatReader {
 public:
  explicit FlatReader(std::string_view line) : s_(line) {}
  std::optional<Event> event() {
    Event e;
    std::string_view kind;
    bool has_metric = false;
    if (!take('{')) return std::nullopt;
    for (bool first = true; !take('}'); first = false) {
      if (!first && !take(',')) return std::nullopt;
      std::string_view key, text;
      if (!string(key) || !take(':')) return std::nullopt;
      const bool quoted = peek() == '"';
      double number = 0;
      if (quoted ? !string(text) : !parse_number(number)) return std::nullopt;
      if (key == "event" && quoted) kind = text;
      else if (key == "experiment_id" && quoted) e.experiment_id = text;
      else if (key == "time" && quoted) e.time = text;
      else if (key == "worker" && quoted) e.worker = text;
      else if (key == "metric") {
        has_metric = true;
        if (!quoted) e.metric = number;
        else if (text == "NaN") e.metric = std::nan("");
        else if (text == "Infinity") e.metric = std::numeric_limits<double>::infinity();
        else if (text == "-Infinity") e.metric = -std::numeric_limits<double>::infinity();
        else return std::nullopt;
      } else if ((key == "trial" || key == "bracket" || key == "rung") && !quoted && number == std::floor(number) &&
                 std::abs(number) < 1e9) {
        (key == "trial" ? e.trial : key == "bracket" ? e.bracket : e.rung) = static_cast<int>(number);
      } else {
        return std::nullopt;
      }
    }
    skip();
    const auto found = kind_of(kind);
    if (at_ < s_.size() || !found) return std::nullopt;
    e.kind = *found;
    if ((e.kind == Event::Kind::kRung) != has_metric || (e.kind != Event::Kind::kSearch && e.trial < 0)) return std::nullopt;
    return e;
  }

 private:
  static std::optional<Event::Kind> kind_of(std::string_view name) {
    for (const auto& [text, kind] : kinds()) {
      if (name == text) return kind;
    }
    return std::nullopt;
  }
  void skip() {
    while (at_ < s_.size() && (s_[at_] == ' ' || s_[at_] == '\t')) ++at_;
  }
  char peek() {
    skip();
    return at_ < s_.size() ? s_[at_] : '\0';
  }
  bool take(char c) {
    if (peek() != c) return false;
    ++at_;
    return true;
  }
  // A string without escapes or control characters (the others go to nlohmann), as a view.
  bool string(std::string_view& out) {
    if (!take('"')) return false;
    const std::size_t end = s_.find('"', at_);
    if (end == std::string_view::npos) return false;
    out = s_.substr(at_, end - at_);
    for (const char c : out) {
      if (c == '\\' || static_cast<unsigned char>(c) < 0x20) return false;
    }
    at_ = end + 1;
    return true;
  }
  bool parse_number(double& out) {
    skip();
    // strtod needs a terminated string: the number's characters, copied.
    std::size_t end = at_;
    while (end < s_.size() && ((s_[end] >= '0' && s_[end] <= '9') || s_[end] == '-' || s_[end] == '+' ||
                               s_[end] == '.' || s_[end] == 'e' || s_[end] == 'E')) {
      ++end;
    }
    if (end == at_ || end - at_ > 40) return false;
    char digits[48];
    s_.copy(digits, end - at_, at_);
    digits[end - at_] = '\0';
    char* stop = nullptr;
    out = std::strtod(digits, &stop);
    if (stop != digits + (end - at_) || !std::isfinite(out)) return false;
    at_ = end;
    return true;
  }

  std::string_view s_;
  std::size_t at_ = 0;
};

}  // namespace

std::string to_json_line(const Event& e) {
  json j = {{"event", to_string(e.kind)}};
  if (e.kind == Event::Kind::kSearch) {
    j["experiment_id"] = e.experiment_id;
    if (!e.settings.empty()) j["settings"] = json::parse(e.settings);
  } else {
    j["trial"] = e.trial;
    if (e.kind == Event::Kind::kCreated) j["bracket"] = e.bracket;
    if (e.kind != Event::Kind::kCreated) j["rung"] = e.rung;
    if (e.kind == Event::Kind::kRung) j["metric"] = core::json_number(e.metric);
  }
  if (!e.time.empty()) j["time"] = e.time;
  if (!e.worker.empty()) j["worker"] = e.worker;
  return j.dump() + "\n";
}

Event parse_event(const std::string& line, const std::string& where) {
  if (auto fast = FlatReader(line).event()) return *fast;
  Event e;
  try {
    const json j = json::parse(line);
    const auto kind = kinds().find(j.at("event").get<std::string>());
    if (kind == kinds().end()) throw SearchError(where + ": unknown event '" + j.at("event").get<std::string>() + "'");
    e.kind = kind->second;
    if (e.kind == Event::Kind::kSearch) {
      e.experiment_id = j.at("experiment_id").get<std::string>();
      if (j.contains("settings")) e.settings = j.at("settings").dump();
    } else {
      e.trial = j.at("trial").get<int>();
      e.bracket = j.value("bracket", 0);
      e.rung = j.value("rung", 0);
    }
    if (e.kind == Event::Kind::kRung) {
      const auto metric = core::number_of(j.at("metric"));
      if (!metric) throw SearchError(where + ": the metric " + j.at("metric").dump() + " is not a number");
      e.metric = *metric;
    }
    e.time = j.value("time", "");
    e.worker = j.value("worker", "");
  } catch (const json::exception& ex) {
    throw SearchError(where + ": not an event of a search log (" + ex.what() + ")");
  }
  return e;
}

EventLog::EventLog(std::string path, std::string lock_path, std::string experiment_id, std::string settings)
    : path_(std::move(path)),
      lock_path_(std::move(lock_path)),
      experiment_id_(std::move(experiment_id)),
      settings_(std::move(settings)) {}

EventLog::Locked EventLog::lock() const {
  core::UniqueFd fd(::open(lock_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (fd.get() < 0) throw_errno("cannot open " + lock_path_);
  core::lock_file_exclusive(fd.get(), lock_path_, core::LockWait::kWait);
  return Locked(*this, std::move(fd));
}

EventLog::Locked::Locked(const EventLog& log, core::UniqueFd lock) : log_(&log), lock_(std::move(lock)) {}

namespace {

// The whole log; "" when there is none yet. IoError for a log that is there and cannot be read
// (a transient error of a shared filesystem): it is never taken for an empty one.
std::string read_whole(const std::string& path) {
  core::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return "";
    throw_errno("the search log " + path + " cannot be opened (nothing is appended to a log that cannot be read)");
  }
  std::string text;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd.get(), buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw_errno("the search log " + path + " cannot be read (nothing is appended to a log that cannot be read)");
    if (n == 0) break;
    text.append(buffer, static_cast<std::size_t>(n));
  }
  return text;
}

}  // namespace

// Every complete line; one cut short by a worker that died writing it is not an event.
std::vector<Event> EventLog::parse(const std::string& text) const {
  std::vector<Event> out;
  std::size_t start = 0;
  for (int number = 1; start < text.size(); ++number) {
    const std::size_t end = text.find('\n', start);
    if (end == std::string::npos) break;
    const std::string_view line(text.data() + start, end - start);
    if (auto fast = FlatReader(line).event()) {
      out.push_back(std::move(*fast));
    } else {
      out.push_back(parse_event(std::string(line), path_ + ":" + std::to_string(number)));
    }
    start = end + 1;
  }
  return out;
}

void EventLog::check(const std::vector<Event>& events) const {
  if (events.front().kind != Event::Kind::kSearch) {
    throw SearchError(path_ + ":1: the log does not begin with the search's line, which names its experiment");
  }
  if (events.front().experiment_id != experiment_id_) {
    throw SearchError(path_ + " is the search of experiment " + events.front().experiment_id + ", not of this one (" +
                      experiment_id_ + "): a search continues only its own log; move that file away, or run "
                      "the experiment it belongs to");
  }
  const auto same = [](const std::string& a, const std::string& b) {
    try {
      return json::parse(a) == json::parse(b);
    } catch (const json::exception&) {
      return a == b;
    }
  };
  if (!settings_.empty() && !same(events.front().settings, settings_)) {
    throw SearchError(path_ + ":1: the search began with the settings " + events.front().settings +
                      ", and the config now makes " + settings_ + ": a search keeps its settings from its first "
                      "trial to its last; run it with the searcher section that began it, or begin a new experiment "
                      "(--experiment DIR)");
  }
}

std::vector<Event> EventLog::read_only() const {
  std::vector<Event> out = parse(read_whole(path_));
  if (!out.empty()) check(out);
  return out;
}

std::vector<Event> EventLog::Locked::read() {
  std::vector<Event> out = log_->parse(read_whole(log_->path_));
  if (out.empty()) {
    Event search;
    search.kind = Event::Kind::kSearch;
    search.experiment_id = log_->experiment_id_;
    search.settings = log_->settings_;
    append({search}, "");
    out.push_back(search);
  }
  log_->check(out);
  return out;
}

void EventLog::Locked::append(std::vector<Event> events, const std::string& worker) {
  std::string text;
  const std::string now = core::utc_now_iso();
  for (auto& e : events) {
    if (e.time.empty()) e.time = now;
    if (e.worker.empty()) e.worker = worker;
    text += to_json_line(e);
  }
  const std::string& path = log_->path_;
  core::UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (fd.get() < 0) throw_errno("cannot open " + path);
  struct ::stat st {};
  if (::fstat(fd.get(), &st) != 0) throw_errno("cannot stat " + path);
  // A last line cut short: cut it off before appending.
  off_t end = st.st_size;
  char last = '\n';
  while (end > 0 && ::pread(fd.get(), &last, 1, end - 1) == 1 && last != '\n') --end;
  if (end != st.st_size && ::ftruncate(fd.get(), end) != 0) throw_errno("cannot cut the torn last line of " + path);
  if (::lseek(fd.get(), end, SEEK_SET) < 0) throw_errno("cannot seek in " + path);
  core::write_fully(fd.get(), text, path);
  if (::fsync(fd.get()) != 0) throw_errno("cannot fsync " + path);
}

Asha replay(const AshaOptions& options, const std::vector<Event>& events, const std::string& path) {
  Asha asha(options);
  for (std::size_t i = 0; i < events.size(); ++i) {
    try {
      asha.apply(events[i]);
    } catch (const SearchError& e) {
      throw SearchError(path + ":" + std::to_string(i + 1) + ": " + e.what());
    }
  }
  return asha;
}

Event make_event(Event::Kind kind, int trial, int rung, double metric) {
  Event e;
  e.kind = kind;
  e.trial = trial;
  e.rung = rung;
  e.metric = metric;
  return e;
}

namespace {

const TrialState& training_trial(const Asha& asha, int trial, const std::string& log_path) {
  const auto it = asha.trials().find(trial);
  if (it == asha.trials().end() || !it->second.training) {
    throw SearchError(log_path + " says trial " + std::to_string(trial) + " is not training toward a rung, but its "
                      "ranks are: the log was edited, restored from an older copy, or another worker recorded the "
                      "rung. Restore the log that made the trial, or run the search as a new experiment "
                      "(--experiment DIR)");
  }
  return it->second;
}

}  // namespace

std::int64_t training_length(const Asha& asha, int trial, const std::string& log_path) {
  const TrialState& t = training_trial(asha, trial, log_path);
  return asha.length(t.bracket, t.rung);
}

RungRecorded record_rung(EventLog::Locked& locked, const AshaOptions& options, const std::string& log_path, int trial,
                         double metric, bool in_place, const std::string& worker) {
  Asha asha = replay(options, locked.read(), log_path);
  const TrialState& t = training_trial(asha, trial, log_path);
  RungRecorded out;
  out.rung = t.rung;
  const int bracket = t.bracket;
  std::vector<Event> events = {make_event(Event::Kind::kRung, trial, out.rung, metric)};
  asha.apply(events.front());
  out.after = asha.after_rung(trial, out.rung);
  if (out.after == AfterRung::kFinish) events.push_back(make_event(Event::Kind::kFinished, trial, out.rung));
  if (out.after == AfterRung::kStop) events.push_back(make_event(Event::Kind::kStopped, trial, out.rung));
  if (out.after == AfterRung::kContinue && (options.stop_once || in_place)) {
    events.push_back(make_event(Event::Kind::kPromoted, trial, out.rung + 1));
    out.next_length = asha.length(bracket, out.rung + 1);
  }
  locked.append(events, worker);
  return out;
}

}  // namespace hpctrial::search
