#include "synthetic_hdf5.h"

#include <hdf5.h>

#include <cmath>
#include <stdexcept>

namespace examples {

double Normal::next() {
  const double u1 = (static_cast<double>(engine_() >> 11) + 0.5) / 9007199254740992.0;
  const double u2 = (static_cast<double>(engine_() >> 11) + 0.5) / 9007199254740992.0;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

void write_xy(const std::string& path, const std::vector<float>& x, const std::vector<std::uint64_t>& x_dims,
              const std::vector<std::int64_t>& y) {
  const hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (file < 0) throw std::runtime_error("cannot create " + path);
  std::vector<hsize_t> dims(x_dims.begin(), x_dims.end());
  const hsize_t y_dims[1] = {static_cast<hsize_t>(y.size())};
  const hid_t x_space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
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
  if (status < 0 || closed < 0) throw std::runtime_error("cannot write the datasets of " + path);
}

}  // namespace examples
