#include "synthetic_data.h"

#include <vector>

#include "synthetic_hdf5.h"

namespace mlp_example {

void write_synthetic_dataset(const std::string& path, const SyntheticSpec& spec) {
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
