// The exception hierarchy of hpctrial and the ENFORCE invariant macros.
//
// Every exception hpctrial throws derives from hpctrial::Error. Which one to use
// is written down in docs/errors.md:
//   ConfigError     - the user's experiment config or command line is wrong (exit code 2)
//   IoError         - a file, directory or process could not be used (carries errno text)
//   CommError       - MPI / NCCL communication failed or timed out
//   SchedulerError  - Slurm / PBS refused or failed a request
//   CheckpointError - a checkpoint is missing, corrupt or does not match the trial
//   NotSupported    - a valid request this build or backend cannot do
//   DivergenceError - the ranks' replicas of the model or optimizer differ (trial code or a node)
//   InternalError   - an invariant of ours broke (ENFORCE): a bug, never user input
//
// Thread safety: exceptions are plain values. Nothing here throws from a destructor.
#pragma once

#include <stdexcept>
#include <string>

namespace hpctrial {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

class ConfigError : public Error {
 public:
  using Error::Error;
};

class IoError : public Error {
 public:
  using Error::Error;
};

class CommError : public Error {
 public:
  using Error::Error;
};

class SchedulerError : public Error {
 public:
  using Error::Error;
};

class CheckpointError : public Error {
 public:
  using Error::Error;
};

class NotSupported : public Error {
 public:
  using Error::Error;
};

class DivergenceError : public Error {
 public:
  using Error::Error;
};

class InternalError : public Error {
 public:
  using Error::Error;
};

// A trial's own verdict that its hyperparameters cannot train (Determined's det.InvalidHP):
// thrown from the trial's constructor or any of its methods, on any rank, with the reason. The
// trial ends at once with core::kExitInvalidHP (65) and is not restarted; an adaptive search replaces
// it with a new trial that does not count toward max_trials.
class InvalidHP : public Error {
 public:
  using Error::Error;
};

namespace core {

// Throws IoError("<what>: <strerror(err)>"). The one place where errno becomes an error.
[[noreturn]] void throw_errno(const std::string& what, int err);

// Builds the message of a failed invariant and throws InternalError.
[[noreturn]] void enforce_failed(const char* file, int line, const char* condition,
                                 const std::string& detail);

}  // namespace core
}  // namespace hpctrial


// HPCTRIAL_ENFORCE(cond, "context") throws InternalError naming file:line and the condition.
#define HPCTRIAL_ENFORCE(cond, detail)                                             \
  do {                                                                             \
    if (!(cond)) ::hpctrial::core::enforce_failed(__FILE__, __LINE__, #cond, (detail)); \
  } while (false)

// Comparison invariants record both values: HPCTRIAL_ENFORCE_EQ(a, b) fails with
// "a == b (3 vs 4)".
#define HPCTRIAL_ENFORCE_OP(a, op, b)                                                   \
  do {                                                                                  \
    const auto& hpctrial_enforce_a_ = (a);                                              \
    const auto& hpctrial_enforce_b_ = (b);                                              \
    if (!(hpctrial_enforce_a_ op hpctrial_enforce_b_)) {                                \
      ::hpctrial::core::enforce_failed(                                                 \
          __FILE__, __LINE__, #a " " #op " " #b,                                        \
          "(" + std::to_string(hpctrial_enforce_a_) + " vs " +                          \
              std::to_string(hpctrial_enforce_b_) + ")");                               \
    }                                                                                   \
  } while (false)
#define HPCTRIAL_ENFORCE_EQ(a, b) HPCTRIAL_ENFORCE_OP(a, ==, b)
#define HPCTRIAL_ENFORCE_NE(a, b) HPCTRIAL_ENFORCE_OP(a, !=, b)
#define HPCTRIAL_ENFORCE_LT(a, b) HPCTRIAL_ENFORCE_OP(a, <, b)
#define HPCTRIAL_ENFORCE_LE(a, b) HPCTRIAL_ENFORCE_OP(a, <=, b)
#define HPCTRIAL_ENFORCE_GT(a, b) HPCTRIAL_ENFORCE_OP(a, >, b)
#define HPCTRIAL_ENFORCE_GE(a, b) HPCTRIAL_ENFORCE_OP(a, >=, b)
