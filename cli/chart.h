// Charts of metrics against batches, drawn with PLplot: PNG through its cairo driver, SVG through
// its svg driver (text stays text, so a chart's labels can be searched). No LibTorch.
#pragma once

#include <string>
#include <vector>

namespace hpctrial::cli {

struct Series {
  std::vector<double> x;
  std::vector<double> y;
};

// One metric: a curve per trial (series[i] is trial i of the chart's legend; empty when the
// trial has no value of it).
struct Panel {
  std::string title;
  std::vector<Series> series;
  bool markers = false;  // validation metrics: few points, each marked
};

// Where a trial's training was stopped (an adaptive search's early stop) or resumed (a
// promotion, or a run after a stop), drawn on each of its curves.
struct Mark {
  enum class Kind { kStopped, kResumed };
  Kind kind = Kind::kStopped;
  double x = 0;
};

struct Chart {
  std::string title;
  std::string x_label = "batches";
  std::vector<Panel> panels;        // one above the other
  std::vector<std::string> legend;  // one entry per trial, in its colour
  std::vector<std::vector<Mark>> marks;  // by trial, as the legend; may be empty
};

// Draws the chart into `path`, whose extension chooses the format: .png or .svg. ConfigError for
// another extension or a chart with nothing to draw; IoError when the file cannot be written.
void draw_chart(const Chart& chart, const std::string& path);

}  // namespace hpctrial::cli
