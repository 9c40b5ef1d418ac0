// The charts of `hpctrial plot`: drawn into a temporary beside the target and published whole,
// the temporary made so that nothing planted in the directory is followed or written through.
#include <sys/stat.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "../../support/read_file.h"
#include "../../support/temp_dir.h"
#include "chart.h"

namespace hpctrial::cli {
namespace {

using testing::HasSubstr;
using testing::StartsWith;
using testing_support::read_file;
using testing_support::TempDir;

// Text as PLplot's svg driver writes it: every character as a hexadecimal reference.
std::string svg_text(const std::string& text) {
  std::string out;
  char reference[16];
  for (unsigned char c : text) {
    std::snprintf(reference, sizeof reference, "&#x%x;", c);
    out += reference;
  }
  return out;
}

Chart two_points() {
  Chart chart;
  chart.title = "loss of exp";
  chart.panels.push_back({"loss", {{{1, 2, 3}, {0.9, 0.5, 0.25}}}, false});
  chart.legend = {"trial 0"};
  return chart;
}

// hpctrial plot used to draw into ".<name>.<pid>.tmp", opened without O_EXCL: a link planted at
// that name in a shared directory made it overwrite whatever the link pointed to.
TEST(Chart, ALinkPlantedAtThePredictableTemporaryNameIsNotFollowed) {
  TempDir dir;
  const std::string victim = dir.write("victim.txt", "precious\n");
  const std::filesystem::path target = dir.path() / "chart.svg";
  const std::filesystem::path planted = dir.path() / (".chart.svg." + std::to_string(::getpid()) + ".tmp");
  std::filesystem::create_symlink(victim, planted);

  draw_chart(two_points(), target.string());

  EXPECT_EQ(read_file(victim), "precious\n") << "the chart was written through the planted link";
  EXPECT_TRUE(std::filesystem::is_symlink(planted)) << "the planted link was touched";
  EXPECT_EQ(std::filesystem::read_symlink(planted), victim);
  const std::string svg = read_file(target);
  EXPECT_THAT(svg, HasSubstr("<svg"));
  EXPECT_THAT(svg, HasSubstr("</svg>\n")) << "the whole chart";
  EXPECT_THAT(svg, HasSubstr(svg_text("loss of exp")));
  struct stat st {};
  ASSERT_EQ(::lstat(target.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // Nothing left beside the chart but what was there before.
  int entries = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    ++entries;
    EXPECT_THAT(entry.path().filename().string(), testing::AnyOf("victim.txt", "chart.svg", planted.filename().string()));
  }
  EXPECT_EQ(entries, 3);
}

// A link at the target itself is replaced by the chart, not written through.
TEST(Chart, ALinkAtTheTargetIsReplacedNotFollowed) {
  TempDir dir;
  const std::string victim = dir.write("victim.txt", "precious\n");
  const std::filesystem::path target = dir.path() / "chart.png";
  std::filesystem::create_symlink(victim, target);

  draw_chart(two_points(), target.string());

  EXPECT_EQ(read_file(victim), "precious\n");
  EXPECT_FALSE(std::filesystem::is_symlink(target));
  EXPECT_THAT(read_file(target), StartsWith("\x89PNG"));
}

// Accuracies between 0.91 and 0.95 are labelled as they read (0.92), not as 9.2 with x10^-1
// apart; a chart with marks says what they mean.
TEST(Chart, AxisLabelsReadAsTheValuesAndMarksAreExplained) {
  TempDir dir;
  Chart chart;
  chart.title = "accuracy";
  chart.panels.push_back({"accuracy", {{{10, 20, 30, 40}, {0.91, 0.93, 0.94, 0.95}}}, true});
  chart.legend = {"trial 0"};
  chart.marks = {{{Mark::Kind::kResumed, 20}, {Mark::Kind::kStopped, 40}}};
  const std::string path = (dir.path() / "chart.svg").string();
  draw_chart(chart, path);
  const std::string svg = read_file(path);
  EXPECT_THAT(svg, HasSubstr(svg_text("0.92")));
  EXPECT_THAT(svg, testing::Not(HasSubstr(svg_text("9.2"))));  // a mantissa with its exponent apart
  EXPECT_THAT(svg, HasSubstr(svg_text("x: stopped by the search")));
  chart.marks.clear();
  draw_chart(chart, path);
  EXPECT_THAT(read_file(path), testing::Not(HasSubstr(svg_text("x: stopped by the search"))));
}

TEST(Chart, AnUnknownExtensionNamesThePathAndTheFormats) {
  TempDir dir;
  const std::string target = (dir.path() / "chart.pdf").string();
  try {
    draw_chart(two_points(), target);
    FAIL() << "a .pdf chart was drawn";
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), HasSubstr("-o " + target + ": the file's extension chooses the format; use .png or .svg"));
  }
  EXPECT_FALSE(std::filesystem::exists(target));
}

}  // namespace
}  // namespace hpctrial::cli
