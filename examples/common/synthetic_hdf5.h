// Helpers for the examples' synthetic datasets: a portable normal generator and a writer of
// an HDF5 file holding `x` (float32, any shape N x ...) and `y` (int64, N).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace examples {

// Box-Muller on a 64-bit Mersenne Twister: the same numbers on every platform.
class Normal {
 public:
  explicit Normal(std::uint64_t seed) : engine_(seed) {}
  double next();
  std::uint64_t uniform(std::uint64_t n) { return engine_() % n; }

 private:
  std::mt19937_64 engine_;
};

// Creates (or replaces) `path`. Throws std::runtime_error naming the path on failure.
void write_xy(const std::string& path, const std::vector<float>& x, const std::vector<std::uint64_t>& x_dims,
              const std::vector<std::int64_t>& y);

}  // namespace examples
