#include "chart.h"

#include <fcntl.h>
#include <plplot.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <cstdio>
#include <limits>
#include <optional>

#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"

namespace hpctrial::cli {

namespace {

// Distinguishable colours (Tableau's ten); a trial past the tenth also gets another line style.
constexpr int kPalette[][3] = {{31, 119, 180}, {255, 127, 14}, {44, 160, 44},  {214, 39, 40},   {148, 103, 189},
                               {140, 86, 75},  {227, 119, 194}, {127, 127, 127}, {188, 189, 34}, {23, 190, 207}};
constexpr int kColours = 10;
constexpr int kFirstColour = 2;  // cmap0: 0 background, 1 axes and text
constexpr int kGridColour = 15;
constexpr double kWidth = 1200;

// PLplot reads '#' as the start of an escape sequence.
std::string plain(const std::string& text) {
  std::string out;
  for (const char c : text) {
    out += c;
    if (c == '#') out += '#';
  }
  return out;
}

struct Range {
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  void add(double v) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  bool empty() const { return lo > hi; }
  // A little room around the data, and some width where all values are one.
  Range padded() const {
    Range r = *this;
    const double span = hi - lo;
    const double pad = span > 0 ? 0.05 * span : std::max(std::abs(lo) * 0.1, 1.0);
    r.lo -= pad;
    r.hi += pad;
    return r;
  }
};

// The page, in pixels from its top: the title, a band per panel (its title, the plot, the tick
// labels and the x label), then the legend, a line per trial.
constexpr double kTitle = 56;
constexpr double kPanelTitle = 34;
constexpr double kPlot = 230;
constexpr double kPanelFoot = 58;
constexpr double kLegendLine = 27;
constexpr double kLeft = 0.10;
constexpr double kRight = 0.95;

constexpr double kNote = 28;  // the line that says what the marks mean

bool has_marks(const Chart& chart) {
  for (const auto& marks : chart.marks) {
    if (!marks.empty()) return true;
  }
  return false;
}

double page_height(const Chart& chart) {
  return kTitle + static_cast<double>(chart.panels.size()) * (kPanelTitle + kPlot + kPanelFoot) +
         (has_marks(chart) ? kNote : 0) + static_cast<double>(chart.legend.size()) * kLegendLine + 48;
}

// Every panel shares the x axis, from 0 to the last batch of any trial.
Range x_range(const Chart& chart) {
  Range x;
  x.add(0);
  for (const auto& panel : chart.panels) {
    for (const auto& s : panel.series) {
      for (const double v : s.x) x.add(v);
    }
  }
  if (x.hi <= x.lo) x.hi = x.lo + 1;
  return x;
}

// Normalised device coordinates (0 at the bottom) of `pixels` from the top of a page `height` high.
double from_top(double pixels, double height) { return 1.0 - pixels / height; }

// Axis labels as the values read: 0.93, 1500, 2e-05 (PLplot's own would write 9.3 and x10^-1
// apart).
void axis_label(PLINT /*axis*/, PLFLT value, char* label, PLINT length, PLPointer /*data*/) {
  if (std::abs(value) < 1e-12) value = 0;  // a tick at zero computed as 1e-17
  std::snprintf(label, static_cast<std::size_t>(length), "%g", value);
}

// The curve's value at x: its last point at or before x.
std::optional<double> value_at(const Series& s, double x) {
  std::optional<double> y;
  for (std::size_t i = 0; i < s.x.size() && s.x[i] <= x; ++i) y = s.y[i];
  if (!y && !s.y.empty()) y = s.y.front();
  return y;
}

constexpr PLINT kStoppedSymbol = 5, kResumedSymbol = 7;  // x, and a triangle

void draw_marks(const Series& s, const std::vector<Mark>& marks) {
  for (const Mark& mark : marks) {
    const auto y = value_at(s, mark.x);
    if (!y) continue;
    PLFLT px = mark.x, py = *y;
    plssym(0, 2.0);
    plpoin(1, &px, &py, mark.kind == Mark::Kind::kStopped ? kStoppedSymbol : kResumedSymbol);
  }
}

void draw_panel(const Panel& panel, const Chart& chart, const Range& x, double top, double height) {
  const std::string& x_label = chart.x_label;
  Range y;
  for (const auto& s : panel.series) {
    for (const double v : s.y) y.add(v);
  }
  if (y.empty()) y.add(0);
  y = y.padded();
  plvpor(kLeft, kRight, from_top(top + kPanelTitle + kPlot, height), from_top(top + kPanelTitle, height));
  plwind(x.lo, x.hi, y.lo, y.hi);
  plwidth(1);
  pllsty(1);
  plschr(0, 0.7);
  plcol0(kGridColour);
  plbox("g", 0, 0, "g", 0, 0);
  plcol0(1);
  plslabelfunc(axis_label, nullptr);
  plbox("bcnsto", 0, 0, "bcnstvo", 0, 0);
  plmtex("b", 3.2, 0.5, 0.5, plain(x_label).c_str());
  plschr(0, 0.85);
  plmtex("t", 1.2, 0.0, 0.0, plain(panel.title).c_str());
  for (std::size_t t = 0; t < panel.series.size(); ++t) {
    const Series& s = panel.series[t];
    if (s.x.empty()) continue;
    plcol0(kFirstColour + static_cast<int>(t % kColours));
    pllsty(1 + static_cast<int>((t / kColours) % 8));
    plwidth(2);
    plline(static_cast<PLINT>(s.x.size()), s.x.data(), s.y.data());
    if (panel.markers || s.x.size() == 1) {
      plssym(0, 1.2);
      plpoin(static_cast<PLINT>(s.x.size()), s.x.data(), s.y.data(), 17);  // a filled dot
    }
    if (t < chart.marks.size()) draw_marks(s, chart.marks[t]);
  }
}

void draw_legend(const Chart& chart, double top, double height) {
  const auto n = static_cast<PLINT>(chart.legend.size());
  if (n == 0) return;
  plvpor(kLeft, kRight, from_top(top + 12 + kLegendLine * n, height), from_top(top + 12, height));
  plwind(0, 1, 0, 1);
  std::vector<PLINT> options(n, PL_LEGEND_LINE), colours(n), styles(n), text_colours(n, 1);
  std::vector<PLFLT> widths(n, 2.0);
  std::vector<std::string> texts;
  std::vector<const char*> text;
  for (PLINT i = 0; i < n; ++i) {
    colours[i] = kFirstColour + i % kColours;
    styles[i] = 1 + (i / kColours) % 8;
    texts.push_back(plain(chart.legend[i]));
  }
  for (const auto& t : texts) text.push_back(t.c_str());
  PLFLT width = 0, legend_height = 0;
  plschr(0, 0.6);
  pllegend(&width, &legend_height, 0, PL_POSITION_LEFT | PL_POSITION_TOP | PL_POSITION_INSIDE, 0.0, 0.0, 0.05, 0, 1,
           1, 0, 0, n, options.data(), 1.0, 0.7, 2.2, 0.0, text_colours.data(), text.data(), nullptr, nullptr,
           nullptr, nullptr, colours.data(), styles.data(), widths.data(), nullptr, nullptr, nullptr, nullptr);
}

void draw(const Chart& chart, const std::string& device, const std::string& file) {
  const double height = page_height(chart);
  plsdev(device.c_str());
  plsfnam(file.c_str());
  plspage(0, 0, static_cast<PLINT>(kWidth), static_cast<PLINT>(height), 0, 0);
  plscolbg(255, 255, 255);
  plscol0(1, 0, 0, 0);
  plscol0(kGridColour, 225, 225, 225);
  for (int i = 0; i < kColours; ++i) plscol0(kFirstColour + i, kPalette[i][0], kPalette[i][1], kPalette[i][2]);
  plinit();
  pladv(0);
  plvpor(0.0, 1.0, from_top(kTitle, height), 1.0);
  plwind(0, 1, 0, 1);
  plcol0(1);
  plschr(0, 1.0);
  plptex(0.5, 0.45, 1, 0, 0.5, plain(chart.title).c_str());
  const Range x = x_range(chart);
  double top = kTitle;
  for (const auto& panel : chart.panels) {
    draw_panel(panel, chart, x, top, height);
    top += kPanelTitle + kPlot + kPanelFoot;
  }
  if (has_marks(chart)) {
    plvpor(kLeft, kRight, from_top(top + kNote, height), from_top(top + 8, height));
    plwind(0, 1, 0, 1);
    plcol0(1);
    plschr(0, 0.6);
    plptex(0, 0.5, 1, 0, 0, "x: stopped by the search     triangle: resumed (promoted, or run again after a stop)");
    top += kNote;
  }
  draw_legend(chart, top, height);
  plend();
}

}  // namespace

void draw_chart(const Chart& chart, const std::string& path) {
  const std::string extension = std::filesystem::path(path).extension().string();
  std::string device;
  if (extension == ".png") {
    device = "pngcairo";
  } else if (extension == ".svg") {
    device = "svg";
  } else {
    throw ConfigError("-o " + path + ": the file's extension chooses the format; use .png or .svg");
  }
  bool any = false;
  for (const auto& panel : chart.panels) {
    for (const auto& s : panel.series) any = any || !s.x.empty();
  }
  if (!any) throw ConfigError("nothing to plot: no trial has a value of the metrics asked for");

  // Drawn beside the file, then published whole (private, as every file hpctrial writes): a reader
  // never sees half a chart, and PLplot, which ends the process on an error of its own, only
  // opens a file already made. The temporary has a name no one can guess, made with O_EXCL (a
  // link planted in a shared directory is neither followed nor a reason to fail); PLplot
  // reopens it by that name, and what is published is read through our own descriptor.
  const std::filesystem::path target(path);
  const std::filesystem::path dir = target.has_parent_path() ? target.parent_path() : ".";
  std::string temp = (dir / ("." + target.filename().string() + ".XXXXXX")).string();
  const core::UniqueFd fd(::mkostemp(temp.data(), O_CLOEXEC));  // O_RDWR | O_CREAT | O_EXCL, 0600
  if (fd.get() < 0) core::throw_errno("cannot write the chart " + path + ": no temporary file in " + dir.string(), errno);
  struct Removed {
    const std::string& temp;
    ~Removed() { ::unlink(temp.c_str()); }
  } removed_at_exit{temp};
  if (::fchmod(fd.get(), 0600) != 0) core::throw_errno("cannot set the mode of " + temp, errno);  // whatever the umask
  draw(chart, device, temp);
  struct stat ours {}, named {};
  if (::fstat(fd.get(), &ours) != 0 || ::lstat(temp.c_str(), &named) != 0 || ours.st_dev != named.st_dev ||
      ours.st_ino != named.st_ino) {
    throw IoError("the temporary chart " + temp + " was replaced while PLplot drew into it; draw the chart into a "
                  "directory that only you can write (-o DIR/chart" + extension + ")");
  }
  std::string content;
  char block[65536];
  for (off_t offset = 0;;) {
    const ssize_t n = ::pread(fd.get(), block, sizeof block, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) core::throw_errno("cannot read the chart back from " + temp, errno);
    if (n == 0) break;
    content.append(block, static_cast<std::size_t>(n));
    offset += n;
  }
  if (content.empty()) throw IoError("PLplot wrote nothing into " + path + " (its " + device + " driver failed)");
  core::write_file_atomic(path, content);
}

}  // namespace hpctrial::cli
