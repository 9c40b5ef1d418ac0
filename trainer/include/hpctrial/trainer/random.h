// Random numbers the harness owns, identical on every platform and library version.
//
// std::shuffle and std::uniform_int_distribution are implementation-defined, and LibTorch's
// generators may change between releases; the data order must not. SplitMix64 derives seeds,
// xoshiro256** draws, and bounded() uses Lemire's unbiased multiply-shift. Plain values; a
// Rng must not be shared between threads.
#pragma once

#include <cstdint>

namespace hpctrial::trainer {

// SplitMix64: a good 64-bit mix of `x`, used to derive independent seeds.
constexpr std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A seed for stream `stream` derived from `seed` (e.g. the trial seed and an epoch).
constexpr std::uint64_t derive_seed(std::uint64_t seed, std::uint64_t stream) {
  return mix64(mix64(seed) ^ mix64(stream + 0x632be59bd9b4e019ULL));
}

class Rng {
 public:
  explicit Rng(std::uint64_t seed) {
    for (auto& word : state_) {
      seed = mix64(seed);
      word = seed;
    }
  }

  std::uint64_t next() {
    const std::uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const std::uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }

  // Uniform in [0, bound), bound > 0, without modulo bias.
  std::uint64_t bounded(std::uint64_t bound) {
    unsigned __int128 m = static_cast<unsigned __int128>(next()) * bound;
    auto low = static_cast<std::uint64_t>(m);
    if (low < bound) {
      const std::uint64_t threshold = -bound % bound;
      while (low < threshold) {
        m = static_cast<unsigned __int128>(next()) * bound;
        low = static_cast<std::uint64_t>(m);
      }
    }
    return static_cast<std::uint64_t>(m >> 64);
  }

 private:
  static constexpr std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t state_[4];
};

}  // namespace hpctrial::trainer
