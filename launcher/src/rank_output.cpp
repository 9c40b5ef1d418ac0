#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <sstream>

#include "hpctrial/core/files.h"
#include "launcher_internal.h"

namespace hpctrial::launcher::detail {
namespace {

constexpr std::size_t kTailLines = 30;
constexpr std::size_t kMaxLine = 64 * 1024;      // longer lines are cut into pieces
constexpr std::size_t kMaxMpirunText = 1 << 20;  // what is kept of mpirun's own words

void write_all(int fd, const std::string& text) {
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // a closed terminal must not stop the launcher
    }
    done += static_cast<std::size_t>(n);
  }
}

}  // namespace

RankOutput::RankOutput(core::TrialLayout trial, int out_fd, int err_fd, bool srun_labels)
    : trial_(std::move(trial)), out_fd_(out_fd), err_fd_(err_fd), srun_labels_(srun_labels) {
  core::create_directories(trial_.logs_dir());
}

RankOutput::~RankOutput() {
  flush();
  for (const auto& [rank, fd] : fds_) ::close(fd);
}

int RankOutput::log_fd(int rank) {
  const auto it = fds_.find(rank);
  if (it != fds_.end()) return it->second;
  const std::string path = rank < 0 ? trial_.mpirun_log() : trial_.rank_log(rank);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  fds_[rank] = fd;  // -1 when it cannot be opened: the terminal still gets the line
  return fd;
}

void RankOutput::feed(const char* data, std::size_t size, bool from_stderr) {
  std::string& pending = pending_[from_stderr ? 1 : 0];
  pending.append(data, size);
  std::size_t start = 0;
  for (std::size_t nl; (nl = pending.find('\n', start)) != std::string::npos; start = nl + 1) {
    line(pending.substr(start, nl - start), from_stderr);
  }
  pending.erase(0, start);
  while (pending.size() > kMaxLine) {
    line(pending.substr(0, kMaxLine), from_stderr);
    pending.erase(0, kMaxLine);
  }
}

void RankOutput::flush() {
  for (int i = 0; i < 2; ++i) {
    if (!pending_[i].empty()) line(std::exchange(pending_[i], std::string()), i == 1);
  }
}

std::optional<TaggedLine> untag_line(const std::string& line, bool srun_labels) {
  static const std::regex tagged(R"(\[[0-9]+,([0-9]+)\]<std(out|err)>: ?(.*))");
  static const std::regex labelled(R"( *([0-9]+): ?(.*))");  // srun pads the numbers to one width
  std::smatch m;
  if (srun_labels && std::regex_match(line, m, labelled)) return TaggedLine{std::stoi(m[1]), m[2], false};
  if (!srun_labels && std::regex_match(line, m, tagged)) return TaggedLine{std::stoi(m[1]), m[3], m[2] == "err"};
  return std::nullopt;
}

void RankOutput::line(const std::string& text, bool from_stderr) {
  int rank = -1;
  std::string body = text;
  if (const auto tagged = untag_line(text, srun_labels_)) {
    rank = tagged->rank;
    body = tagged->text;
    if (!srun_labels_) from_stderr = tagged->from_stderr;  // mpirun's tag says which stream
  }
  std::string shown = body;
  bool hold = false;
  if (rank >= 0) {
    // Log lines of the ranks already name their rank.
    const std::string tag = "[rank " + std::to_string(rank) + "] ";
    if (body.compare(0, tag.size(), tag) != 0 && body.find(tag) > 40) shown = tag + body;
  } else {
    if (mpirun_text_.size() < kMaxMpirunText) mpirun_text_ += body + "\n";
    const bool border = body.size() >= 10 && body.find_first_not_of('-') == std::string::npos;
    hold = in_box_ || border;
    if (border) in_box_ = !in_box_;
    if (hold && held_.size() < kMaxMpirunText) held_ += body + "\n";
  }
  if (!hold) write_all(from_stderr ? err_fd_ : out_fd_, shown + "\n");
  const int fd = log_fd(rank);
  if (fd >= 0) write_all(fd, body + "\n");
  auto& tail = tails_[rank];
  tail.push_back(body);
  if (tail.size() > kTailLines) tail.pop_front();
}

void RankOutput::show_held() {
  write_all(err_fd_, std::exchange(held_, std::string()));
}

std::vector<std::string> RankOutput::tail(int rank) const {
  const auto it = tails_.find(rank);
  if (it == tails_.end()) return {};
  return {it->second.begin(), it->second.end()};
}

namespace {

// The signal whose description (strsignal's words, as srun prints them) is `words`; 0: none.
int signal_described(const std::string& words) {
  for (int signal = 1; signal < NSIG; ++signal) {
    if (const char* name = ::strsignal(signal); name != nullptr && words == name) return signal;
  }
  return 0;
}

// srun's own report of the first task to fail: "srun: error: HOST: task 1: Exited with exit code
// 3", "...: tasks 0-1: Killed". Exit codes 0 and 75 (stopped on request) are no failures.
RankFailure parse_srun_failure(const std::string& text) {
  static const std::regex line(R"(srun: error: (\S+): tasks? ([0-9]+)[-,0-9]*: ([^\n]*))");
  static const std::regex exited(R"(Exited with exit code ([0-9]+))");
  RankFailure f;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), line); it != std::sregex_iterator(); ++it) {
    std::string words = (*it)[3];
    if (const std::string dumped = " (core dumped)"; words.size() > dumped.size() &&
                                                      words.compare(words.size() - dumped.size(), dumped.size(), dumped) == 0) {
      words.resize(words.size() - dumped.size());
    }
    std::smatch code;
    if (std::regex_match(words, code, exited)) {
      const int value = std::stoi(code[1]);
      if (value == 0 || value == core::kExitStopped) continue;
      f.exit_code = value;
      f.how = "exited with code " + std::to_string(value);
    } else if (const int signal = signal_described(words); signal != 0) {
      f.signal = signal;
      f.how = "was killed by signal " + std::to_string(signal) + " (" + words + ")";
    } else {
      f.how = "ended: " + words + " (srun's words)";
    }
    f.rank = std::stoi((*it)[2]);
    f.host = (*it)[1];
    return f;
  }
  return f;
}

}  // namespace

RankFailure parse_mpirun_failure(const std::string& text) {
  RankFailure f;
  std::smatch m;
  static const std::regex exited(R"(Process name: *\[\[[0-9]+,[0-9]+\],([0-9]+)\]\s*\n\s*Exit code: *([0-9]+))");
  static const std::regex signalled(
      R"(process rank ([0-9]+) with PID [0-9]+ on\s+node (\S+) exited on signal ([0-9]+)(\s*\(([^)]*)\))?)");
  static const std::regex improper(R"(process rank ([0-9]+) with PID [0-9]+ on\s+node (\S+) exiting\s+improperly)");
  static const std::regex aborted(R"(MPI_ABORT was invoked on rank ([0-9]+) in communicator \S+\s+with errorcode ([0-9]+))");
  if (auto f_srun = parse_srun_failure(text); f_srun.rank >= 0) return f_srun;
  if (std::regex_search(text, m, signalled)) {
    f.rank = std::stoi(m[1]);
    f.host = m[2];
    f.signal = std::stoi(m[3]);
    const std::string name = m[5].matched ? std::string(m[5]) : std::string(::strsignal(*f.signal));
    f.how = "was killed by signal " + std::to_string(*f.signal) + " (" + name + ")";
  } else if (std::regex_search(text, m, aborted)) {
    f.rank = std::stoi(m[1]);
    f.exit_code = std::stoi(m[2]);
    f.how = "called MPI_Abort with code " + std::string(m[2]);
  } else if (std::regex_search(text, m, exited)) {
    f.rank = std::stoi(m[1]);
    f.exit_code = std::stoi(m[2]);
    f.how = "exited with code " + std::string(m[2]);
  } else if (std::regex_search(text, m, improper)) {
    f.rank = std::stoi(m[1]);
    f.host = m[2];
    f.exit_code = 0;
    f.how = "exited before the others without finishing (exit code 0 before MPI_Finalize, or after it while "
            "others still ran)";
  }
  return f;
}

RankFailure attribute_failure(const std::vector<std::pair<int, core::HeartbeatRecord>>& records,
                              const std::optional<core::Verdict>& verdict, const std::string& mpirun_text,
                              const std::optional<RankFailure>& observed) {
  const auto record_of = [&](int rank) -> const core::HeartbeatRecord* {
    for (const auto& [r, record] : records) {
      if (r == rank) return &record;
    }
    return nullptr;
  };
  RankFailure f;
  // A watchdog that ended the job knew where every rank was, whoever the cause.
  const auto flight = verdict ? verdict->flight : std::vector<std::pair<int, std::string>>();
  // A rank that recorded its own failure is the cause; a watchdog that then found it missing
  // only saw the consequence.
  const core::HeartbeatRecord* first = nullptr;
  for (const auto& [rank, record] : records) {
    if (!record.end || !record.end->failed()) continue;
    if (first == nullptr || record.end->unix_ms < first->end->unix_ms) {
      first = &record;
      f.rank = rank;
    }
  }
  if (first != nullptr) {
    const core::RankEnd& end = *first->end;
    (end.kind == core::RankEnd::Kind::kSignal ? f.signal : f.exit_code) = end.code;
    f.how = end.describe();
    f.message = first->message;
  } else if (verdict && !verdict->culprits.empty()) {
    f.rank = verdict->culprits.front();
    std::string ranks;
    for (int r : verdict->culprits) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    f.how = "stopped answering (the collective watchdog found rank" + std::string(verdict->culprits.size() > 1 ? "s " : " ") +
            ranks + " missing and ended the job)";
    f.message = verdict->message;
  } else if (observed && (observed->signal || observed->exit_code)) {
    f = *observed;  // a status the launcher read itself: exact
  } else {
    f = parse_mpirun_failure(mpirun_text);
    if (f.rank < 0 && observed) f = *observed;
  }
  if (const core::HeartbeatRecord* record = f.rank >= 0 ? record_of(f.rank) : nullptr) {
    f.phase = core::phase_name(record->phase);
    f.step = record->step;
    if (f.host.empty()) f.host = record->host;
  }
  f.flight = flight;
  return f;
}

std::optional<int> zombie_status(int pid) {
  if (pid <= 0) return std::nullopt;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return std::nullopt;
  const auto close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size() || stat[close + 2] != 'Z') return std::nullopt;
  // Field 52, exit_code, in waitpid's format; fields after the command start at field 3.
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 52 && rest >> field; ++i) {
    if (i == 52) return std::stoi(field);
  }
  return std::nullopt;
}

}  // namespace hpctrial::launcher::detail
