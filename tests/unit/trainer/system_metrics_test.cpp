#include <gtest/gtest.h>

#include <torch/torch.h>

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

TEST(SystemMonitor, MeasuresTheProcesssCpuMemoryAndIo) {
  detail::SystemMonitor monitor;
  // Half a second of work on this thread, and a file written.
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  volatile double sink = 0;
  while (std::chrono::steady_clock::now() < until) sink = sink + 1.0;
  testing_support::TempDir dir;
  dir.write("data", std::string(4 << 20, 'x'));
  const auto m = monitor.sample();
  ASSERT_TRUE(m.count("cpu_percent"));
  EXPECT_GT(m.at("cpu_percent"), 30.0) << "a busy thread";
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
