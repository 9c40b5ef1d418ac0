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

struct Chart {
  std::string title;
  std::string x_label = "batches";
  std::vector<Panel> panels;        // one above the other
  std::vector<std::string> legend;  // one entry per trial, in its colour
};

// Draws the chart into `path`, whose extension chooses the format: .png or .svg. ConfigError for
// another extension or a chart with nothing to draw; IoError when the file cannot be written.
void draw_chart(const Chart& chart, const std::string& path);

}  // namespace hpctrial::cli
