#include "hpctrial/core/error.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>

namespace hpctrial {
namespace {

using testing::HasSubstr;

TEST(Errors, EveryKindIsAnHpctrialError) {
  EXPECT_THROW(throw ConfigError("x"), Error);
  EXPECT_THROW(throw IoError("x"), Error);
  EXPECT_THROW(throw CommError("x"), Error);
  EXPECT_THROW(throw SchedulerError("x"), Error);
  EXPECT_THROW(throw CheckpointError("x"), Error);
  EXPECT_THROW(throw NotSupported("x"), Error);
  EXPECT_THROW(throw InternalError("x"), Error);
}

TEST(Errors, ThrowErrnoAddsTheSystemText) {
  try {
    core::throw_errno("cannot open /x/y", ENOENT);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_EQ(std::string(e.what()), "cannot open /x/y: No such file or directory");
  }
}

TEST(Enforce, NamesTheConditionAndLocation) {
  try {
    HPCTRIAL_ENFORCE(1 + 1 == 3, "while adding");
    FAIL();
  } catch (const InternalError& e) {
    EXPECT_THAT(e.what(), HasSubstr("error_test.cpp:"));
    EXPECT_THAT(e.what(), HasSubstr("expected 1 + 1 == 3 while adding"));
    EXPECT_THAT(e.what(), HasSubstr("this is a bug in hpctrial"));
  }
}

TEST(Enforce, ComparisonsRecordBothValues) {
  const int buckets = 3, expected = 4;
  try {
    HPCTRIAL_ENFORCE_EQ(buckets, expected);
    FAIL();
  } catch (const InternalError& e) {
    EXPECT_THAT(e.what(), HasSubstr("expected buckets == expected (3 vs 4)"));
  }
  EXPECT_NO_THROW(HPCTRIAL_ENFORCE_LT(1, 2));
  EXPECT_THROW(HPCTRIAL_ENFORCE_GE(1, 2), InternalError);
}

}  // namespace
}  // namespace hpctrial
