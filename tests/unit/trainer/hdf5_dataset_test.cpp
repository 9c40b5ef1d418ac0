#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <hdf5.h>
#include <torch/torch.h>

#include "../../support/temp_dir.h"
#include "hpctrial/core/error.h"
#include "hpctrial/trainer/data.h"

namespace hpctrial::trainer {
namespace hdf5_dataset_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using testing_support::TempDir;

// Writes dataset `name` of `type` with `dims` and `data` into `file`.
void add(hid_t file, const char* name, hid_t file_type, hid_t memory_type, std::vector<hsize_t> dims,
         const void* data) {
  const hid_t space = dims.empty() ? H5Screate(H5S_SCALAR)
                                   : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
  const hid_t set = H5Dcreate2(file, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(set, 0);
  ASSERT_GE(H5Dwrite(set, memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), 0);
  H5Dclose(set);
  H5Sclose(space);
}

// x: 10 x 2 x 3 float32 with x[i] = i * 100 + j; y: int64 = i * 7; u: uint16; s: string.
std::string make_file(const TempDir& dir) {
  const std::string path = (dir.path() / "data.h5").string();
  const hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  std::vector<float> x(60);
  for (int i = 0; i < 10; ++i) for (int j = 0; j < 6; ++j) x[i * 6 + j] = static_cast<float>(i * 100 + j);
  std::vector<std::int64_t> y(10);
  std::vector<std::uint16_t> u(10);
  std::vector<double> short_y(9, 1.0);
  for (int i = 0; i < 10; ++i) y[i] = i * 7, u[i] = static_cast<std::uint16_t>(60000 + i);
  add(file, "x", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {10, 2, 3}, x.data());
  add(file, "y", H5T_STD_I64LE, H5T_NATIVE_INT64, {10}, y.data());
  add(file, "u", H5T_STD_U16LE, H5T_NATIVE_UINT16, {10}, u.data());
  add(file, "short", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, {9}, short_y.data());
  const double scalar = 1.0;
  add(file, "scalar", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, {}, &scalar);
  const hid_t str = H5Tcopy(H5T_C_S1);
  H5Tset_size(str, 4);
  const char text[40] = "abcdefghijklmnopqrstuvwxyz0123456789abc";
  add(file, "s", str, str, {10}, text);
  H5Tclose(str);
  H5Gclose(H5Gcreate2(file, "group", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
  H5Fclose(file);
  return path;
}

std::string error_of(const std::string& path, const std::string& x, const std::string& y) {
  try {
    Hdf5Dataset dataset(path, x, y);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "opened";
}

TEST(Hdf5Dataset, ReadsTheRowsAskedForInTheirOrder) {
  TempDir dir;
  Hdf5Dataset dataset(make_file(dir), "x", "y");
  EXPECT_EQ(dataset.size(), 10u);
  EXPECT_EQ(dataset.sample_shape(), (std::vector<std::int64_t>{2, 3}));
  const Batch batch = dataset.get_batch({7, 2, 3, 9, 2});
  ASSERT_EQ(batch.data.sizes(), (std::vector<std::int64_t>{5, 2, 3}));
  EXPECT_EQ(batch.data.scalar_type(), torch::kFloat32);
  EXPECT_EQ(batch.target.scalar_type(), torch::kInt64);
  const std::vector<std::int64_t> rows = {7, 2, 3, 9, 2};
  for (std::size_t k = 0; k < rows.size(); ++k) {
    EXPECT_EQ(batch.target[static_cast<std::int64_t>(k)].item<std::int64_t>(), rows[k] * 7);
    EXPECT_EQ(batch.data[static_cast<std::int64_t>(k)][1][2].item<float>(), static_cast<float>(rows[k] * 100 + 5));
  }
  const Batch contiguous = dataset.get_batch({4, 5, 6});
  EXPECT_EQ(contiguous.target[2].item<std::int64_t>(), 42);
}

TEST(Hdf5Dataset, UnsignedIntegersWidenToInt64) {
  TempDir dir;
  Hdf5Dataset dataset(make_file(dir), "x", "u");
  const Batch batch = dataset.get_batch({1});
  EXPECT_EQ(batch.target.scalar_type(), torch::kInt64);
  EXPECT_EQ(batch.target[0].item<std::int64_t>(), 60001);
}

TEST(Hdf5Dataset, ProblemsNameTheFileAndTheDataset) {
  TempDir dir;
  const std::string path = make_file(dir);
  EXPECT_EQ(error_of(path, "features", "y"),
            "data file " + path + " has no dataset 'features' (it has: group, s, scalar, short, u, x, "
            "y); name the right one in the experiment's data: section");
  EXPECT_EQ(error_of(path, "x", "s"),
            "data file " + path + ": dataset 's' holds 4-byte string values; Hdf5Dataset reads "
            "float32, float64 and integers up to 64 bits (unsigned up to 32)");
  EXPECT_EQ(error_of(path, "scalar", "y"),
            "data file " + path + ": dataset 'scalar' is a scalar; it needs one row per sample (shape N x ...)");
  EXPECT_EQ(error_of(path, "x", "short"),
            "data file " + path + ": dataset 'x' has 10 rows but 'short' has 9; every sample needs both");
  EXPECT_THAT(error_of(path, "group", "y"), HasSubstr("dataset 'group' cannot be opened as a dataset (is it a group?)"));
  const std::string text = dir.write("text.h5", "not hdf5\n");
  EXPECT_THAT(error_of(text, "x", "y"),
              HasSubstr("data file " + text + " cannot be opened as HDF5: "));
  EXPECT_THAT(error_of(text, "x", "y"), HasSubstr("check the path in the experiment's data: section"));
  EXPECT_THAT(error_of((dir.path() / "missing.h5").string(), "x", "y"), HasSubstr("cannot be opened as HDF5"));
}

TEST(TensorDataset, IndexesRowsAndChecksShapes) {
  TensorDataset dataset(torch::arange(12).view({6, 2}), torch::arange(6));
  const Batch batch = dataset.get_batch({5, 0});
  EXPECT_EQ(batch.target[0].item<std::int64_t>(), 5);
  EXPECT_EQ(batch.data[1][1].item<std::int64_t>(), 1);
  EXPECT_THROW(TensorDataset(torch::ones({3, 2}), torch::ones({4})), ConfigError);
}

// A LibTorch dataset, adapted.
struct Squares : torch::data::datasets::Dataset<Squares> {
  torch::data::Example<> get(std::size_t i) override {
    return {torch::tensor({static_cast<float>(i)}), torch::tensor(static_cast<std::int64_t>(i * i))};
  }
  torch::optional<std::size_t> size() const override { return 5; }
};

TEST(FromTorchDataset, StacksExamples) {
  auto dataset = from_torch_dataset(Squares());
  EXPECT_EQ(dataset->size(), 5u);
  const Batch batch = dataset->get_batch({4, 2});
  EXPECT_EQ(batch.data.sizes(), (std::vector<std::int64_t>{2, 1}));
  EXPECT_EQ(batch.target[0].item<std::int64_t>(), 16);
}

TEST(DataLoader, IteratesTheWholeDatasetInOrder) {
  DataLoader loader(std::make_shared<TensorDataset>(torch::arange(10).view({10, 1}), torch::arange(10)), 4, false);
  std::vector<std::int64_t> seen, sizes;
  for (auto batch : loader) {
    sizes.push_back(batch.target.size(0));
    for (std::int64_t i = 0; i < batch.target.size(0); ++i) seen.push_back(batch.target[i].item<std::int64_t>());
  }
  EXPECT_EQ(sizes, (std::vector<std::int64_t>{4, 4, 2}));
  EXPECT_EQ(seen.size(), 10u);
  EXPECT_EQ(seen.back(), 9);
  EXPECT_THROW(DataLoader(std::shared_ptr<Dataset>(), 4), ConfigError);
  EXPECT_THROW(DataLoader(std::shared_ptr<StreamDataset>(), 4), ConfigError);
  EXPECT_THROW(DataLoader(loader.dataset_ptr(), 0), ConfigError);
}

}  // namespace hdf5_dataset_test
}  // namespace hpctrial::trainer
