#include "hpctrial/core/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <set>
#include <utility>

#include "hpctrial/core/error.h"
#include "hpctrial/core/shell_quote.h"

extern char** environ;

namespace hpctrial::core {
namespace {

using Clock = std::chrono::steady_clock;

// A pipe whose ends close themselves.
class Pipe {
 public:
  Pipe() {
    if (::pipe2(fds_, O_CLOEXEC) != 0) throw_errno("cannot create a pipe", errno);
  }
  ~Pipe() {
    close_read();
    close_write();
  }
  Pipe(const Pipe&) = delete;
  Pipe& operator=(const Pipe&) = delete;
  int read_end() const { return fds_[0]; }
  int write_end() const { return fds_[1]; }
  void close_read() { close_fd(fds_[0]); }
  void close_write() { close_fd(fds_[1]); }
  int release_read() { return std::exchange(fds_[0], -1); }
  int release_write() { return std::exchange(fds_[1], -1); }

 private:
  static void close_fd(int& fd) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  int fds_[2] = {-1, -1};
};

std::vector<std::string> build_environment(const std::vector<std::pair<std::string, std::string>>& env_set,
                                           const std::vector<std::string>& env_unset) {
  std::set<std::string> drop(env_unset.begin(), env_unset.end());
  for (const auto& [name, value] : env_set) drop.insert(name);
  std::vector<std::string> env;
  for (char** p = environ; p != nullptr && *p != nullptr; ++p) {
    const std::string entry(*p);
    const std::string name = entry.substr(0, entry.find('='));
    if (drop.count(name) == 0) env.push_back(entry);
  }
  for (const auto& [name, value] : env_set) env.push_back(name + "=" + value);
  return env;
}

void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    throw_errno("cannot make a pipe non-blocking", errno);
  }
}

// Blocks SIGPIPE in this thread while alive, so writing to a child that closed its input
// gives EPIPE instead of killing the process; a SIGPIPE raised meanwhile is consumed.
class SigpipeGuard {
 public:
  SigpipeGuard() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~SigpipeGuard() {
    if (!was_pending_) {
      const timespec zero{0, 0};
      while (sigtimedwait(&pipe_, nullptr, &zero) == SIGPIPE) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeGuard(const SigpipeGuard&) = delete;
  SigpipeGuard& operator=(const SigpipeGuard&) = delete;

 private:
  sigset_t pipe_{};
  sigset_t old_{};
  bool was_pending_ = false;
};

std::string first_line(const std::string& text) {
  std::size_t start = text.find_first_not_of(" \t\r\n");
  if (start == std::string::npos) return "";
  std::size_t end = text.find('\n', start);
  std::string line = text.substr(start, end == std::string::npos ? std::string::npos : end - start);
  while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
  return line;
}

// argv[0] as execvp would find it on PATH (the caller's); errno's reason when it is nowhere.
std::string find_program(const std::string& program, int& error) {
  error = 0;
  if (program.find('/') != std::string::npos) return program;
  const char* path = std::getenv("PATH");
  const std::string dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  error = ENOENT;
  for (std::size_t start = 0; start <= dirs.size();) {
    const std::size_t end = std::min(dirs.find(':', start), dirs.size());
    const std::string dir = end > start ? dirs.substr(start, end - start) : ".";
    const std::string candidate = dir + "/" + program;
    struct stat info {};
    if (::stat(candidate.c_str(), &info) == 0 && S_ISREG(info.st_mode)) {
      if (::access(candidate.c_str(), X_OK) == 0) return candidate;
      error = EACCES;
    }
    start = end + 1;
  }
  return "";
}

// In the child, between fork and exec: `fd` as `target`, open across exec.
void move_fd(int fd, int target) {
  if (fd == target) {
    ::fcntl(fd, F_SETFD, 0);
  } else {
    ::dup2(fd, target);
  }
}

// The child's argv and environment as execve takes them: the char* arrays point into the
// strings beside them, so the whole is filled in place and never copied.
struct ExecArgs {
  ExecArgs() = default;
  ExecArgs(const ExecArgs&) = delete;
  ExecArgs& operator=(const ExecArgs&) = delete;

  std::vector<std::string> env_strings;
  std::vector<char*> envp;
  std::vector<std::string> arg_strings;
  std::vector<char*> args;
};

void prepare_exec_args(const std::vector<std::string>& argv, const SpawnOptions& options, ExecArgs& exec) {
  exec.env_strings = build_environment(options.env_set, options.env_unset);
  for (auto& entry : exec.env_strings) exec.envp.push_back(entry.data());
  exec.envp.push_back(nullptr);
  exec.arg_strings = argv;
  for (auto& arg : exec.arg_strings) exec.args.push_back(arg.data());
  exec.args.push_back(nullptr);
}

// The child's standard streams when output is captured: pipes for stdout and stderr, and for
// stdin a pipe (with pipe_stdin) or /dev/null.
struct ChildStreams {
  std::optional<Pipe> in, out, err;
  UniqueFd null;
};

void open_child_streams(const SpawnOptions& options, ChildStreams& streams) {
  if (!options.capture_output) return;
  streams.out.emplace();
  streams.err.emplace();
  if (options.pipe_stdin) {
    streams.in.emplace();
  } else {
    streams.null = UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (streams.null.get() < 0) throw_errno("cannot open /dev/null", errno);
  }
}

// In the child, between fork and exec: async-signal-safe calls only, nothing allocated. Sets
// up the process and execs `program`; when chdir or exec fails, writes errno to `report_fd`.
[[noreturn]] void exec_child(const std::string& program, const ExecArgs& exec, const SpawnOptions& options,
                             const ChildStreams& streams, int report_fd, pid_t parent) {
  if (options.die_with_parent) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the parent died before the line above
  }
  if (options.own_process_group) ::setpgid(0, 0);
  for (int signal = 1; signal < NSIG; ++signal) {
    if (signal != SIGKILL && signal != SIGSTOP) ::signal(signal, SIG_DFL);
  }
  sigset_t blocked;
  sigemptyset(&blocked);
  for (const int signal : options.blocked_signals) sigaddset(&blocked, signal);
  ::sigprocmask(SIG_SETMASK, &blocked, nullptr);
  if (options.capture_output) {
    move_fd(streams.in ? streams.in->read_end() : streams.null.get(), STDIN_FILENO);
    move_fd(streams.out->write_end(), STDOUT_FILENO);
    move_fd(streams.err->write_end(), STDERR_FILENO);
  }
  int e = 0;
  if (!options.working_dir.empty() && ::chdir(options.working_dir.c_str()) != 0) {
    e = errno;
  } else {
    ::execve(program.c_str(), exec.args.data(), exec.envp.data());
    e = errno;
  }
  (void)!::write(report_fd, &e, sizeof e);  // the parent reads it; nothing to do if it cannot
  ::_exit(127);
}

// In the parent: waits until the child has exec'd (the report pipe closes) or reported a
// failure. Returns the child's errno after reaping it when exec failed.
std::optional<int> exec_failure(pid_t pid, Pipe& report) {
  report.close_write();
  int child_errno = 0;
  ssize_t n;
  while ((n = ::read(report.read_end(), &child_errno, sizeof child_errno)) < 0 && errno == EINTR) {
  }
  if (n == static_cast<ssize_t>(sizeof child_errno)) {
    while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    return child_errno;
  }
  return std::nullopt;
}

// In the parent after a successful exec: closes the child's ends and keeps the parent's.
Child take_streams(pid_t pid, const SpawnOptions& options, ChildStreams& streams) {
  Child child;
  child.pid = pid;
  if (options.capture_output) {
    streams.out->close_write();
    streams.err->close_write();
    set_nonblocking(streams.out->read_end());
    set_nonblocking(streams.err->read_end());
    child.out = UniqueFd(streams.out->release_read());
    child.err = UniqueFd(streams.err->release_read());
    if (streams.in) {
      streams.in->close_read();
      set_nonblocking(streams.in->write_end());
      child.in = UniqueFd(streams.in->release_write());
    }
  }
  return child;
}

}  // namespace

Child spawn_process(const std::vector<std::string>& argv, const SpawnOptions& options) {
  if (argv.empty() || argv.front().empty()) throw IoError("spawn_process: empty command line");
  const auto cannot = [&](int error) {
    std::string hint = error == ENOENT ? " (is it installed and on PATH?)" : "";
    if (!options.working_dir.empty()) hint += " (working directory " + options.working_dir + ")";
    return IoError("cannot run '" + argv.front() + "': " + std::strerror(error) + hint);
  };
  int error = 0;
  const std::string program = find_program(argv.front(), error);
  if (program.empty()) throw cannot(error);

  // Everything the child needs, made before fork: between fork and exec it may only make
  // async-signal-safe calls.
  ExecArgs exec;
  prepare_exec_args(argv, options, exec);
  ChildStreams streams;
  open_child_streams(options, streams);
  Pipe report;  // the child's errno when exec fails; closed by a successful exec
  const pid_t parent = ::getpid();

  const pid_t pid = ::fork();
  if (pid < 0) throw_errno("cannot fork to run '" + argv.front() + "'", errno);
  if (pid == 0) exec_child(program, exec, options, streams, report.write_end(), parent);
  if (options.own_process_group) ::setpgid(pid, pid);  // also here: no window without the group
  if (const std::optional<int> child_errno = exec_failure(pid, report)) throw cannot(*child_errno);
  return take_streams(pid, options, streams);
}

std::string RunResult::describe() const {
  std::string command;
  try {
    command = shell_join(argv);
  } catch (const Error&) {
    command = argv.empty() ? "" : argv.front();
  }
  std::string text = "'" + command + "'";
  if (timed_out) {
    text += " timed out after " + std::to_string(elapsed.count() / 1000.0).substr(0, 5) + " s";
  } else if (signal != 0) {
    text += " was killed by signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
  } else {
    text += " exited with code " + std::to_string(exit_code);
  }
  std::string detail = first_line(err);
  if (detail.empty()) detail = first_line(out);
  if (!detail.empty() && !ok()) text += ": " + detail;
  return text;
}

namespace {

SpawnOptions spawn_options_for(const RunOptions& options) {
  SpawnOptions spawn;
  spawn.env_set = options.env_set;
  spawn.env_unset = options.env_unset;
  spawn.working_dir = options.working_dir;
  spawn.pipe_stdin = !options.stdin_data.empty();
  return spawn;
}

// Appends what `fd` holds now to `sink`, up to `max_bytes` in all (setting `truncated` when it
// drops some); `open` becomes false at EOF.
void read_available(int fd, std::string& sink, bool& open, std::size_t max_bytes, bool& truncated) {
  char buffer[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n > 0) {
      const std::size_t room = max_bytes > sink.size() ? max_bytes - sink.size() : 0;
      const std::size_t take = std::min(room, static_cast<std::size_t>(n));
      sink.append(buffer, take);
      if (take < static_cast<std::size_t>(n)) truncated = true;
      continue;
    }
    if (n == 0) open = false;
    if (n < 0 && errno == EINTR) continue;
    return;  // EAGAIN, EOF or an error: nothing more to read now
  }
}

// Writes as much of `data` past `written` as the pipe takes now; closes `in` once all is
// written or the child has closed its end.
void write_stdin(UniqueFd& in, const std::string& data, std::size_t& written) {
  const SigpipeGuard guard;
  while (written < data.size()) {
    const ssize_t n = ::write(in.get(), data.data() + written, data.size() - written);
    if (n > 0) {
      written += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) break;
    written = data.size();  // EPIPE: the child does not read its input
  }
  if (written >= data.size()) in = UniqueFd();
}

// Where a running child stands with its timeout: SIGTERM at the timeout, SIGKILL kill_grace later.
struct TimeoutState {
  bool term_sent = false;
  bool kill_sent = false;
  Clock::time_point term_time;
};

// Signals the child's process group and the child itself once its time, then its grace, is up.
void enforce_timeout(pid_t pid, const RunOptions& options, Clock::time_point start, Clock::time_point now,
                     TimeoutState& state, RunResult& result) {
  if (options.timeout && !state.term_sent && now - start >= *options.timeout) {
    ::kill(-pid, SIGTERM);
    ::kill(pid, SIGTERM);
    state.term_sent = true;
    state.term_time = now;
    result.timed_out = true;
  }
  if (state.term_sent && !state.kill_sent && now - state.term_time >= options.kill_grace) {
    ::kill(-pid, SIGKILL);
    ::kill(pid, SIGKILL);
    state.kill_sent = true;
  }
}

// Waits briefly for the child's open pipes to be ready; returns whether stdin is still to be
// written.
bool wait_for_pipes(const Child& child, bool out_open, bool err_open, bool exited) {
  std::vector<pollfd> fds;
  if (out_open) fds.push_back({child.out.get(), POLLIN, 0});
  if (err_open) fds.push_back({child.err.get(), POLLIN, 0});
  const bool want_write = child.in.get() >= 0;
  if (want_write) fds.push_back({child.in.get(), POLLOUT, 0});
  // Short waits while the child runs so that its exit and the timeout are seen promptly.
  const int wait_ms = exited ? 20 : 50;
  if (!fds.empty()) {
    const int rc = ::poll(fds.data(), fds.size(), wait_ms);
    if (rc < 0 && errno != EINTR) throw_errno("poll on a child's pipes failed", errno);
  } else {
    ::usleep(static_cast<useconds_t>(wait_ms) * 1000);
  }
  return want_write;
}

void record_status(int status, RunResult& result) {
  if (WIFEXITED(status)) {
    result.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    result.signal = WTERMSIG(status);
  }
}

}  // namespace

RunResult run_process(const std::vector<std::string>& argv, const RunOptions& options) {
  if (argv.empty() || argv.front().empty()) {
    throw IoError("run_process: empty command line");
  }
  RunResult result;
  result.argv = argv;

  const SpawnOptions spawn = spawn_options_for(options);
  const auto start = Clock::now();
  Child child = spawn_process(argv, spawn);
  const pid_t pid = child.pid;
  std::size_t stdin_written = 0;

  bool out_open = true, err_open = true;
  bool exited = false;
  int status = 0;
  TimeoutState timeout;
  std::optional<Clock::time_point> exited_at;

  while (true) {
    const auto now = Clock::now();
    if (!exited) {
      const pid_t w = ::waitpid(pid, &status, WNOHANG);
      if (w == pid) {
        exited = true;
        exited_at = now;
      }
    }
    // Done when the child is gone and its output is drained; a grandchild that keeps the
    // pipes open (a daemon) gets 200 ms to finish writing, then we stop listening.
    if (exited && ((!out_open && !err_open) || now - *exited_at > std::chrono::milliseconds(200))) {
      break;
    }
    if (!exited) enforce_timeout(pid, options, start, now, timeout, result);
    const bool want_write = wait_for_pipes(child, out_open, err_open, exited);
    if (out_open) read_available(child.out.get(), result.out, out_open, options.max_output_bytes, result.truncated);
    if (err_open) read_available(child.err.get(), result.err, err_open, options.max_output_bytes, result.truncated);
    if (want_write) write_stdin(child.in, options.stdin_data, stdin_written);
  }

  if (!exited) {
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
  result.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  record_status(status, result);
  return result;
}

CommandRunner real_command_runner() {
  return [](const std::vector<std::string>& argv, const RunOptions& options) {
    RunOptions o = options;
    if (!o.timeout) o.timeout = std::chrono::minutes(1);
    return run_process(argv, o);
  };
}

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return false;
  std::string dirs = path;
  for (std::size_t start = 0; start <= dirs.size();) {
    const std::size_t end = std::min(dirs.find(':', start), dirs.size());
    const std::string dir = dirs.substr(start, end - start);
    if (!dir.empty() && ::access((dir + "/" + program).c_str(), X_OK) == 0) return true;
    start = end + 1;
  }
  return false;
}

std::string self_program(const std::string& fallback) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? fallback : self.string();
}

}  // namespace hpctrial::core
