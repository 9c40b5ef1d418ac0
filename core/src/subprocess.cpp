#include "hpctrial/core/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

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

 private:
  static void close_fd(int& fd) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  int fds_[2] = {-1, -1};
};

std::vector<std::string> build_environment(const RunOptions& options) {
  std::set<std::string> drop(options.env_unset.begin(), options.env_unset.end());
  for (const auto& [name, value] : options.env_set) drop.insert(name);
  std::vector<std::string> env;
  for (char** p = environ; p != nullptr && *p != nullptr; ++p) {
    const std::string entry(*p);
    const std::string name = entry.substr(0, entry.find('='));
    if (drop.count(name) == 0) env.push_back(entry);
  }
  for (const auto& [name, value] : options.env_set) env.push_back(name + "=" + value);
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

}  // namespace

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

RunResult run_process(const std::vector<std::string>& argv, const RunOptions& options) {
  if (argv.empty() || argv.front().empty()) {
    throw IoError("run_process: empty command line");
  }
  RunResult result;
  result.argv = argv;

  Pipe in, out, err;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in.read_end(), STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out.write_end(), STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err.write_end(), STDERR_FILENO);
  if (!options.working_dir.empty()) {
    posix_spawn_file_actions_addchdir_np(&actions, options.working_dir.c_str());
  }

  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  sigset_t all, none;
  sigfillset(&all);
  sigemptyset(&none);
  posix_spawnattr_setsigdefault(&attributes, &all);
  posix_spawnattr_setsigmask(&attributes, &none);
  posix_spawnattr_setpgroup(&attributes, 0);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK |
                                            POSIX_SPAWN_SETPGROUP);

  std::vector<std::string> env_strings = build_environment(options);
  std::vector<char*> env_pointers;
  for (auto& entry : env_strings) env_pointers.push_back(entry.data());
  env_pointers.push_back(nullptr);
  std::vector<std::string> arg_strings = argv;
  std::vector<char*> arg_pointers;
  for (auto& arg : arg_strings) arg_pointers.push_back(arg.data());
  arg_pointers.push_back(nullptr);

  const auto start = Clock::now();
  pid_t pid = -1;
  const int spawn_rc = ::posix_spawnp(&pid, arg_pointers[0], &actions, &attributes,
                                      arg_pointers.data(), env_pointers.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  if (spawn_rc != 0) {
    std::string hint = spawn_rc == ENOENT ? " (is it installed and on PATH?)" : "";
    if (!options.working_dir.empty()) hint += " (working directory " + options.working_dir + ")";
    throw IoError("cannot run '" + argv.front() + "': " + std::strerror(spawn_rc) + hint);
  }
  in.close_read();
  out.close_write();
  err.close_write();

  std::size_t stdin_written = 0;
  if (options.stdin_data.empty()) {
    in.close_write();
  } else {
    set_nonblocking(in.write_end());
  }
  set_nonblocking(out.read_end());
  set_nonblocking(err.read_end());

  bool out_open = true, err_open = true;
  bool exited = false;
  int status = 0;
  bool term_sent = false, kill_sent = false;
  Clock::time_point term_time;
  std::optional<Clock::time_point> exited_at;

  auto read_into = [&](int fd, std::string& sink, bool& open) {
    char buffer[65536];
    for (;;) {
      const ssize_t n = ::read(fd, buffer, sizeof buffer);
      if (n > 0) {
        const std::size_t room =
            options.max_output_bytes > sink.size() ? options.max_output_bytes - sink.size() : 0;
        const std::size_t take = std::min(room, static_cast<std::size_t>(n));
        sink.append(buffer, take);
        if (take < static_cast<std::size_t>(n)) result.truncated = true;
        continue;
      }
      if (n == 0) open = false;
      if (n < 0 && errno == EINTR) continue;
      return;  // EAGAIN, EOF or an error: nothing more to read now
    }
  };

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
    if (!exited && options.timeout && !term_sent && now - start >= *options.timeout) {
      ::kill(-pid, SIGTERM);
      ::kill(pid, SIGTERM);
      term_sent = true;
      term_time = now;
      result.timed_out = true;
    }
    if (!exited && term_sent && !kill_sent && now - term_time >= options.kill_grace) {
      ::kill(-pid, SIGKILL);
      ::kill(pid, SIGKILL);
      kill_sent = true;
    }

    std::vector<pollfd> fds;
    if (out_open) fds.push_back({out.read_end(), POLLIN, 0});
    if (err_open) fds.push_back({err.read_end(), POLLIN, 0});
    const bool want_write = in.write_end() >= 0;
    if (want_write) fds.push_back({in.write_end(), POLLOUT, 0});
    // Short waits while the child runs so that its exit and the timeout are seen promptly.
    const int wait_ms = exited ? 20 : 50;
    if (!fds.empty()) {
      const int rc = ::poll(fds.data(), fds.size(), wait_ms);
      if (rc < 0 && errno != EINTR) throw_errno("poll on a child's pipes failed", errno);
    } else {
      ::usleep(static_cast<useconds_t>(wait_ms) * 1000);
    }
    if (out_open) read_into(out.read_end(), result.out, out_open);
    if (err_open) read_into(err.read_end(), result.err, err_open);
    if (want_write) {
      const SigpipeGuard guard;
      const std::string& data = options.stdin_data;
      while (stdin_written < data.size()) {
        const ssize_t n =
            ::write(in.write_end(), data.data() + stdin_written, data.size() - stdin_written);
        if (n > 0) {
          stdin_written += static_cast<std::size_t>(n);
          continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) break;
        stdin_written = data.size();  // EPIPE: the child does not read its input
      }
      if (stdin_written >= data.size()) in.close_write();
    }
  }

  if (!exited) {
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
  result.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  if (WIFEXITED(status)) {
    result.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    result.signal = WTERMSIG(status);
  }
  return result;
}

std::string self_program(const std::string& fallback) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? fallback : self.string();
}

}  // namespace hpctrial::core
