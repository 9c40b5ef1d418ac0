// Writes a learnable classification dataset to HDF5: `x` (float32, N x features) and `y`
// (int64, N). Each class is a Gaussian blob around its own random centre.
#pragma once

#include <cstdint>
#include <string>

namespace mlp_example {

struct SyntheticSpec {
  std::int64_t samples = 8192;
  std::int64_t features = 32;
  std::int64_t classes = 10;
  double noise = 1.0;           // standard deviation around a centre
  double centre_spread = 0.6;   // standard deviation of the centres (classes overlap)
  std::uint64_t seed = 1;
  // Centres depend on this seed only, so training and validation files share their classes.
  std::uint64_t centre_seed = 12345;
};

// Creates (or replaces) `path`. Throws std::runtime_error naming the path on failure.
void write_synthetic_dataset(const std::string& path, const SyntheticSpec& spec);

}  // namespace mlp_example
