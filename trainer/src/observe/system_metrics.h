// A rank's system metrics: its process's CPU use, resident memory and I/O rates, and its GPU's
// utilisation and memory through NVML where the driver's library is present. Read from /proc and
// NVML, never from LibTorch.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace hpctrial::trainer::detail {

class Nvml;

class SystemMonitor {
 public:
  // `cuda_device`: the CUDA device index the rank trains on (-1: none), mapped through
  // CUDA_VISIBLE_DEVICES to the index NVML knows it by.
  explicit SystemMonitor(int cuda_device = -1);
  ~SystemMonitor();
  SystemMonitor(const SystemMonitor&) = delete;
  SystemMonitor& operator=(const SystemMonitor&) = delete;

  // Rates over the time since the previous sample (the first: since construction):
  //   cpu_percent       user + system time of the process, percent of one core
  //   rss_mb            resident memory
  //   read_mbps, write_mbps            bytes the process read and wrote (files, pipes, sockets)
  //   disk_read_mbps, disk_write_mbps  of those, what reached or came from storage
  //   gpu_util_percent, gpu_memory_used_mb, gpu_memory_total_mb   with NVML and a GPU
  // A figure the system does not provide is left out.
  std::map<std::string, double> sample();

 private:
  struct Counters {
    std::chrono::steady_clock::time_point at;
    double cpu_seconds = -1;
    std::map<std::string, double> io;  // /proc/self/io's fields
  };
  static Counters read_counters();

  Counters last_;
  std::unique_ptr<Nvml> nvml_;
};

// The NVML index of CUDA device `cuda_device` given CUDA_VISIBLE_DEVICES (`visible`, may be
// empty): its entry when the list is of indices, else the CUDA index itself; -1 for a UUID list.
int nvml_index(int cuda_device, const std::string& visible);

}  // namespace hpctrial::trainer::detail
