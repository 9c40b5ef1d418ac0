#include "synthetic_images.h"

#include <vector>

#include "synthetic_hdf5.h"

namespace cnn_example {

void write_synthetic_images(const std::string& path, const ImageSpec& spec) {
  examples::Normal rng(spec.seed);
  const std::int64_t pixels = kSide * kSide;
  std::vector<float> x(static_cast<std::size_t>(spec.samples * pixels));
  std::vector<std::int64_t> y(static_cast<std::size_t>(spec.samples));
  for (std::int64_t i = 0; i < spec.samples; ++i) {
    const auto label = static_cast<std::int64_t>(rng.uniform(kClasses));
    y[static_cast<std::size_t>(i)] = label;
    const std::int64_t top = (label / 4) * 8 + 1 + static_cast<std::int64_t>(rng.uniform(3)) - 1;
    const std::int64_t left = (label % 4) * 4 + static_cast<std::int64_t>(rng.uniform(2));
    float* image = &x[static_cast<std::size_t>(i * pixels)];
    for (std::int64_t p = 0; p < pixels; ++p) image[p] = static_cast<float>(spec.noise * rng.next());
    for (std::int64_t r = top; r < top + 5; ++r) {
      for (std::int64_t c = left; c < left + 5 && c < kSide; ++c) {
        if (r >= 0 && r < kSide) image[r * kSide + c] += 1.0f;
      }
    }
  }
  examples::write_xy(path, x, {static_cast<std::uint64_t>(spec.samples), 1, kSide, kSide}, y);
}

}  // namespace cnn_example
