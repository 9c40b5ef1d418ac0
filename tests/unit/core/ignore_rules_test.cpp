// .hpctrialignore's patterns, as .gitignore reads them.
#include "hpctrial/core/ignore_rules.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "hpctrial/core/error.h"

namespace hpctrial::core {
namespace {

TEST(IgnoreRules, ReadTheWayGitignoreDoes) {
  const IgnoreRules rules(
      "# a comment\n"
      "\n"
      "*.bin\n"
      "!keep/*.bin\n"
      "build/\n"
      "/top.txt\n"
      "docs/*.md\n"
      "**/cache\n"
      "data/**\n"
      "a/**/z\n"
      "file?.log\n"
      "[0-9]*.tmp\n"
      "\\#literal\n"
      "trailing   \n",
      ".hpctrialignore");
  EXPECT_TRUE(rules.ignored("w.bin", false));
  EXPECT_TRUE(rules.ignored("deep/down/w.bin", false)) << "no slash: a name at any depth";
  EXPECT_FALSE(rules.ignored("keep/w.bin", false)) << "negated";
  EXPECT_TRUE(rules.ignored("build", true));
  EXPECT_TRUE(rules.ignored("src/build", true));
  EXPECT_FALSE(rules.ignored("build", false)) << "a trailing slash: folders only";
  EXPECT_TRUE(rules.ignored("top.txt", false));
  EXPECT_FALSE(rules.ignored("sub/top.txt", false)) << "a leading slash anchors";
  EXPECT_TRUE(rules.ignored("docs/a.md", false));
  EXPECT_FALSE(rules.ignored("docs/sub/a.md", false)) << "'*' stops at '/'";
  EXPECT_FALSE(rules.ignored("other/docs/a.md", false)) << "a middle slash anchors";
  EXPECT_TRUE(rules.ignored("cache", true));
  EXPECT_TRUE(rules.ignored("x/y/cache", false));
  EXPECT_TRUE(rules.ignored("data/a/b.h5", false));
  EXPECT_FALSE(rules.ignored("data", true)) << "data/** is what is inside";
  EXPECT_TRUE(rules.ignored("a/z", false));
  EXPECT_TRUE(rules.ignored("a/b/c/z", false));
  EXPECT_TRUE(rules.ignored("file1.log", false));
  EXPECT_FALSE(rules.ignored("file12.log", false));
  EXPECT_TRUE(rules.ignored("7up.tmp", false));
  EXPECT_FALSE(rules.ignored("up7.tmp", false));
  EXPECT_TRUE(rules.ignored("#literal", false));
  EXPECT_TRUE(rules.ignored("trailing", false)) << "trailing spaces dropped";
  EXPECT_FALSE(rules.ignored("notes.txt", false));
  EXPECT_TRUE(IgnoreRules().empty());
}

TEST(IgnoreRules, AnUnclosedClassNamesTheFileAndLine) {
  try {
    IgnoreRules("ok\n[abc\n", "ctx/.hpctrialignore");
    ADD_FAILURE() << "read";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("ctx/.hpctrialignore:2: '[' without its ']'"));
  }
}

}  // namespace
}  // namespace hpctrial::core
