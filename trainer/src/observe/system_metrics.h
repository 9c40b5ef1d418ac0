// A rank's system metrics: its process's CPU use, resident memory and I/O rates, and its GPU's
// utilisation and memory through NVML where the driver's library is present. Read from /proc and
// NVML, never from LibTorch.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

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
  // and the host's, shared by every process on it (Determined's system metrics):
  //   net_sent_mbps, net_received_mbps   every network interface but loopback
  //   disk_iops          reads and writes completed by the host's disks a second
  //   memory_available_mb                what the kernel says new work can have (MemAvailable)
  // A figure the system does not provide is left out.
  std::map<std::string, double> sample();

 private:
  struct Counters {
    std::chrono::steady_clock::time_point at;
    double cpu_seconds = -1;
    std::map<std::string, double> io;  // /proc/self/io's fields
    double net_sent = -1, net_received = -1;  // bytes, the host's
    double disk_operations = -1;              // completed, the host's
  };
  static Counters read_counters();

  Counters last_;
  std::unique_ptr<Nvml> nvml_;
};

// The NVML index of CUDA device `cuda_device` given CUDA_VISIBLE_DEVICES (`visible`, may be
// empty): its entry when the list is of indices, else the CUDA index itself; -1 for a UUID list.
int nvml_index(int cuda_device, const std::string& visible);

// The host's bytes received and sent over every interface but loopback, from the text of
// /proc/net/dev; -1 each when it names none.
std::pair<double, double> network_bytes(const std::string& proc_net_dev);
// The reads and writes the disks named in `disks` completed, from the text of /proc/diskstats;
// -1 when it names none of them.
double disk_operations(const std::string& proc_diskstats, const std::vector<std::string>& disks);
// The host's disks: the entries of /sys/block but loop, RAM, device-mapper and optical devices
// (whose operations reach a disk listed already, or none).
std::vector<std::string> physical_disks();

}  // namespace hpctrial::trainer::detail
