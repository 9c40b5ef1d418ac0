#include "hpctrial/core/env.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "hpctrial/core/error.h"

namespace hpctrial::core {

std::optional<std::string> ProcessEnv::get(const std::string& name) const {
  const char* value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

std::optional<std::string> MapEnv::get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

bool is_valid_env_name(const std::string& name) {
  if (name.empty()) return false;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
    const bool digit = c >= '0' && c <= '9';
    if (!(alpha || (digit && i > 0))) return false;
  }
  return true;
}

std::string expand_env_references(const std::string& value, const EnvSource& env, const std::string& key) {
  std::string out;
  std::size_t at = 0;
  while (true) {
    const std::size_t start = value.find("${env:", at);
    const std::size_t end = start == std::string::npos ? std::string::npos : value.find('}', start);
    if (end == std::string::npos) {
      out += value.substr(at);
      return out;
    }
    out += value.substr(at, start - at);
    const std::string name = value.substr(start + 6, end - start - 6);
    const auto found = env.get(name);
    if (!found) {
      throw ConfigError(key + ": ${env:" + name + "} is not set in this environment; export " + name +
                        " before running, or change the value");
    }
    out += *found;
    at = end + 1;
  }
}

std::string host_name() {
  const char* node = std::getenv("SLURMD_NODENAME");
  if (node != nullptr && *node != '\0') return node;
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return host;
}

int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = 0;
  socklen_t size = sizeof address;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size) == 0) {
    port = ntohs(address.sin_port);
  }
  ::close(fd);
  return port;
}

std::string cpu_affinity() {
  // The process's (its main thread's, as /proc/self/status gives it), on a node of any size.
  for (int size = 1024;; size *= 2) {
    cpu_set_t* set = CPU_ALLOC(size);
    if (set == nullptr) return "?";
    const std::size_t bytes = CPU_ALLOC_SIZE(size);
    CPU_ZERO_S(bytes, set);
    if (::sched_getaffinity(::getpid(), bytes, set) != 0) {
      CPU_FREE(set);
      if (errno == EINVAL && size < (1 << 20)) continue;  // more CPUs than the set holds
      return "?";
    }
    std::vector<int> cpus;
    for (int cpu = 0; cpu < size; ++cpu) {
      if (CPU_ISSET_S(cpu, bytes, set)) cpus.push_back(cpu);
    }
    CPU_FREE(set);
    return cpu_list_text(std::move(cpus));
  }
}

std::string cpu_list_text(std::vector<int> cpus) {
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  std::string out;
  for (std::size_t i = 0; i < cpus.size();) {
    std::size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    out += (out.empty() ? "" : ",") + std::to_string(cpus[i]) + (j > i ? "-" + std::to_string(cpus[j]) : "");
    i = j + 1;
  }
  return out;
}

}  // namespace hpctrial::core
