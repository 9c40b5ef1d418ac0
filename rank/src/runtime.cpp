#include "hpctrial/rank/runtime.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <time.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <filesystem>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "hpctrial/checkpoint/h5_handle.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/layout.h"

namespace hpctrial::rank {

bool StopFile::requested() {
  if (seen_ || path_.empty()) return seen_;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_ < std::chrono::seconds(1)) return false;
  last_ = now;
  seen_ = ::access(path_.c_str(), F_OK) == 0;
  return seen_;
}

namespace {

// The process's record (see RankRecord): mapped (or, where the filesystem cannot map it
// shared, a buffer written out with pwrite), kept for the life of the process.
std::atomic<char*> g_page{nullptr};
std::atomic<int> g_fd{-1};
std::atomic<bool> g_mapped{false};
std::atomic<int> g_phase{static_cast<int>(core::RankPhase::kStartup)};
std::atomic<bool> g_ended{false};
std::atomic<const RankRecord*> g_record{nullptr};

constexpr int kFatalSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
struct sigaction g_previous[std::size(kFatalSignals)];

long long unix_ms() noexcept {
  timespec now{};
  ::clock_gettime(CLOCK_REALTIME, &now);
  return static_cast<long long>(now.tv_sec) * 1000 + now.tv_nsec / 1000000;
}

// Async-signal-safe. Returns 0 or the errno of the failed write.
int flush_record() noexcept {
  char* page = g_page.load();
  const int fd = g_fd.load();
  if (page == nullptr || fd < 0) return 0;
  if (g_mapped.load()) return ::msync(page, core::kHeartbeatSize, MS_SYNC) == 0 ? 0 : errno;
  const ssize_t n = ::pwrite(fd, page, core::kHeartbeatSize, 0);
  return n == static_cast<ssize_t>(core::kHeartbeatSize) ? 0 : n < 0 ? errno : EIO;
}

// The first end wins: an abort recorded before MPI_Abort is not overwritten by the exit that
// follows it, nor a fatal signal by the exit of a handler it chains to.
void record_end(core::RankEnd::Kind kind, int code) noexcept {
  char* page = g_page.load();
  if (page == nullptr || g_ended.exchange(true)) return;
  core::heartbeat_put_end(page, {kind, code, unix_ms()});
  (void)flush_record();
}

void on_exit_record(int status, void*) {
  record_end(core::RankEnd::Kind::kExit, status & 0xff);
  // exit() from inside the training loop (the trial's own code): the harness's other threads
  // (checkpoint writer, data prefetcher, communicator) still run, and the exit handlers after
  // this one - HDF5 closing its library, static destructors - would pull their state from under
  // them (HDF5 prints garbage and loops). Flush what was printed and end here, with that code.
  const auto phase = static_cast<core::RankPhase>(g_phase.load());
  if (phase != core::RankPhase::kStartup && phase != core::RankPhase::kShutdown) {
    std::fflush(nullptr);
    ::_exit(status & 0xff);
  }
}

extern "C" void on_fatal_signal(int signal, siginfo_t* info, void* context) {
  record_end(core::RankEnd::Kind::kSignal, signal);
  for (std::size_t i = 0; i < std::size(kFatalSignals); ++i) {
    if (kFatalSignals[i] != signal) continue;
    const struct sigaction& previous = g_previous[i];
    if ((previous.sa_flags & SA_SIGINFO) != 0 && previous.sa_sigaction != nullptr) {
      previous.sa_sigaction(signal, info, context);  // MPI's backtrace, say; it ends the process
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN && previous.sa_handler != nullptr) {
      previous.sa_handler(signal);
    }
  }
  // Then as if we had never been here: the default action ends the process with this signal.
  ::signal(signal, SIG_DFL);
  ::raise(signal);
}

std::string hostname() {
  const std::string host = core::host_name();
  return host.empty() ? "?" : host;
}

}  // namespace

RankRecord::RankRecord(const std::string& dir, int rank)
    : path_(core::TrialLayout::heartbeat_file(dir, rank)) {
  if (g_record.load() != nullptr) throw InternalError("a RankRecord exists already in this process");
  core::UniqueFd fd(::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (fd.get() < 0) core::throw_errno("cannot create the heartbeat file " + path_, errno);
  char initial[core::kHeartbeatSize];
  core::heartbeat_init(initial, -1, current_phase(), static_cast<int>(::getpid()), hostname());
  // Written out whole, so that its blocks exist: a mapped page without them would end the
  // process with SIGBUS on a full disk instead of this error.
  core::write_fully(fd.get(), std::string_view(initial, sizeof initial), "the heartbeat file " + path_);
  void* mapped = ::mmap(nullptr, core::kHeartbeatSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  char* page = nullptr;
  if (mapped != MAP_FAILED) {
    page = static_cast<char*>(mapped);
    g_mapped.store(true);
  } else {
    page = new char[core::kHeartbeatSize];  // kept for the life of the process, like a mapping
    std::memcpy(page, initial, sizeof initial);
  }
  const int old_fd = g_fd.exchange(fd.release());
  g_page.store(page);  // an earlier record's page (a program that trains twice) stays as it was
  g_ended.store(false);
  if (old_fd >= 0) {
    ::close(old_fd);
  } else {
    // HDF5 registers its exit handler when first used: use it now, so that this handler comes
    // after it and runs before it.
    checkpoint::silence_h5_errors();
    ::on_exit(on_exit_record, nullptr);
  }
  for (std::size_t i = 0; i < std::size(kFatalSignals); ++i) {
    struct sigaction action {};
    action.sa_sigaction = on_fatal_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_SIGINFO;
    ::sigaction(kFatalSignals[i], &action, &g_previous[i]);
  }
  g_record.store(this);
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      stop_.wait_for(lock, std::chrono::seconds(1));
      if (const int e = flush_record(); e != 0 && error_.load() == 0) error_.store(e);
    }
  });
}

RankRecord::~RankRecord() {
  g_record.store(nullptr);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  stop_.notify_all();
  thread_.join();
}

void RankRecord::check() const {
  if (const int e = error_.load(); e != 0) {
    core::throw_errno("cannot write the heartbeat file " + path_ + " (the launcher follows this rank through it)", e);
  }
}

const RankRecord* RankRecord::current() { return g_record.load(); }

void record_step(long long step) noexcept {
  if (char* page = g_page.load(std::memory_order_relaxed)) core::heartbeat_put_step(page, step);
}

void record_phase(core::RankPhase phase) noexcept {
  g_phase.store(static_cast<int>(phase), std::memory_order_relaxed);
  if (char* page = g_page.load(std::memory_order_relaxed)) core::heartbeat_put_phase(page, phase);
}

core::RankPhase current_phase() noexcept { return static_cast<core::RankPhase>(g_phase.load(std::memory_order_relaxed)); }

void record_watchdog_abort() noexcept { record_end(core::RankEnd::Kind::kWatchdog, 1); }

void record_exit(int code) noexcept { record_end(core::RankEnd::Kind::kExit, code); }

void record_abort(int code, const std::string& message) noexcept {
  char* page = g_page.load();
  if (page == nullptr || g_ended.load()) return;
  core::heartbeat_put_message(page, message.c_str());
  record_end(core::RankEnd::Kind::kAbort, code);
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
    static const std::regex action(R"(exit[0-9]{1,3}|sigkill|nodeloss|segv|abort|throw|hang|usr2|sleep[0-9]{1,4})");
    for (std::string word; std::getline(words, word, ':');) {
      std::smatch m;
      if (std::regex_match(word, m, numbered)) {
        const long long n = std::stoll(m[2]);
        if (m[1] == "rank") for_rank = static_cast<int>(n);
        if (m[1] == "step") f.step = n;
        if (m[1] == "restart") for_restart = static_cast<int>(n);
      } else if (const auto phase = core::parse_phase(word); phase && *phase != FaultPhase::kShutdown) {
        f.phase = *phase;
      } else if (word == "shards" || word == "writer") {
        f.phase = FaultPhase::kCheckpoint;
        f.writer = true;
      } else if (std::regex_match(word, action)) {
        f.action = word;
      } else {
        throw ConfigError("HPCTRIAL_FAULT: \"" + word + "\" in \"" + text + "\" is not rank<N>, step<N>, restart<N>, "
                          "batch, validation, checkpoint, writer, shards or an action (exit<N>, sigkill, nodeloss, segv, abort, throw, hang, usr2, "
                          "sleep<seconds>)");
      }
    }
    if (f.action.empty()) throw ConfigError("HPCTRIAL_FAULT: \"" + text + "\" names no action, e.g. rank1:step7:sigkill");
    if ((!for_rank || *for_rank == rank) && (!for_restart || *for_restart == restart_count)) faults_.push_back(f);
  }
}

void FaultPlan::at(FaultPhase phase, long long step, bool writer) const {
  for (const auto& f : faults_) {
    if (f.phase != phase || f.writer != writer || (f.step && *f.step != step)) continue;
    std::fprintf(stderr, "injected fault %s on rank %d at step %lld (unix ms %lld)\n", f.text.c_str(), rank_, step,
                 unix_ms());
    std::fflush(stderr);
    if (f.action == "sigkill") ::raise(SIGKILL);
    if (f.action == "nodeloss") {  // what the node's loss takes from this rank: its node memory, then itself
      std::error_code ignored;
      if (!node_memory_.empty()) std::filesystem::remove_all(node_memory_, ignored);
      ::raise(SIGKILL);
    }
    if (f.action == "segv") ::raise(SIGSEGV);  // as a bad access would: through the handlers installed
    if (f.action == "abort") std::abort();
    if (f.action == "throw") throw std::runtime_error("injected fault " + f.text);
    if (f.action == "usr2") {  // a scheduler's warning reaching this rank alone: then on as before
      ::raise(SIGUSR2);
      continue;
    }
    if (f.action.rfind("sleep", 0) == 0) {  // slow storage, a slow node: then on as before
      std::this_thread::sleep_for(std::chrono::seconds(std::stoi(f.action.substr(5))));
      continue;
    }
    if (f.action == "hang") {
      while (true) std::this_thread::sleep_for(std::chrono::hours(1));
    }
    // exit(), as a trial's own code would call it (a crash is sigkill, segv or abort).
    if (f.action.rfind("exit", 0) == 0) std::exit(std::stoi(f.action.substr(4)));
  }
}

}  // namespace hpctrial::rank
