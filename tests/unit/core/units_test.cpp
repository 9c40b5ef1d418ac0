#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "hpctrial/core/experiment_config.h"

namespace hpctrial::core {
namespace {

TEST(Duration, AcceptsSlurmFormsAndUnits) {
  EXPECT_EQ(parse_duration("90s", nullptr), 90);
  EXPECT_EQ(parse_duration("45m", nullptr), 45 * 60);
  EXPECT_EQ(parse_duration("2h", nullptr), 7200);
  EXPECT_EQ(parse_duration("1d", nullptr), 86400);
  EXPECT_EQ(parse_duration("02:00:00", nullptr), 7200);
  EXPECT_EQ(parse_duration("10:30", nullptr), 630);  // Slurm: MM:SS
  EXPECT_EQ(parse_duration("1-12", nullptr), 36 * 3600);
  EXPECT_EQ(parse_duration("1-12:30", nullptr), 36 * 3600 + 1800);
  EXPECT_EQ(parse_duration("1-00:00:01", nullptr), 86401);
  EXPECT_EQ(parse_duration("100:00:00", nullptr), 360000);
}

TEST(Duration, RejectsWithAReason) {
  std::string reason;
  for (const char* bad : {"", "90", "x", "1:2:3:4", "1-", "-5m", "5 m", "1.5h", "00:60:00", "00:00:61", "1-2:3:4:5"}) {
    reason.clear();
    EXPECT_FALSE(parse_duration(bad, &reason).has_value()) << bad;
    EXPECT_FALSE(reason.empty()) << bad;
  }
}

TEST(Duration, FormatsForSlurm) {
  EXPECT_EQ(format_duration(59), "00:00:59");
  EXPECT_EQ(format_duration(7200), "02:00:00");
  EXPECT_EQ(format_duration(86400 + 3661), "1-01:01:01");
}

TEST(Memory, ParsesBinaryUnits) {
  EXPECT_EQ(parse_memory("512M", nullptr), 512ull << 20);
  EXPECT_EQ(parse_memory("64G", nullptr), 64ull << 30);
  EXPECT_EQ(parse_memory("64gb", nullptr), 64ull << 30);
  EXPECT_EQ(parse_memory("64GiB", nullptr), 64ull << 30);
  EXPECT_EQ(parse_memory("1.5T", nullptr), 1536ull << 30);
  EXPECT_EQ(parse_memory("4096K", nullptr), 4ull << 20);
}

TEST(Memory, RejectsWithAReason) {
  std::string reason;
  for (const char* bad : {"64", "G", "64X", "-1G", "1e30T", "64 G"}) {
    reason.clear();
    EXPECT_FALSE(parse_memory(bad, &reason).has_value()) << bad;
    EXPECT_FALSE(reason.empty()) << bad;
  }
}

TEST(Memory, FormatsInTheLargestWholeUnit) {
  EXPECT_EQ(format_memory(64ull << 30), "64G");
  EXPECT_EQ(format_memory(1536ull << 30), "1536G");
  EXPECT_EQ(format_memory(2ull << 40), "2T");
  EXPECT_EQ(format_memory(512ull << 20), "512M");
  EXPECT_EQ(format_memory((1ull << 20) + 1), "2M");
}

}  // namespace
}  // namespace hpctrial::core
