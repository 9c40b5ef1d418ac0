// Where environment variables come from.
//
// Code that reads the environment takes an EnvSource, so tests can hand it a MapEnv instead
// of mutating the process environment. ProcessEnv reads getenv(); it is thread-safe as long
// as nobody calls setenv() concurrently. MapEnv is a plain value.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace hpctrial::core {

class EnvSource {
 public:
  virtual ~EnvSource() = default;
  // The value of `name`, or nullopt when it is not set (an empty value is set).
  virtual std::optional<std::string> get(const std::string& name) const = 0;
};

class ProcessEnv final : public EnvSource {
 public:
  std::optional<std::string> get(const std::string& name) const override;
};

class MapEnv final : public EnvSource {
 public:
  MapEnv() = default;
  explicit MapEnv(std::map<std::string, std::string> values) : values_(std::move(values)) {}
  std::optional<std::string> get(const std::string& name) const override;
  void set(const std::string& name, std::string value) { values_[name] = std::move(value); }

 private:
  std::map<std::string, std::string> values_;
};

// True when `name` is a valid POSIX environment variable name: [A-Za-z_][A-Za-z0-9_]*.
bool is_valid_env_name(const std::string& name);

// This node's name, as ranks record it in their heartbeats: the name Slurm knows it by
// ($SLURMD_NODENAME, what --exclude takes) in a Slurm job, else gethostname's.
std::string host_name();
// A TCP port no socket of this host is bound to now (the kernel's choice of an ephemeral one),
// for a rendezvous that binds it soon after, as torchrun picks MASTER_PORT; 0 where none could
// be had.
int free_tcp_port();

// The CPUs this process may run on (sched_getaffinity), as a list: "0-3,8,10-11".
std::string cpu_affinity();
// `cpus` (any order, repeats allowed) as such a list; "" for none.
std::string cpu_list_text(std::vector<int> cpus);

// `value` with every ${env:NAME} replaced by NAME from `env` (other text, $ included, taken as
// it is). ConfigError("<key>: ${env:NAME} is not set ...") when a NAME is missing. The config
// reader has already checked the references' syntax.
std::string expand_env_references(const std::string& value, const EnvSource& env, const std::string& key);

}  // namespace hpctrial::core
