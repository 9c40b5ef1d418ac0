// Starts programs by argv - never through a shell: the one way hpctrial starts a process
// (scheduler commands, mpirun, a rank under its parent).
//
// spawn_process() starts argv[0] (looked up on PATH) and returns at once: the caller owns the
// child and the ends of its pipes.
//
// run_process() starts argv[0] (looked up on PATH), feeds it `stdin_data`, collects stdout and
// stderr, and waits for it. With a timeout, the child's whole process group gets SIGTERM when
// the time is up and SIGKILL `kill_grace` later. The result says how it ended: an exit code,
// a signal, or a time-out.
//
// Throws IoError when the program cannot be started at all (not found, not executable): the
// message names the program and suggests what to check. A program that starts and then fails
// is not an exception: inspect RunResult. Thread-safe (posix_spawn, no shared state).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <sys/types.h>

#include "hpctrial/core/files.h"

namespace hpctrial::core {

struct SpawnOptions {
  // Variables to set (or override) in the child's environment, and variables to remove.
  std::vector<std::pair<std::string, std::string>> env_set;
  std::vector<std::string> env_unset;
  // Empty: the caller's working directory.
  std::string working_dir;
  // Its stdout and stderr on pipes (its stdin then from a pipe with pipe_stdin, else /dev/null);
  // false: all three are the caller's.
  bool capture_output = true;
  bool pipe_stdin = false;
  // In a process group of its own (a Ctrl-C on the terminal does not reach it; killpg reaches
  // it and its children); false: in the caller's.
  bool own_process_group = true;
  // SIGKILL when the caller dies (PR_SET_PDEATHSIG), so that it never outlives its supervisor.
  bool die_with_parent = false;
  // Signals the child starts with blocked, pending until it unblocks them: a rank holds the stop
  // signals that come before its handlers exist (rank::install_stop_handlers unblocks them).
  std::vector<int> blocked_signals;
};

// A started child. Signals it starts with: every disposition default, none blocked but
// SpawnOptions::blocked_signals.
struct Child {
  pid_t pid = -1;
  UniqueFd in;   // with pipe_stdin
  UniqueFd out;  // with capture_output: non-blocking, close-on-exec
  UniqueFd err;
};

// IoError naming the program (and the working directory) when it cannot be started: not found,
// not executable, a working directory that does not exist.
Child spawn_process(const std::vector<std::string>& argv, const SpawnOptions& options = {});

struct RunOptions {
  // No timeout when unset.
  std::optional<std::chrono::milliseconds> timeout;
  // Time between SIGTERM and SIGKILL once the timeout is reached.
  std::chrono::milliseconds kill_grace{2000};
  std::string stdin_data;
  // Variables to set (or override) in the child's environment, and variables to remove.
  std::vector<std::pair<std::string, std::string>> env_set;
  std::vector<std::string> env_unset;
  // Empty: the caller's working directory.
  std::string working_dir;
  // Output beyond this many bytes per stream is dropped (the child keeps running);
  // RunResult::truncated says so.
  std::size_t max_output_bytes = 64u << 20;
};

struct RunResult {
  std::vector<std::string> argv;
  int exit_code = -1;  // valid when signal == 0 and !timed_out
  int signal = 0;      // the signal that ended the child, 0 if it exited
  bool timed_out = false;
  bool truncated = false;
  std::string out;
  std::string err;
  std::chrono::milliseconds elapsed{0};

  bool ok() const { return !timed_out && signal == 0 && exit_code == 0; }
  // "'sbatch --parsable job.sh' exited with code 1: sbatch: error: invalid partition"
  std::string describe() const;
};

RunResult run_process(const std::vector<std::string>& argv, const RunOptions& options = {});

// Runs a command (a scheduler's: sbatch, scontrol, qstat...) by argv; tests hand in a fake.
using CommandRunner = std::function<RunResult(const std::vector<std::string>& argv, const RunOptions& options)>;
// run_process, with a one-minute timeout where the options give none.
CommandRunner real_command_runner();

// Whether `program` is an executable file in one of PATH's directories.
bool on_path(const std::string& program);

// The absolute path of the running program (/proc/self/exe), or `fallback` where it cannot be
// read.
std::string self_program(const std::string& fallback = "hpctrial");

}  // namespace hpctrial::core
