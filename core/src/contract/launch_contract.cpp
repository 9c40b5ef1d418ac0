#include "hpctrial/core/launch_contract.h"

#include <dirent.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "hpctrial/core/error.h"
#include "hpctrial/core/search.h"
#include "hpctrial/core/text.h"

namespace hpctrial::core {
namespace {

// Field offsets and widths of the heartbeat record (see heartbeat_init for the whole line).
constexpr std::size_t kStepAt = 5, kStepWidth = 20;
constexpr std::size_t kPhaseAt = 32, kPhaseWidth = 12;
constexpr std::size_t kPidAt = 49, kPidWidth = 10;
constexpr std::size_t kHostAt = 65, kHostWidth = 64;
constexpr std::size_t kEndAt = 134, kEndWidth = 50;
constexpr std::size_t kLineEnd = 184;
constexpr std::size_t kMessageAt = 193, kMessageWidth = kHeartbeatSize - 1 - kMessageAt;

constexpr const char* kPhaseNames[] = {"startup", "batch", "agreement", "validation", "evaluate", "checkpoint",
                                       "shutdown"};

// Async-signal-safe: no allocation, no locale.
std::size_t put_number(char* out, long long value) noexcept {
  char digits[24];
  std::size_t n = 0;
  const bool negative = value < 0;
  unsigned long long v = negative ? 0ULL - static_cast<unsigned long long>(value) : static_cast<unsigned long long>(value);
  do {
    digits[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0);
  std::size_t i = 0;
  if (negative) out[i++] = '-';
  while (n > 0) out[i++] = digits[--n];
  return i;
}

// Writes `text` (at most `width` bytes) into the field and pads it with blanks.
void put_field(char* page, std::size_t at, std::size_t width, const char* text, std::size_t length) noexcept {
  const std::size_t n = std::min(length, width);
  std::memcpy(page + at, text, n);
  std::memset(page + at + n, ' ', width - n);
}

void put_text(char* page, std::size_t at, const char* literal) noexcept {
  std::memcpy(page + at, literal, std::strlen(literal));
}

std::string field(std::string_view text, std::size_t at, std::size_t width) {
  return trim(std::string(text.substr(at, width)));
}

int count_from_env(const EnvSource& env, const char* name, const char* what) {
  const auto value = env.get(name);
  if (!value) return 0;
  std::size_t used = 0;
  int n = -1;
  try {
    n = std::stoi(*value, &used);
  } catch (const std::exception&) {
  }
  if (n < 0 || used != value->size() || value->empty()) {
    throw ConfigError(std::string(name) + " must be " + what + " (0 or more), got \"" + *value +
                      "\"; it is set by hpctrial's launcher: unset it to run outside one");
  }
  return n;
}

}  // namespace

RankContract read_contract(const EnvSource& env) {
  RankContract c;
  const auto text = [&](const char* name) { return env.get(name).value_or(""); };
  c.experiment_dir = text(kEnvExperimentDir);
  c.config = text(kEnvConfig);
  c.trial_dir = text(kEnvTrialDir);
  c.trial_id = count_from_env(env, kEnvTrialId, "a trial number");
  c.restart_count = count_from_env(env, kEnvRestartCount, "a count of restarts");
  c.scheduler = text(kEnvScheduler);
  c.job_id = text(kEnvJobId);
  c.stop_file = text(kEnvStopFile);
  c.heartbeat_dir = text(kEnvHeartbeatDir);
  c.abort_file = text(kEnvAbortFile);
  c.verdict_file = text(kEnvVerdictFile);
  c.fault = text(kEnvFault);
  c.code_digest = text(kEnvCodeDigest);
  c.session = text(kEnvSession);
  c.search_worker = text(kEnvSearchWorker);
  if (const std::string length = text(kEnvMaxLength); !length.empty()) c.max_length = parse_length_text(length);
  return c;
}

std::string length_text(const Length& length) {
  return std::string(to_string(length.unit)) + ":" + std::to_string(length.value);
}

Length parse_length_text(const std::string& text) {
  const auto colon = text.find(':');
  Length length;
  bool known = false;
  for (const LengthUnit unit : {LengthUnit::kBatches, LengthUnit::kEpochs, LengthUnit::kRecords}) {
    if (colon != std::string::npos && text.substr(0, colon) == to_string(unit)) {
      length.unit = unit;
      known = true;
    }
  }
  char* end = nullptr;
  const std::string number = colon == std::string::npos ? "" : text.substr(colon + 1);
  const long long value = std::strtoll(number.c_str(), &end, 10);
  if (!known || number.empty() || *end != '\0' || value < 1) {
    throw ConfigError(std::string(kEnvMaxLength) + " is \"" + text + "\": it is <unit>:<count>, the unit batches, "
                      "epochs or records and the count 1 or more (the launcher sets it; unset it to train to "
                      "searcher.max_length)");
  }
  length.value = value;
  return length;
}

ExperimentConfig rank_config(const ExperimentConfig& experiment, const RankContract& contract) {
  ExperimentConfig config = trial_config(experiment, contract.trial_id);
  if (contract.max_length) config.searcher.max_length = *contract.max_length;
  return config;
}

const char* phase_name(RankPhase phase) { return kPhaseNames[static_cast<int>(phase)]; }

std::optional<RankPhase> parse_phase(std::string_view name) {
  for (int i = 0; i < static_cast<int>(std::size(kPhaseNames)); ++i) {
    if (name == kPhaseNames[i]) return static_cast<RankPhase>(i);
  }
  return std::nullopt;
}

std::string RankEnd::describe() const {
  switch (kind) {
    case Kind::kSignal: return "was killed by signal " + std::to_string(code) + " (" + ::strsignal(code) + ")";
    case Kind::kAbort: return "failed and aborted the job with code " + std::to_string(code);
    case Kind::kWatchdog: return "ended the job from its collective watchdog";
    case Kind::kExit: break;
  }
  if (code == kExitFinished) {
    return "exited with code 0 while the others still ran (before MPI_Finalize, or after it while others still "
           "needed it)";
  }
  return "exited with code " + std::to_string(code);
}

void heartbeat_init(char* page, long long step, RankPhase phase, int pid, std::string_view host) noexcept {
  std::memset(page, ' ', kHeartbeatSize);
  put_text(page, 0, "step ");
  put_text(page, kStepAt + kStepWidth, " phase ");
  put_text(page, kPhaseAt + kPhaseWidth, " pid ");
  put_text(page, kPidAt + kPidWidth, " host ");
  put_text(page, kHostAt + kHostWidth, " end ");
  page[kLineEnd] = '\n';
  put_text(page, kLineEnd + 1, "message ");
  page[kHeartbeatSize - 1] = '\n';
  heartbeat_put_step(page, step);
  heartbeat_put_phase(page, phase);
  char number[24];
  put_field(page, kPidAt, kPidWidth, number, put_number(number, pid));
  put_field(page, kHostAt, kHostWidth, host.data(), host.size());
  put_field(page, kEndAt, kEndWidth, "running", 7);
}

void heartbeat_put_step(char* page, long long step) noexcept {
  char number[24];
  put_field(page, kStepAt, kStepWidth, number, put_number(number, step));
}

void heartbeat_put_phase(char* page, RankPhase phase) noexcept {
  const char* name = phase_name(phase);
  put_field(page, kPhaseAt, kPhaseWidth, name, std::strlen(name));
}

void heartbeat_put_end(char* page, RankEnd end) noexcept {
  char text[kEndWidth];
  const char* kind = end.kind == RankEnd::Kind::kExit     ? "exit "
                     : end.kind == RankEnd::Kind::kSignal ? "signal "
                     : end.kind == RankEnd::Kind::kAbort  ? "abort "
                                                          : "watchdog ";
  std::size_t n = std::strlen(kind);
  std::memcpy(text, kind, n);
  n += put_number(text + n, end.code);
  std::memcpy(text + n, " at ", 4);
  n += 4;
  n += put_number(text + n, end.unix_ms);
  put_field(page, kEndAt, kEndWidth, text, n);
}

void heartbeat_put_message(char* page, const char* message) noexcept {
  // One line: newlines of the message become blanks.
  const std::size_t n = std::min(std::strlen(message), kMessageWidth);
  put_field(page, kMessageAt, kMessageWidth, message, n);
  for (std::size_t i = 0; i < n; ++i) {
    if (page[kMessageAt + i] == '\n' || page[kMessageAt + i] == '\r') page[kMessageAt + i] = ' ';
  }
}

std::optional<HeartbeatRecord> heartbeat_decode(std::string_view text) {
  if (text.size() < kHeartbeatSize || text.substr(0, 5) != "step " || text[kLineEnd] != '\n') return std::nullopt;
  HeartbeatRecord r;
  try {
    std::size_t used = 0;
    const std::string step = field(text, kStepAt, kStepWidth);
    r.step = std::stoll(step, &used);
    if (used != step.size()) return std::nullopt;
    const auto phase = parse_phase(field(text, kPhaseAt, kPhaseWidth));
    if (!phase) return std::nullopt;
    r.phase = *phase;
    r.pid = std::stoi(field(text, kPidAt, kPidWidth));
    r.host = field(text, kHostAt, kHostWidth);
    const std::string end = field(text, kEndAt, kEndWidth);
    if (end != "running") {
      std::istringstream words(end);
      std::string kind, at;
      RankEnd e;
      if (!(words >> kind >> e.code >> at >> e.unix_ms) || at != "at") return std::nullopt;
      if (kind == "exit") {
        e.kind = RankEnd::Kind::kExit;
      } else if (kind == "signal") {
        e.kind = RankEnd::Kind::kSignal;
      } else if (kind == "abort") {
        e.kind = RankEnd::Kind::kAbort;
      } else if (kind == "watchdog") {
        e.kind = RankEnd::Kind::kWatchdog;
      } else {
        return std::nullopt;
      }
      r.end = e;
    }
  } catch (const std::exception&) {
    return std::nullopt;
  }
  r.message = field(text, kMessageAt, kMessageWidth);
  return r;
}

std::optional<HeartbeatRecord> read_heartbeat(const std::string& dir, int rank) {
  const int fd = ::open(TrialLayout::heartbeat_file(dir, rank).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  char page[kHeartbeatSize];
  ssize_t n;
  do {
    n = ::pread(fd, page, sizeof page, 0);
  } while (n < 0 && errno == EINTR);
  ::close(fd);
  if (n <= 0) return std::nullopt;
  return heartbeat_decode(std::string_view(page, static_cast<std::size_t>(n)));
}

std::vector<std::pair<int, HeartbeatRecord>> read_heartbeats(const std::string& dir) {
  std::vector<std::pair<int, HeartbeatRecord>> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (const dirent* entry = ::readdir(d)) {
    const std::optional<int> rank = TrialLayout::heartbeat_rank(entry->d_name);
    if (!rank) continue;
    if (auto record = read_heartbeat(dir, *rank)) out.emplace_back(*rank, std::move(*record));
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

std::string encode_verdict(const Verdict& verdict) {
  std::string ranks;
  for (int r : verdict.culprits) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
  const auto one_line = [](std::string text) {
    std::replace(text.begin(), text.end(), '\n', ' ');
    return text;
  };
  std::string out = "culprits " + ranks + "\nmessage " + one_line(verdict.message) + "\n";
  for (const auto& [rank, operations] : verdict.flight) out += "rank " + std::to_string(rank) + " " + one_line(operations) + "\n";
  return out;
}

std::optional<Verdict> decode_verdict(std::string_view text) {
  std::istringstream in{std::string(text)};
  std::string line;
  Verdict v;
  if (!std::getline(in, line) || line.rfind("culprits ", 0) != 0) return std::nullopt;
  std::istringstream ranks(line.substr(9));
  for (std::string r; std::getline(ranks, r, ',');) {
    try {
      v.culprits.push_back(std::stoi(r));
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }
  if (std::getline(in, line) && line.rfind("message ", 0) == 0) v.message = line.substr(8);
  while (std::getline(in, line)) {
    if (line.rfind("rank ", 0) != 0) continue;
    const auto space = line.find(' ', 5);
    if (space == std::string::npos) continue;
    try {
      v.flight.emplace_back(std::stoi(line.substr(5, space - 5)), line.substr(space + 1));
    } catch (const std::exception&) {
      continue;  // a line cut short: the rest still stands
    }
  }
  return v;
}

}  // namespace hpctrial::core
