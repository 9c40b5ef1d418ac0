#include "hpctrial/core/shell_quote.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "hpctrial/core/error.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial::core {
namespace {

// What a real shell makes of the quoted word: printf '%s' WORD, run by `shell -c`.
std::string through_shell(const std::string& shell, const std::string& value) {
  const RunResult r = run_process({shell, "-c", "printf '%s' " + shell_quote(value)});
  EXPECT_TRUE(r.ok()) << r.describe();
  return r.out;
}

const std::vector<std::string>& tricky_values() {
  static const std::vector<std::string> values = {
      "plain",
      "with space",
      "two  spaces\tand tab",
      "single'quote",
      "''",
      "double\"quote",
      "$(touch /tmp/hpctrial-pwned)",
      "`touch /tmp/hpctrial-pwned`",
      "${HOME}",
      "$HOME",
      "# not a comment",
      "a#b",
      "line1\nline2",
      "trailing newline\n",
      "back\\slash\\",
      "semi;colon && pipe | amp &",
      "glob * ? [a-z]",
      "~user",
      "=cmd",
      "-n",
      "!history",
      "non-ASCII: ünïcödé, 日本語, emoji 🚀",
      "\x01\x7f control bytes",
      "\xff\xfe not UTF-8",
      "",
  };
  return values;
}

TEST(ShellQuote, PlainWordsStayReadable) {
  EXPECT_EQ(shell_quote("abc"), "abc");
  EXPECT_EQ(shell_quote("/scratch/me/exp-1/ckpt.h5"), "/scratch/me/exp-1/ckpt.h5");
  EXPECT_EQ(shell_quote("--nodes=2"), "--nodes=2");
  EXPECT_EQ(shell_quote("user@host:1,2"), "user@host:1,2");
}

TEST(ShellQuote, EverythingElseIsSingleQuoted) {
  EXPECT_EQ(shell_quote(""), "''");
  EXPECT_EQ(shell_quote("a b"), "'a b'");
  EXPECT_EQ(shell_quote("it's"), "'it'\\''s'");
  EXPECT_EQ(shell_quote("$(x)"), "'$(x)'");
  EXPECT_EQ(shell_quote("=x"), "'=x'");
}

TEST(ShellQuote, RoundTripsThroughBashAndDash) {
  for (const std::string shell : {"bash", "dash"}) {
    for (const auto& value : tricky_values()) {
      EXPECT_EQ(through_shell(shell, value), value) << shell << " with " << shell_quote(value);
    }
  }
}

TEST(ShellQuote, NothingInAValueRunsACommand) {
  ::unlink("/tmp/hpctrial-pwned");
  for (const auto& value : tricky_values()) through_shell("bash", value);
  EXPECT_NE(::access("/tmp/hpctrial-pwned", F_OK), 0) << "a quoted value ran a command";
}

TEST(ShellQuote, NulIsRejectedNamingTheValue) {
  try {
    shell_quote(std::string("a\0b", 3), "scheduler.environment.X");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "scheduler.environment.X: contains a NUL byte, which no shell word can hold; remove it");
  }
}

TEST(ShellQuote, JoinQuotesEachWord) {
  EXPECT_EQ(shell_join({"mpirun", "-np", "2", "my trial", "it's"}),
            "mpirun -np 2 'my trial' 'it'\\''s'");
  const RunResult r = run_process({"bash", "-c", "for a in " + shell_join({"a b", "c"}) +
                                                     "; do printf '<%s>' \"$a\"; done"});
  EXPECT_EQ(r.out, "<a b><c>");
}

}  // namespace
}  // namespace hpctrial::core
