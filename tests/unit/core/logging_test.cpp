#include "hpctrial/core/logging.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"

namespace hpctrial::core {
namespace {

using testing::HasSubstr;
using testing::MatchesRegex;

class LoggingTest : public testing::Test {
 protected:
  void TearDown() override {
    set_log_level(LogLevel::kInfo);
    set_log_rank(-1);
  }
};

TEST_F(LoggingTest, LinesHaveTimeLevelAndRank) {
  set_log_rank(3);
  testing::internal::CaptureStderr();
  log_info("restored step {} from {}", 42, "/ckpt/ckpt-42.h5");
  const std::string line = testing::internal::GetCapturedStderr();
  EXPECT_THAT(line, MatchesRegex("[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]+Z \\[info\\] \\[rank 3\\] "
                                 "restored step 42 from /ckpt/ckpt-42.h5\n"));
}

TEST_F(LoggingTest, LevelsFilter) {
  set_log_level(LogLevel::kWarning);
  testing::internal::CaptureStderr();
  log_info("hidden");
  log_debug("hidden");
  log_warning("shown {}", 1);
  log_error("shown {}", 2);
  const std::string out = testing::internal::GetCapturedStderr();
  EXPECT_THAT(out, testing::Not(HasSubstr("hidden")));
  EXPECT_THAT(out, HasSubstr("[warning] shown 1"));
  EXPECT_THAT(out, HasSubstr("[error] shown 2"));
}

MapEnv env_with(const std::string& name, const std::string& value) {
  MapEnv env;
  env.set(name, value);
  return env;
}

TEST_F(LoggingTest, LevelComesFromTheEnvironment) {
  init_logging(env_with("HPCTRIAL_LOG_LEVEL", "DEBUG"));
  EXPECT_EQ(log_level(), LogLevel::kDebug);
  testing::internal::CaptureStderr();
  init_logging(env_with("HPCTRIAL_LOG_LEVEL", "loud"));
  const std::string out = testing::internal::GetCapturedStderr();
  EXPECT_EQ(log_level(), LogLevel::kDebug);
  EXPECT_THAT(out, HasSubstr("HPCTRIAL_LOG_LEVEL: unknown log level \"loud\"; use one of debug, "
                             "info, warning, error, off"));
}

TEST_F(LoggingTest, ParseLogLevel) {
  EXPECT_EQ(parse_log_level("warn"), LogLevel::kWarning);
  EXPECT_EQ(parse_log_level("Off"), LogLevel::kOff);
  EXPECT_THROW(parse_log_level("verbose"), ConfigError);
}

TEST(Env, MapEnvAndValidNames) {
  MapEnv env = env_with("A", "1");
  EXPECT_EQ(env.get("A"), "1");
  EXPECT_EQ(env.get("B"), std::nullopt);
  env.set("B", "");
  EXPECT_EQ(env.get("B"), "");
  EXPECT_TRUE(is_valid_env_name("_A1"));
  EXPECT_FALSE(is_valid_env_name("1A"));
  EXPECT_FALSE(is_valid_env_name("A-B"));
  EXPECT_FALSE(is_valid_env_name(""));
}

}  // namespace
}  // namespace hpctrial::core
