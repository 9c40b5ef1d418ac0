#include "hpctrial/core/config_node.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../../support/temp_dir.h"

namespace hpctrial::core {
namespace {

using testing::HasSubstr;
using testing_support::TempDir;

ConfigNode parse(const std::string& text, Diagnostics& d) { return parse_config_text(text, "c.yaml", d); }

TEST(ConfigNode, KeepsPositionsAndQuoting) {
  Diagnostics d;
  const ConfigNode root = parse("a: 1\nb:\n  c: \"x\"\n  d: [p, q]\n", d);
  ASSERT_TRUE(d.empty()) << d.to_string();
  ASSERT_TRUE(root.is_map());
  const ConfigNode* c = root.find("b")->find("c");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->text(), "x");
  EXPECT_TRUE(c->quoted());
  EXPECT_EQ(c->where().to_string(), "c.yaml:3:6");
  EXPECT_FALSE(root.find("a")->quoted());
  EXPECT_EQ(root.entries()[1].key_where.to_string(), "c.yaml:2:1");
  EXPECT_EQ(root.find("b")->find("d")->items()[1].where().to_string(), "c.yaml:4:10");
}

TEST(ConfigNode, NullsAreNullNotStrings) {
  Diagnostics d;
  const ConfigNode root = parse("a:\nb: ~\nc: null\nd: 'null'\n", d);
  EXPECT_TRUE(root.find("a")->is_null());
  EXPECT_TRUE(root.find("b")->is_null());
  EXPECT_TRUE(root.find("c")->is_null());
  EXPECT_TRUE(root.find("d")->is_scalar());
}

TEST(ConfigNode, RefusesOversizedTextBeforeParsing) {
  Diagnostics d;
  parse(std::string(kMaxConfigBytes + 1, '#'), d);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d.items()[0].to_string(),
            "c.yaml: is 1048577 bytes; configs are limited to 1048576 bytes");
}

TEST(ConfigNode, RefusesOversizedFilesWithoutReadingThem) {
  TempDir dir;
  const std::string path = dir.write("big.yaml", std::string(2 * kMaxConfigBytes, 'a'));
  Diagnostics d;
  load_config_file(path, d);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d.items()[0].to_string(),
            path + ": is 2097152 bytes; configs are limited to 1048576 bytes - is this the right file?");
}

TEST(ConfigNode, RejectsADirectory) {
  TempDir dir;
  Diagnostics d;
  load_config_file(dir.path().string(), d);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d.items()[0].to_string(), dir.path().string() + ": is not a regular file");
}

TEST(ConfigNode, RejectsDeepNestingWithAClearMessage) {
  for (int depth : {kMaxConfigDepth + 5, 2000}) {
    std::string text;
    for (int i = 0; i < depth; ++i) text += "[";
    for (int i = 0; i < depth; ++i) text += "]";
    Diagnostics d;
    parse("a: " + text + "\n", d);
    ASSERT_EQ(d.size(), 1u) << depth;
    EXPECT_THAT(d.items()[0].message, HasSubstr("nesting deeper than 64 levels")) << depth;
    EXPECT_THAT(d.items()[0].message, testing::Not(HasSubstr("bad file")));
  }
}

TEST(ConfigNode, RejectsAnAliasBombQuickly) {
  // Nine levels of ten aliases each would expand to 10^9 values.
  std::string text = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i < 9; ++i) {
    const std::string prev = "*a" + std::to_string(i - 1);
    text += "a" + std::to_string(i) + ": &a" + std::to_string(i) + " [";
    for (int j = 0; j < 10; ++j) text += (j ? ", " : "") + prev;
    text += "]\n";
  }
  Diagnostics d;
  parse(text, d);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_THAT(d.items()[0].message, HasSubstr("expands to more than 100000 values"));
  EXPECT_THAT(d.items()[0].message, HasSubstr("alias bomb"));
}

TEST(ConfigNode, ModestAliasesAreExpanded) {
  Diagnostics d;
  const ConfigNode root = parse("base: &b {x: 1}\nother: *b\n", d);
  ASSERT_TRUE(d.empty()) << d.to_string();
  EXPECT_EQ(root.find("other")->find("x")->text(), "1");
}

TEST(ConfigNode, MergeTemplate) {
  Diagnostics d;
  const ConfigNode tmpl = parse("a: 1\nm: {x: 1, y: 2}\nl: [1, 2]\ns: {k: v}\n", d);
  const ConfigNode config = parse("a: 2\nm: {y: 3, z: 4}\nl: [3]\ns: replaced\nn: new\n", d);
  ASSERT_TRUE(d.empty());
  const ConfigNode merged = merge_template(tmpl, config);
  EXPECT_EQ(merged.find("a")->text(), "2");
  EXPECT_EQ(merged.find("m")->find("x")->text(), "1");
  EXPECT_EQ(merged.find("m")->find("y")->text(), "3");
  EXPECT_EQ(merged.find("m")->find("z")->text(), "4");
  ASSERT_EQ(merged.find("l")->items().size(), 3u);
  EXPECT_EQ(merged.find("l")->items()[0].text(), "1");
  EXPECT_EQ(merged.find("l")->items()[2].text(), "3");
  EXPECT_EQ(merged.find("s")->text(), "replaced");
  EXPECT_EQ(merged.find("n")->text(), "new");
  // Every merged value still knows where it was written.
  EXPECT_EQ(merged.find("m")->find("x")->where().line, 2);
}

TEST(ConfigNode, OverrideCreatesMapsAndReplacesValues) {
  Diagnostics d;
  ConfigNode root = parse("a: {b: 1}\n", d);
  apply_override(root, "a.b=2", d);
  apply_override(root, "x.y.z={k: [1, 2]}", d);
  apply_override(root, "a.c=", d);
  ASSERT_TRUE(d.empty()) << d.to_string();
  EXPECT_EQ(root.find("a")->find("b")->text(), "2");
  EXPECT_EQ(root.find("a")->find("b")->where().to_string(), "--set a.b=2");
  EXPECT_EQ(root.find("x")->find("y")->find("z")->find("k")->items().size(), 2u);
  EXPECT_TRUE(root.find("a")->find("c")->is_null());
}

TEST(ConfigNode, ToYamlRoundTrips) {
  Diagnostics d;
  const std::string text = "a: \"1\"\nb: 1\nc:\n  - x\n  - {k: v}\nd: ~\n";
  const ConfigNode root = parse(text, d);
  const ConfigNode again = parse(root.to_yaml(), d);
  ASSERT_TRUE(d.empty()) << d.to_string();
  EXPECT_EQ(again.to_yaml(), root.to_yaml());
  EXPECT_TRUE(again.find("a")->quoted());
  EXPECT_FALSE(again.find("b")->quoted());
  EXPECT_TRUE(again.find("d")->is_null());
}

}  // namespace
}  // namespace hpctrial::core
