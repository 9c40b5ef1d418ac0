// A program started in the background for a test, to be signalled and waited for: its stdout
// and stderr go to one file; the destructor SIGKILLs it if the test did not wait for it.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "read_file.h"

namespace hpctrial::testing_support {

class BackgroundProcess {
 public:
  BackgroundProcess(const std::vector<std::string>& argv, const std::vector<std::pair<std::string, std::string>>& env,
                    std::string output_path)
      : output_path_(std::move(output_path)) {
    started_ = std::chrono::steady_clock::now();
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(output_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
      for (const auto& [name, value] : env) ::setenv(name.c_str(), value.c_str(), 1);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      ::_exit(127);
    }
  }
  ~BackgroundProcess() {
    if (pid_ > 0 && !status_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  BackgroundProcess(const BackgroundProcess&) = delete;
  BackgroundProcess& operator=(const BackgroundProcess&) = delete;

  pid_t pid() const { return pid_; }
  void signal(int sig) const { ::kill(pid_, sig); }

  // The wait status once it ended within `timeout`; nullopt otherwise (it keeps running).
  std::optional<int> wait(std::chrono::milliseconds timeout) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (!status_) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        status_ = status;
        ended_ = std::chrono::steady_clock::now();
        ended_wall_ = std::chrono::system_clock::now();
        break;
      }
      if (std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return status_;
  }
  // Its exit code once waited for (-1: killed by a signal, or not ended).
  int exit_code() const { return status_ && WIFEXITED(*status_) ? WEXITSTATUS(*status_) : -1; }
  double seconds() const { return std::chrono::duration<double>(ended_ - started_).count(); }
  // When it ended, in milliseconds since the epoch (to compare with times the process printed).
  long long ended_unix_ms() const {
    return std::chrono::duration_cast<std::chrono::milliseconds>(ended_wall_.time_since_epoch()).count();
  }
  std::string output() const { return read_file(output_path_); }

 private:
  std::string output_path_;
  pid_t pid_ = -1;
  std::optional<int> status_;
  std::chrono::steady_clock::time_point started_, ended_;
  std::chrono::system_clock::time_point ended_wall_;
};

// The bytes of /proc/<pid>/<file>; empty when the process has gone meanwhile (a read of a
// process that exits fails with ESRCH, which an ifstream would throw from).
inline std::string read_proc_file(const std::filesystem::path& path) {
  std::string out;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  char buffer[4096];
  for (ssize_t n; (n = ::read(fd, buffer, sizeof buffer)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      out.clear();
      break;
    }
    out.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

// Processes whose command line contains `needle` (other than the caller) and, when `env_entry`
// is given, whose environment holds that NAME=VALUE entry: the processes of one test's trial,
// whatever else runs on the machine. A program given by its path also matches the copy an
// experiment froze of it (<experiment>/code/<sha256>/<name>), which its ranks run.
inline std::vector<pid_t> processes_running(const std::string& needle, const std::string& env_entry = "") {
  std::vector<pid_t> found;
  const std::string name_of =
      needle.empty() || needle.front() != '/' ? "" : std::filesystem::path(needle).filename().string();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string cmdline = read_proc_file(entry.path() / "cmdline");
    const pid_t pid = static_cast<pid_t>(std::stol(name));
    // A zombie has an empty command line and does not count.
    const bool frozen_copy = !name_of.empty() && cmdline.find("/code/") != std::string::npos &&
                             cmdline.find("/" + name_of) != std::string::npos;
    if (pid == ::getpid() || cmdline.empty() || (cmdline.find(needle) == std::string::npos && !frozen_copy)) continue;
    if (!env_entry.empty()) {
      const std::string environ_text = read_proc_file(entry.path() / "environ");
      bool has = false;
      for (std::size_t at = 0; !has && at < environ_text.size();) {
        const std::size_t end = environ_text.find('\0', at);
        has = environ_text.compare(at, (end == std::string::npos ? environ_text.size() : end) - at, env_entry) == 0;
        at = end == std::string::npos ? environ_text.size() : end + 1;
      }
      if (!has) continue;
    }
    found.push_back(pid);
  }
  return found;
}

}  // namespace hpctrial::testing_support
