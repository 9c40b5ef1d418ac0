#include "synthetic_data.h"

#include <hdf5.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

namespace mlp_example {
namespace {

// Box-Muller on a 64-bit generator: the same numbers on every platform.
class Normal {
 public:
  explicit Normal(std::uint64_t seed) : engine_(seed) {}
  double next() {
    const double u1 = (static_cast<double>(engine_() >> 11) + 0.5) / 9007199254740992.0;
    const double u2 = (static_cast<double>(engine_() >> 11) + 0.5) / 9007199254740992.0;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  std::uint64_t uniform(std::uint64_t n) { return engine_() % n; }

 private:
  std::mt19937_64 engine_;
};

void check(herr_t status, const std::string& what) {
  if (status < 0) throw std::runtime_error(what);
}

}  // namespace

void write_synthetic_dataset(const std::string& path, const SyntheticSpec& spec) {
  Normal centres_rng(spec.centre_seed);
  std::vector<double> centres(static_cast<std::size_t>(spec.classes * spec.features));
  for (auto& c : centres) c = spec.centre_spread * centres_rng.next();

  Normal rng(spec.seed);
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

  const hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (file < 0) throw std::runtime_error("cannot create " + path);
  const hsize_t x_dims[2] = {static_cast<hsize_t>(spec.samples), static_cast<hsize_t>(spec.features)};
  const hsize_t y_dims[1] = {static_cast<hsize_t>(spec.samples)};
  const hid_t x_space = H5Screate_simple(2, x_dims, nullptr);
  const hid_t y_space = H5Screate_simple(1, y_dims, nullptr);
  const hid_t x_set = H5Dcreate2(file, "x", H5T_IEEE_F32LE, x_space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  const hid_t y_set = H5Dcreate2(file, "y", H5T_STD_I64LE, y_space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  herr_t status = x_set < 0 || y_set < 0 ? -1 : 0;
  if (status >= 0) status = H5Dwrite(x_set, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, x.data());
  if (status >= 0) status = H5Dwrite(y_set, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, y.data());
  if (y_set >= 0) H5Dclose(y_set);
  if (x_set >= 0) H5Dclose(x_set);
  H5Sclose(y_space);
  H5Sclose(x_space);
  const herr_t closed = H5Fclose(file);
  check(status < 0 ? status : closed, "cannot write the datasets of " + path);
}

}  // namespace mlp_example
