#include <algorithm>
#include <numeric>

#include "hpctrial/checkpoint/h5_handle.h"
#include "hpctrial/core/error.h"
#include "hpctrial/trainer/data.h"

namespace hpctrial::trainer {

using checkpoint::check_h5;
using checkpoint::H5Handle;

// Named rather than anonymous: Hdf5Dataset::Impl holds Columns (GCC's -Wsubobject-linkage).
namespace hdf5_columns {

// A numeric HDF5 dataset as LibTorch sees it.
struct Column {
  std::string name;
  H5Handle dataset;
  std::vector<hsize_t> dims;     // dims[0] = rows
  H5Handle memory_type;          // what we read it as
  torch::ScalarType dtype = torch::kFloat32;
  std::size_t sample_bytes = 0;  // one row
};

std::string list_datasets(hid_t file) {
  std::string names;
  H5Literate(
      file, H5_INDEX_NAME, H5_ITER_INC, nullptr,
      [](hid_t, const char* name, const H5L_info_t*, void* data) -> herr_t {
        auto* out = static_cast<std::string*>(data);
        if (out->size() < 200) *out += (out->empty() ? "" : ", ") + std::string(name);
        return 0;
      },
      &names);
  checkpoint::h5_error_stack();  // clear anything the iteration left
  return names.empty() ? "none" : names;
}

Column open_column(hid_t file, const std::string& path, const std::string& name) {
  const std::string where = "data file " + path + ": dataset '" + name + "'";
  if (name.empty() || H5Lexists(file, name.c_str(), H5P_DEFAULT) <= 0) {
    checkpoint::h5_error_stack();
    throw ConfigError("data file " + path + " has no dataset '" + name + "' (it has: " +
                      list_datasets(file) + "); name the right one in the experiment's data: section");
  }
  Column column;
  column.name = name;
  try {
    column.dataset = H5Handle(H5Dopen2(file, name.c_str(), H5P_DEFAULT), where);
  } catch (const CheckpointError& e) {
    throw ConfigError(where + " cannot be opened as a dataset (is it a group?): " + e.what());
  }
  H5Handle space(H5Dget_space(column.dataset.get()), where + ": dataspace");
  const int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank < 1) {
    throw ConfigError(where + " is a scalar; it needs one row per sample (shape N x ...)");
  }
  column.dims.resize(static_cast<std::size_t>(rank));
  H5Sget_simple_extent_dims(space.get(), column.dims.data(), nullptr);

  H5Handle file_type(H5Dget_type(column.dataset.get()), where + ": type");
  const H5T_class_t type_class = H5Tget_class(file_type.get());
  const std::size_t size = H5Tget_size(file_type.get());
  hid_t native = -1;
  if (type_class == H5T_FLOAT && size == 4) {
    native = H5T_NATIVE_FLOAT, column.dtype = torch::kFloat32;
  } else if (type_class == H5T_FLOAT && size == 8) {
    native = H5T_NATIVE_DOUBLE, column.dtype = torch::kFloat64;
  } else if (type_class == H5T_INTEGER) {
    const bool is_signed = H5Tget_sign(file_type.get()) == H5T_SGN_2;
    if (!is_signed && size == 1) native = H5T_NATIVE_UINT8, column.dtype = torch::kUInt8;
    else if (is_signed && size == 1) native = H5T_NATIVE_INT8, column.dtype = torch::kInt8;
    else if (is_signed && size == 2) native = H5T_NATIVE_INT16, column.dtype = torch::kInt16;
    else if (is_signed && size == 4) native = H5T_NATIVE_INT32, column.dtype = torch::kInt32;
    else if (size <= 4 || (is_signed && size == 8)) native = H5T_NATIVE_INT64, column.dtype = torch::kInt64;
  }
  if (native < 0) {
    const char* kinds[] = {"integer", "float", "time", "string", "bitfield", "opaque", "compound",
                           "reference", "enum", "variable-length", "array"};
    const std::string kind = type_class >= 0 && type_class <= 10 ? kinds[type_class] : "unknown";
    throw ConfigError(where + " holds " + std::to_string(size) + "-byte " + kind +
                      " values; Hdf5Dataset reads float32, float64 and integers up to 64 bits "
                      "(unsigned up to 32)");
  }
  column.memory_type = H5Handle(H5Tcopy(native), where + ": memory type");

  // Sizes from the file are checked before anything is allocated from them.
  std::uint64_t elements = 1;
  for (std::size_t i = 1; i < column.dims.size(); ++i) {
    if (__builtin_mul_overflow(elements, column.dims[i], &elements) || elements > (1ull << 36)) {
      throw ConfigError(where + " declares samples too large to load (shape " +
                        std::to_string(column.dims[i]) + " in dimension " + std::to_string(i) + ")");
    }
  }
  column.sample_bytes = static_cast<std::size_t>(elements) * c10::elementSize(column.dtype);
  return column;
}

}  // namespace hdf5_columns

using hdf5_columns::Column;
using hdf5_columns::open_column;

struct Hdf5Dataset::Impl {
  std::string path;
  H5Handle file;
  Column data;
  Column target;
};

Hdf5Dataset::Hdf5Dataset(const std::string& path, const std::string& data_name,
                         const std::string& target_name)
    : impl_(std::make_unique<Impl>()) {
  std::lock_guard<std::mutex> lock(checkpoint::h5_mutex());
  checkpoint::silence_h5_errors();
  impl_->path = path;
  try {
    impl_->file = H5Handle(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), "open");
  } catch (const CheckpointError& e) {
    std::string reason = e.what();
    reason = reason.substr(reason.find(": ") + 2);
    throw ConfigError("data file " + path + " cannot be opened as HDF5: " + reason +
                      "; check the path in the experiment's data: section");
  }
  impl_->data = open_column(impl_->file.get(), path, data_name);
  impl_->target = open_column(impl_->file.get(), path, target_name);
  if (impl_->data.dims[0] != impl_->target.dims[0]) {
    throw ConfigError("data file " + path + ": dataset '" + data_name + "' has " +
                      std::to_string(impl_->data.dims[0]) + " rows but '" + target_name + "' has " +
                      std::to_string(impl_->target.dims[0]) + "; every sample needs both");
  }
}

Hdf5Dataset::~Hdf5Dataset() {
  std::lock_guard<std::mutex> lock(checkpoint::h5_mutex());
  impl_.reset();
}

std::uint64_t Hdf5Dataset::size() const { return impl_->data.dims[0]; }

std::vector<std::int64_t> Hdf5Dataset::sample_shape() const {
  return {impl_->data.dims.begin() + 1, impl_->data.dims.end()};
}

namespace {

// Reads `rows` (sorted, unique) of `column` into one tensor, coalescing runs of consecutive
// rows into one hyperslab each.
torch::Tensor read_rows(const Column& column, const std::vector<std::int64_t>& rows,
                        const std::string& path) {
  const std::string where = "data file " + path + ": dataset '" + column.name + "'";
  std::vector<std::int64_t> shape(column.dims.begin(), column.dims.end());
  shape[0] = static_cast<std::int64_t>(rows.size());
  torch::Tensor out = torch::empty(shape, torch::TensorOptions().dtype(column.dtype));
  if (rows.empty()) return out;

  H5Handle file_space(H5Dget_space(column.dataset.get()), where + ": dataspace");
  std::vector<hsize_t> start(column.dims.size(), 0), count(column.dims);
  bool first = true;
  for (std::size_t i = 0; i < rows.size();) {
    std::size_t j = i + 1;
    while (j < rows.size() && rows[j] == rows[j - 1] + 1) ++j;
    start[0] = static_cast<hsize_t>(rows[i]);
    count[0] = static_cast<hsize_t>(j - i);
    check_h5(H5Sselect_hyperslab(file_space.get(), first ? H5S_SELECT_SET : H5S_SELECT_OR,
                                 start.data(), nullptr, count.data(), nullptr),
             where + ": selecting rows");
    first = false;
    i = j;
  }
  std::vector<hsize_t> memory_dims(column.dims);
  memory_dims[0] = rows.size();
  H5Handle memory_space(H5Screate_simple(static_cast<int>(memory_dims.size()), memory_dims.data(), nullptr),
                        where + ": memory space");
  check_h5(H5Dread(column.dataset.get(), column.memory_type.get(), memory_space.get(),
                   file_space.get(), H5P_DEFAULT, out.data_ptr()),
           where + ": reading " + std::to_string(rows.size()) + " rows");
  return out;
}

}  // namespace

Batch Hdf5Dataset::get_batch(const std::vector<std::int64_t>& indices) {
  const auto rows = static_cast<std::int64_t>(size());
  for (const std::int64_t i : indices) {
    if (i < 0 || i >= rows) {
      throw InternalError("Hdf5Dataset: index " + std::to_string(i) + " outside " +
                          std::to_string(rows) + " rows of " + impl_->path);
    }
  }
  // HDF5 reads a selection in file order: read the distinct rows sorted, then put them in the
  // order asked for.
  std::vector<std::int64_t> sorted(indices);
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  torch::Tensor data, target;
  {
    std::lock_guard<std::mutex> lock(checkpoint::h5_mutex());
    data = read_rows(impl_->data, sorted, impl_->path);
    target = read_rows(impl_->target, sorted, impl_->path);
  }
  std::vector<std::int64_t> positions(indices.size());
  for (std::size_t k = 0; k < indices.size(); ++k) {
    positions[k] = std::lower_bound(sorted.begin(), sorted.end(), indices[k]) - sorted.begin();
  }
  if (positions.size() == sorted.size() && std::is_sorted(indices.begin(), indices.end())) {
    return {data, target};
  }
  const auto order = torch::tensor(positions, torch::kInt64);
  return {data.index_select(0, order), target.index_select(0, order)};
}

}  // namespace hpctrial::trainer
