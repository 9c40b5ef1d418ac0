// Image-shaped synthetic data for the cnn example: `x` (float32, N x 1 x 16 x 16) and `y`
// (int64, N). Class k is a bright 5 x 5 square in one of 8 places, jittered by up to a pixel,
// under Gaussian noise.
#pragma once

#include <cstdint>
#include <string>

namespace cnn_example {

struct ImageSpec {
  std::int64_t samples = 4096;
  double noise = 0.8;
  std::uint64_t seed = 1;
};

constexpr std::int64_t kClasses = 8;
constexpr std::int64_t kSide = 16;

void write_synthetic_images(const std::string& path, const ImageSpec& spec);

}  // namespace cnn_example
