#include "hpctrial/core/paths.h"

#include <gtest/gtest.h>

#include "hpctrial/core/error.h"

namespace hpctrial::core {
namespace {

std::string error_of(const std::string& text) {
  try {
    resolve_user_path(text, "/base", "checkpoint_storage.host_path");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "accepted";
}

TEST(ResolveUserPath, RelativePathsJoinTheBaseAndAreNormalised) {
  EXPECT_EQ(resolve_user_path("ckpt", "/base/dir", "x"), "/base/dir/ckpt");
  EXPECT_EQ(resolve_user_path("../ckpt/./a", "/base/dir", "x"), "/base/ckpt/a");
  EXPECT_EQ(resolve_user_path("/abs//p/../q", "/base", "x"), "/abs/q");
}

TEST(ResolveUserPath, RefusesWhatCannotBeUsedSafely) {
  EXPECT_EQ(error_of(""), "checkpoint_storage.host_path: the path is empty");
  EXPECT_EQ(error_of("a\nb"), "checkpoint_storage.host_path: the path holds a control character "
                              "(newline, tab or similar); rename the directory");
  EXPECT_EQ(error_of("~/ckpt"), "checkpoint_storage.host_path: \"~/ckpt\" starts with '~', which "
                                "hpctrial does not expand (there is no shell); write the full "
                                "path, e.g. /home/you/...");
  EXPECT_NE(error_of(std::string(5000, 'a')).find("paths are limited to"), std::string::npos);
}

TEST(SafeFileName, OnlySingleComponents) {
  EXPECT_TRUE(is_safe_file_name("ckpt-100.h5"));
  EXPECT_FALSE(is_safe_file_name(""));
  EXPECT_FALSE(is_safe_file_name(".."));
  EXPECT_FALSE(is_safe_file_name("a/b"));
  EXPECT_FALSE(is_safe_file_name("a\nb"));
}

}  // namespace
}  // namespace hpctrial::core
