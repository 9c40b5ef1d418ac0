// The search's state on the shared filesystem: an append-only log of events (asha.h), one JSON
// object a line, in the experiment directory (core::ExperimentLayout::search_log()). A worker
// takes the log's lock (core::lock_file_exclusive: flock, or an OFD lock where flock is not
// supported), reads every line, replays them, decides, appends its events in one write, fsyncs
// and lets go. The first line names the experiment; a log of another experiment is refused. A
// line cut short by a worker that died mid-write is never read as an event: it is ignored, and
// the next append cuts it off first.
//
//   {"event":"search","experiment_id":"...","settings":{"brackets":[[4,45],...],"divisor":4,...},...}
//   {"event":"created","trial":3,"bracket":0,...}  {"event":"started","trial":3,"rung":0,...}
//   {"event":"rung","trial":3,"rung":0,"metric":0.41,...}  {"event":"promoted","trial":3,"rung":1,...}
//   {"event":"stopped"|"finished"|"failed","trial":3,"rung":1,...}
// Metrics round-trip whatever their value (NaN and infinities as core::json_number writes them).
#pragma once

#include <string>
#include <vector>

#include "hpctrial/core/files.h"
#include "hpctrial/search/asha.h"

namespace hpctrial::search {

std::string to_json_line(const Event& event);
// SearchError naming `where` (file:line) for a line that is not an event.
Event parse_event(const std::string& line, const std::string& where);

class EventLog {
 public:
  // `settings`: the search's (settings_of); a log begun with others is refused.
  EventLog(std::string path, std::string lock_path, std::string experiment_id, std::string settings);

  // The log's lock, held for a whole decision (read, decide, append). Blocks until it is free.
  class Locked {
   public:
    Locked(Locked&&) = default;
    Locked& operator=(Locked&&) = default;
    // Every complete event, the search line first (written now when the log is new).
    // SearchError for a log of another experiment or of other settings, or a malformed line
    // (naming file:line).
    std::vector<Event> read();
    // Appends `events` (stamped with the time and `worker` when they have none) in one write,
    // then fsyncs the file.
    void append(std::vector<Event> events, const std::string& worker);

   private:
    friend class EventLog;
    Locked(const EventLog& log, core::UniqueFd lock);
    const EventLog* log_;
    core::UniqueFd lock_;
  };
  Locked lock() const;
  // The complete events without the lock and without writing anything (for people: `hpctrial
  // describe` and `plot`, which may only read the experiment): empty when there is no log yet.
  // The same checks as Locked::read.
  std::vector<Event> read_only() const;

  const std::string& path() const { return path_; }

 private:
  std::vector<Event> parse(const std::string& text) const;
  void check(const std::vector<Event>& events) const;

  std::string path_, lock_path_, experiment_id_, settings_;
};

// Replays `events` into a search of `options`; SearchError naming the log and the line of the
// first event that does not follow.
Asha replay(const AshaOptions& options, const std::vector<Event>& events, const std::string& path);

// An event of `kind` for `trial` at `rung` (a kRung's `metric`).
Event make_event(Event::Kind kind, int trial, int rung, double metric = 0);

// What reaching a rung led to.
struct RungRecorded {
  AfterRung after = AfterRung::kPause;
  int rung = 0;
  // The end of the next rung, in the unit of max_length, when the trial goes on at once
  // (promoted in place, or stop_once); 0 otherwise.
  std::int64_t next_length = 0;
};
// Under the log's lock: `trial`, which the log says trains toward a rung, reached it with
// `metric`. The rung and what follows are appended together: kFinished at the top rung,
// kStopped under stop_once, and kPromoted when it goes on at once - under stop_once, or granted
// a promotion and `in_place` (the trial's ranks train on). SearchError when the log says the
// trial is not training.
RungRecorded record_rung(EventLog::Locked& locked, const AshaOptions& options, const std::string& log_path, int trial,
                         double metric, bool in_place, const std::string& worker);
// The end of the rung the log says `trial` trains toward, in the unit of max_length; SearchError
// when it is not training.
std::int64_t training_length(const Asha& asha, int trial, const std::string& log_path);

}  // namespace hpctrial::search
