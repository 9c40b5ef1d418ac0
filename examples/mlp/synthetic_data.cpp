#include "synthetic_data.h"

#include <cmath>
#include <vector>

#include "synthetic_hdf5.h"

namespace mlp_example {

namespace {

// Standard normal samples labelled by a random one-hidden-layer tanh network.
void teacher_dataset(const SyntheticSpec& spec, std::vector<float>& x, std::vector<std::int64_t>& y) {
  const auto features = static_cast<std::size_t>(spec.features);
  const auto hidden = static_cast<std::size_t>(spec.teacher_hidden);
  const auto classes = static_cast<std::size_t>(spec.classes);
  examples::Normal weights_rng(spec.centre_seed);
  std::vector<double> w1(hidden * features), w2(classes * hidden);
  for (auto& w : w1) w = weights_rng.next() / std::sqrt(static_cast<double>(features));
  for (auto& w : w2) w = weights_rng.next() / std::sqrt(static_cast<double>(hidden));

  examples::Normal rng(spec.seed);
  std::vector<double> h(hidden);
  for (std::size_t i = 0; i < y.size(); ++i) {
    float* row = &x[i * features];
    for (std::size_t f = 0; f < features; ++f) row[f] = static_cast<float>(rng.next());
    for (std::size_t j = 0; j < hidden; ++j) {
      double sum = 0;
      for (std::size_t f = 0; f < features; ++f) sum += w1[j * features + f] * row[f];
      h[j] = std::tanh(2 * sum);
    }
    std::size_t best = 0;
    double best_score = 0;
    for (std::size_t c = 0; c < classes; ++c) {
      double score = 0;
      for (std::size_t j = 0; j < hidden; ++j) score += w2[c * hidden + j] * h[j];
      if (c == 0 || score > best_score) {
        best = c;
        best_score = score;
      }
    }
    // Always two draws a sample, so a sample's features do not depend on the noise level.
    const bool noisy = static_cast<double>(rng.uniform(1000000)) < spec.label_noise * 1e6;
    const auto random_label = static_cast<std::int64_t>(rng.uniform(classes));
    y[i] = noisy ? random_label : static_cast<std::int64_t>(best);
  }
}

}  // namespace

void write_synthetic_dataset(const std::string& path, const SyntheticSpec& spec) {
  if (spec.teacher_hidden > 0) {
    std::vector<float> x(static_cast<std::size_t>(spec.samples * spec.features));
    std::vector<std::int64_t> y(static_cast<std::size_t>(spec.samples));
    teacher_dataset(spec, x, y);
    examples::write_xy(path, x, {static_cast<std::uint64_t>(spec.samples), static_cast<std::uint64_t>(spec.features)}, y);
    return;
  }
  examples::Normal centres_rng(spec.centre_seed);
  std::vector<double> centres(static_cast<std::size_t>(spec.classes * spec.features));
  for (auto& c : centres) c = spec.centre_spread * centres_rng.next();

  examples::Normal rng(spec.seed);
  std::vector<float> x(static_cast<std::size_t>(spec.samples * spec.features));
  std::vector<std::int64_t> y(static_cast<std::size_t>(spec.samples));
  for (std::int64_t i = 0; i < spec.samples; ++i) {
    const auto label = static_cast<std::int64_t>(rng.uniform(static_cast<std::uint64_t>(spec.classes)));
    y[static_cast<std::size_t>(i)] = label;
    for (std::int64_t f = 0; f < spec.features; ++f) {
      x[static_cast<std::size_t>(i * spec.features + f)] = static_cast<float>(
          centres[static_cast<std::size_t>(label * spec.features + f)] + spec.noise * rng.next());
    }
  }
  examples::write_xy(path, x, {static_cast<std::uint64_t>(spec.samples), static_cast<std::uint64_t>(spec.features)}, y);
}

}  // namespace mlp_example
