#include "observe/system_metrics.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <tuple>
#include <fstream>
#include <sstream>
#include <vector>

namespace hpctrial::trainer::detail {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// The value of "Key:" in a /proc file of "Key: value" lines, in the file's unit; -1 if absent.
double proc_field(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.compare(0, key.size(), key) == 0 && line.size() > key.size() && line[key.size()] == ':') {
      return std::strtod(line.c_str() + key.size() + 1, nullptr);
    }
  }
  return -1;
}

}  // namespace

// NVML, opened from the driver's libnvidia-ml.so.1 when it is there: no link-time dependency, so
// the same build runs on machines without a GPU driver.
class Nvml {
 public:
  static std::unique_ptr<Nvml> open(int index) {
    void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return nullptr;
    auto nvml = std::unique_ptr<Nvml>(new Nvml(lib));
    if (!nvml->start(index)) return nullptr;
    return nvml;
  }
  ~Nvml() {
    if (shutdown_ != nullptr && device_ != nullptr) shutdown_();
    ::dlclose(lib_);
  }
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  void sample(std::map<std::string, double>& out) {
    Utilization u{};
    if (utilization_(device_, &u) == 0) out["gpu_util_percent"] = u.gpu;
    Memory m{};
    if (memory_(device_, &m) == 0) {
      out["gpu_memory_used_mb"] = static_cast<double>(m.used) / kMiB;
      out["gpu_memory_total_mb"] = static_cast<double>(m.total) / kMiB;
    }
  }

 private:
  struct Utilization {
    unsigned int gpu;
    unsigned int memory;
  };
  struct Memory {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
  };
  using Device = void*;

  explicit Nvml(void* lib) : lib_(lib) {}

  template <typename F>
  F symbol(const char* name) {
    return reinterpret_cast<F>(::dlsym(lib_, name));
  }

  bool start(int index) {
    const auto init = symbol<int (*)()>("nvmlInit_v2");
    const auto handle = symbol<int (*)(unsigned int, Device*)>("nvmlDeviceGetHandleByIndex_v2");
    utilization_ = symbol<int (*)(Device, Utilization*)>("nvmlDeviceGetUtilizationRates");
    memory_ = symbol<int (*)(Device, Memory*)>("nvmlDeviceGetMemoryInfo");
    shutdown_ = symbol<int (*)()>("nvmlShutdown");
    if (init == nullptr || handle == nullptr || utilization_ == nullptr || memory_ == nullptr || init() != 0) {
      return false;
    }
    if (handle(static_cast<unsigned int>(index), &device_) != 0) {
      shutdown_();
      device_ = nullptr;
      return false;
    }
    return true;
  }

  void* lib_;
  Device device_ = nullptr;
  int (*utilization_)(Device, Utilization*) = nullptr;
  int (*memory_)(Device, Memory*) = nullptr;
  int (*shutdown_)() = nullptr;
};

std::pair<double, double> network_bytes(const std::string& proc_net_dev) {
  double received = 0, sent = 0;
  bool any = false;
  std::istringstream lines(proc_net_dev);
  for (std::string line; std::getline(lines, line);) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;  // the two header lines
    std::string name = line.substr(0, colon);
    name.erase(0, name.find_first_not_of(' '));
    if (name == "lo") continue;
    std::istringstream fields(line.substr(colon + 1));
    std::vector<double> values;
    for (double v; fields >> v;) values.push_back(v);
    if (values.size() < 9) continue;
    received += values[0];  // receive bytes
    sent += values[8];      // transmit bytes
    any = true;
  }
  return any ? std::pair{received, sent} : std::pair{-1.0, -1.0};
}

double disk_operations(const std::string& proc_diskstats, const std::vector<std::string>& disks) {
  double total = 0;
  bool any = false;
  std::istringstream lines(proc_diskstats);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream fields(line);
    std::string major, minor, name;
    double reads = 0, reads_merged = 0, sectors_read = 0, ms_reading = 0, writes = 0;
    if (!(fields >> major >> minor >> name >> reads >> reads_merged >> sectors_read >> ms_reading >> writes)) continue;
    if (std::find(disks.begin(), disks.end(), name) == disks.end()) continue;
    total += reads + writes;
    any = true;
  }
  return any ? total : -1;
}

std::vector<std::string> physical_disks() {
  std::vector<std::string> disks;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/sys/block", ec)) {
    const std::string name = entry.path().filename().string();
    bool virtual_device = false;
    for (const char* prefix : {"loop", "ram", "zram", "dm-", "sr", "md"}) {
      if (name.rfind(prefix, 0) == 0) virtual_device = true;
    }
    if (!virtual_device) disks.push_back(name);
  }
  return disks;
}

int nvml_index(int cuda_device, const std::string& visible) {
  if (cuda_device < 0) return -1;
  if (visible.empty()) return cuda_device;
  std::vector<std::string> entries;
  std::stringstream list(visible);
  for (std::string entry; std::getline(list, entry, ',');) entries.push_back(entry);
  if (cuda_device >= static_cast<int>(entries.size())) return -1;
  const std::string& entry = entries[static_cast<std::size_t>(cuda_device)];
  if (entry.empty() || entry.find_first_not_of("0123456789") != std::string::npos) return -1;  // a UUID
  return std::atoi(entry.c_str());
}

namespace {
std::string file_text(const char* path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
}  // namespace

SystemMonitor::SystemMonitor(int cuda_device) : last_(read_counters()) {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const int index = nvml_index(cuda_device, visible != nullptr ? visible : "");
  if (index >= 0) nvml_ = Nvml::open(index);
}

SystemMonitor::~SystemMonitor() = default;

SystemMonitor::Counters SystemMonitor::read_counters() {
  Counters c;
  c.at = std::chrono::steady_clock::now();
  // /proc/self/stat: utime and stime are fields 14 and 15, after the name in parentheses.
  std::ifstream stat("/proc/self/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto close = text.rfind(')');
  if (close != std::string::npos) {
    std::istringstream fields(text.substr(close + 2));
    std::string field;
    double utime = -1, stime = -1;
    for (int i = 3; fields >> field && i <= 15; ++i) {
      if (i == 14) utime = std::strtod(field.c_str(), nullptr);
      if (i == 15) stime = std::strtod(field.c_str(), nullptr);
    }
    const long ticks = ::sysconf(_SC_CLK_TCK);
    if (utime >= 0 && stime >= 0 && ticks > 0) c.cpu_seconds = (utime + stime) / static_cast<double>(ticks);
  }
  for (const char* key : {"rchar", "wchar", "read_bytes", "write_bytes"}) {
    const double value = proc_field("/proc/self/io", key);
    if (value >= 0) c.io[key] = value;
  }
  std::tie(c.net_received, c.net_sent) = network_bytes(file_text("/proc/net/dev"));
  static const std::vector<std::string> disks = physical_disks();
  c.disk_operations = disk_operations(file_text("/proc/diskstats"), disks);
  return c;
}

std::map<std::string, double> SystemMonitor::sample() {
  const Counters now = read_counters();
  const double seconds = std::chrono::duration<double>(now.at - last_.at).count();
  std::map<std::string, double> out;
  if (seconds > 0) {
    if (now.cpu_seconds >= 0 && last_.cpu_seconds >= 0) {
      out["cpu_percent"] = 100.0 * (now.cpu_seconds - last_.cpu_seconds) / seconds;
    }
    for (const auto& [key, name] : {std::pair{"rchar", "read_mbps"}, std::pair{"wchar", "write_mbps"},
                                    std::pair{"read_bytes", "disk_read_mbps"},
                                    std::pair{"write_bytes", "disk_write_mbps"}}) {
      const auto before = last_.io.find(key);
      const auto after = now.io.find(key);
      if (before != last_.io.end() && after != now.io.end()) {
        out[name] = (after->second - before->second) / kMiB / seconds;
      }
    }
    const auto rate = [&](const char* name, double before, double after, double unit) {
      if (before >= 0 && after >= before) out[name] = (after - before) / unit / seconds;
    };
    rate("net_sent_mbps", last_.net_sent, now.net_sent, kMiB);
    rate("net_received_mbps", last_.net_received, now.net_received, kMiB);
    rate("disk_iops", last_.disk_operations, now.disk_operations, 1);
  }
  const double available_kib = proc_field("/proc/meminfo", "MemAvailable");
  if (available_kib >= 0) out["memory_available_mb"] = available_kib / 1024.0;
  const double rss_kib = proc_field("/proc/self/status", "VmRSS");
  if (rss_kib >= 0) out["rss_mb"] = rss_kib / 1024.0;
  if (nvml_) nvml_->sample(out);
  last_ = now;
  return out;
}

}  // namespace hpctrial::trainer::detail
