#include "launch_contract.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {

bool StopFile::requested() {
  if (seen_ || path_.empty()) return seen_;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_ < std::chrono::seconds(1)) return false;
  last_ = now;
  seen_ = ::access(path_.c_str(), F_OK) == 0;
  return seen_;
}

namespace {

// What on_exit() needs: the heartbeat file stays open for the life of the process, so that the
// exit status can be added whichever way the process ends through exit().
std::atomic<int> g_exit_fd{-1};
std::atomic<long long> g_last_step{-1};

void format_line(char* line, std::size_t size, long long step, const char* exit_part) {
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  // Fixed width, so that a shorter line leaves nothing of a longer one behind.
  std::snprintf(line, size, "step %-20lld pid %-10d host %-64.64s%s\n", step, static_cast<int>(::getpid()), host,
                exit_part);
}

void report_exit(int status, void*) {
  const int fd = g_exit_fd.load();
  if (fd < 0) return;
  char exit_part[32];
  std::snprintf(exit_part, sizeof exit_part, " exit %d", status & 0xff);
  char line[400];
  format_line(line, sizeof line, g_last_step.load(), exit_part);
  (void)!::pwrite(fd, line, std::strlen(line), 0);
}

}  // namespace

Heartbeat::Heartbeat(const std::string& dir, int rank) {
  if (dir.empty()) return;
  const std::string path = dir + "/rank-" + std::to_string(rank);
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  if (fd_ < 0) return;
  const int exit_fd = ::dup(fd_);
  if (exit_fd >= 0 && g_exit_fd.exchange(exit_fd) < 0) ::on_exit(report_exit, nullptr);
  write(-1);  // who and where, before the first step
  thread_ = std::thread([this] {
    long long written = -1;
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      stop_.wait_for(lock, std::chrono::seconds(1));
      const long long step = step_.load(std::memory_order_relaxed);
      if (step != written) {
        write(step);
        written = step;
      }
    }
  });
}

Heartbeat::~Heartbeat() {
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    stop_.notify_all();
    thread_.join();
  }
  if (fd_ >= 0) ::close(fd_);
}

void Heartbeat::beat(long long step) {
  step_.store(step, std::memory_order_relaxed);
  g_last_step.store(step, std::memory_order_relaxed);
}

void Heartbeat::write(long long step) {
  char line[400];
  format_line(line, sizeof line, step, "");
  (void)!::pwrite(fd_, line, std::strlen(line), 0);
}

AbortWatch::AbortWatch(std::string path) : path_(std::move(path)) {
  if (path_.empty()) return;
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      stop_.wait_for(lock, std::chrono::milliseconds(500));
      if (stopping_ || ::access(path_.c_str(), F_OK) != 0) continue;
      // No handler, no exit() and no MPI_Finalize: a peer is gone, and any of them could wait.
      static const char kMessage[] = "the launcher ended this attempt (another rank failed); exiting now\n";
      (void)!::write(STDERR_FILENO, kMessage, sizeof kMessage - 1);
      ::raise(SIGKILL);
    }
  });
}

AbortWatch::~AbortWatch() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  stop_.notify_all();
  thread_.join();
}

FaultPlan::FaultPlan(const std::string& spec, int rank, int restart_count) : rank_(rank) {
  std::stringstream faults(spec);
  for (std::string text; std::getline(faults, text, ',');) {
    if (text.empty()) continue;
    Fault f;
    f.text = text;
    std::optional<int> for_rank, for_restart;
    std::stringstream words(text);
    static const std::regex numbered(R"((rank|step|restart)([0-9]{1,12}))");
    static const std::regex action(R"(exit[0-9]{1,3}|sigkill|segv|abort|throw|hang)");
    for (std::string word; std::getline(words, word, ':');) {
      std::smatch m;
      if (std::regex_match(word, m, numbered)) {
        const long long n = std::stoll(m[2]);
        if (m[1] == "rank") for_rank = static_cast<int>(n);
        if (m[1] == "step") f.step = n;
        if (m[1] == "restart") for_restart = static_cast<int>(n);
      } else if (word == "batch" || word == "validation" || word == "checkpoint") {
        f.phase = word == "batch" ? FaultPhase::kBatch : word == "validation" ? FaultPhase::kValidation
                                                                              : FaultPhase::kCheckpoint;
      } else if (std::regex_match(word, action)) {
        f.action = word;
      } else {
        throw ConfigError("HPCTRIAL_FAULT: \"" + word + "\" in \"" + text + "\" is not rank<N>, step<N>, restart<N>, "
                          "batch, validation, checkpoint or an action (exit<N>, sigkill, segv, abort, throw, hang)");
      }
    }
    if (f.action.empty()) throw ConfigError("HPCTRIAL_FAULT: \"" + text + "\" names no action, e.g. rank1:step7:sigkill");
    if ((!for_rank || *for_rank == rank) && (!for_restart || *for_restart == restart_count)) faults_.push_back(f);
  }
}

void FaultPlan::at(FaultPhase phase, long long step) const {
  for (const auto& f : faults_) {
    if (f.phase != phase || (f.step && *f.step != step)) continue;
    std::fprintf(stderr, "injected fault %s on rank %d at step %lld\n", f.text.c_str(), rank_, step);
    std::fflush(stderr);
    if (f.action == "sigkill") ::raise(SIGKILL);
    if (f.action == "segv") {
      ::signal(SIGSEGV, SIG_DFL);
      ::raise(SIGSEGV);
    }
    if (f.action == "abort") std::abort();
    if (f.action == "throw") throw std::runtime_error("injected fault " + f.text);
    if (f.action == "hang") {
      while (true) std::this_thread::sleep_for(std::chrono::hours(1));
    }
    // exit(), as a trial's own code would call it (a crash is sigkill, segv or abort).
    if (f.action.rfind("exit", 0) == 0) std::exit(std::stoi(f.action.substr(4)));
  }
}

}  // namespace hpctrial::trainer::detail
