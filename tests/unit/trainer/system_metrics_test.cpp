#include <gtest/gtest.h>

#include <torch/torch.h>

#include <time.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "observe/system_metrics.h"
#include "../../support/temp_dir.h"
#include "hpctrial/core/error.h"
#include "hpctrial/tensorboard/event_writer.h"
#include "hpctrial/trainer/summary_writer.h"

namespace hpctrial::trainer {
namespace system_metrics_test {  // named: the target compiles its sources together (UNITY_BUILD)

// The process's CPU time, and the wall clock, in seconds.
double cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}
double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

TEST(SystemMonitor, MeasuresTheProcesssCpuMemoryAndIo) {
  const double cpu_before = cpu_seconds(), wall_before = wall_seconds();
  detail::SystemMonitor monitor;
  // 300 ms of CPU time on this thread (however long a busy machine takes to give them), and a
  // file written.
  volatile double sink = 0;
  while (cpu_seconds() - cpu_before < 0.3) sink = sink + 1.0;
  testing_support::TempDir dir;
  dir.write("data", std::string(4 << 20, 'x'));
  const auto m = monitor.sample();
  // The share of a core this process had, over a window that holds the sample's.
  const double busy = 100.0 * (cpu_seconds() - cpu_before) / (wall_seconds() - wall_before);
  ASSERT_TRUE(m.count("cpu_percent"));
  EXPECT_GT(m.at("cpu_percent"), 0.5 * busy) << "a busy thread, which had " << busy << " % of a core";
  EXPECT_LT(m.at("cpu_percent"), 100.0 * 64);
  ASSERT_TRUE(m.count("rss_mb"));
  EXPECT_GT(m.at("rss_mb"), 1.0);
  ASSERT_TRUE(m.count("write_mbps"));
  EXPECT_GT(m.at("write_mbps"), 0.0) << "4 MiB written";
  EXPECT_EQ(m.count("gpu_util_percent"), 0u) << "no GPU asked about";
  // The next sample covers only the time since this one: idle, little CPU.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_LT(monitor.sample().at("cpu_percent"), 50.0);
}

// The host's figures: network bytes from /proc/net/dev without loopback, disk operations from
// /proc/diskstats of the disks alone, and on this machine all four present.
TEST(SystemMonitor, MeasuresTheHostsNetworkDisksAndAvailableMemory) {
  const std::string net =
      "Inter-|   Receive                                                |  Transmit\n"
      " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n"
      "    lo: 5000 10 0 0 0 0 0 0 5000 10 0 0 0 0 0 0\n"
      "  eth0: 1000 4 0 0 0 0 0 0 300 2 0 0 0 0 0 0\n"
      "  ib0: 24 1 0 0 0 0 0 0 76 1 0 0 0 0 0 0\n";
  EXPECT_EQ(detail::network_bytes(net), (std::pair<double, double>{1024, 376}));
  EXPECT_EQ(detail::network_bytes("Inter-|\n    lo: 1 1 0 0 0 0 0 0 1 1 0 0 0 0 0 0\n"),
            (std::pair<double, double>{-1, -1}));
  const std::string disks = "   8       0 sda 100 0 800 10 50 0 400 5 0 20 15 0 0 0 0\n"
                            "   8       1 sda1 90 0 720 9 45 0 360 4 0 18 13 0 0 0 0\n"
                            "   7       0 loop0 7 0 56 1 0 0 0 0 0 1 1 0 0 0 0\n"
                            " 259       0 nvme0n1 10 0 80 1 5 0 40 1 0 2 2 0 0 0 0\n";
  EXPECT_EQ(detail::disk_operations(disks, {"sda", "nvme0n1"}), 165.0);
  EXPECT_EQ(detail::disk_operations(disks, {"vda"}), -1.0);
  for (const auto& disk : detail::physical_disks()) EXPECT_NE(disk.rfind("loop", 0), 0u) << disk;

  detail::SystemMonitor monitor;
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto m = monitor.sample();
  ASSERT_TRUE(m.count("memory_available_mb"));
  EXPECT_GT(m.at("memory_available_mb"), 1.0);
  if (m.count("net_sent_mbps")) {
    EXPECT_GE(m.at("net_sent_mbps"), 0.0);
  }
  if (m.count("disk_iops")) {
    EXPECT_GE(m.at("disk_iops"), 0.0);
  }
}

TEST(SystemMonitor, MapsCudaDevicesToNvmlIndices) {
  EXPECT_EQ(detail::nvml_index(-1, ""), -1);
  EXPECT_EQ(detail::nvml_index(1, ""), 1);
  EXPECT_EQ(detail::nvml_index(1, "3,2"), 2);
  EXPECT_EQ(detail::nvml_index(0, "GPU-8a1b2c"), -1) << "a UUID: not an index";
  EXPECT_EQ(detail::nvml_index(2, "0,1"), -1) << "not visible";
}

TEST(SummaryWriter, WritesNothingWithoutADirectoryAndRefusesBadImages) {
  testing_support::TempDir dir;
  SummaryWriter off("", [] { return 0; });
  EXPECT_FALSE(off.enabled());
  off.add_scalar("x", 1);
  off.add_image("x", torch::zeros({2, 2}));
  EXPECT_EQ(off.events(), nullptr);

  const std::string log_dir = (dir.path() / "tb").string();
  SummaryWriter writer(log_dir, [] { return 5; });
  EXPECT_THROW(writer.add_image("bad", torch::zeros({2, 2, 2})), ConfigError) << "2 channels";
  EXPECT_THROW(writer.add_image("bad", torch::zeros({2, 2})), ConfigError) << "CHW needs 3 dimensions";
  EXPECT_THROW(writer.add_image("bad", torch::zeros({2, 2}, torch::kInt32), std::nullopt, "HW"), ConfigError);
  EXPECT_THROW(writer.add_image("bad", torch::zeros({3, 2, 2}), std::nullopt, "NCHW"), ConfigError);
  EXPECT_THROW(writer.add_histogram("bad", torch::zeros({3}), std::nullopt, 0), ConfigError);
  writer.add_image("grey", torch::zeros({4, 4}, torch::kUInt8), std::nullopt, "HW");
  writer.flush();
  ASSERT_NE(writer.events(), nullptr);
  EXPECT_EQ(std::filesystem::path(writer.events()->path()).parent_path(), log_dir);
}

}  // namespace system_metrics_test
}  // namespace hpctrial::trainer
