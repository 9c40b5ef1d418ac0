// Writes a learnable classification dataset to HDF5: `x` (float32, N x features) and `y`
// (int64, N). Each class is a Gaussian blob around its own random centre; or, with a teacher,
// the samples are standard normal and each label is the class a fixed random network (one tanh
// layer of `teacher_hidden` units) scores highest: a boundary a student network learns slowly,
// with `label_noise` of the labels replaced by random ones so the gradient noise grows as it
// learns.
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
  std::int64_t teacher_hidden = 0;  // > 0: labels from a teacher network (its weights from centre_seed)
  double label_noise = 0;           // the share of labels drawn at random (teacher mode)
};

// Creates (or replaces) `path`. Throws std::runtime_error naming the path on failure.
void write_synthetic_dataset(const std::string& path, const SyntheticSpec& spec);

}  // namespace mlp_example
