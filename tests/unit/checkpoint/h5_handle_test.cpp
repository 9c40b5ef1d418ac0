#include "hpctrial/checkpoint/h5_handle.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>

#include "../../support/temp_dir.h"
#include "hpctrial/core/error.h"

namespace hpctrial::checkpoint {
namespace {

using testing::HasSubstr;
using testing_support::TempDir;

class H5HandleTest : public testing::Test {
 protected:
  void SetUp() override { silence_h5_errors(); }
};

TEST_F(H5HandleTest, WritesAndReadsARealFile) {
  TempDir dir;
  const std::string path = (dir.path() / "a.h5").string();
  {
    H5Handle file(H5Fcreate(path.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, H5P_DEFAULT), "create " + path);
    const hsize_t dims[1] = {4};
    H5Handle space(H5Screate_simple(1, dims, nullptr), "dataspace");
    H5Handle dataset(H5Dcreate2(file.get(), "values", H5T_NATIVE_INT64, space.get(), H5P_DEFAULT,
                                H5P_DEFAULT, H5P_DEFAULT),
                     "create dataset");
    const std::int64_t values[4] = {1, -2, 3, 1LL << 40};
    check_h5(H5Dwrite(dataset.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, values),
             "write values");
    dataset.close();
    file.close();
    EXPECT_FALSE(file.valid());
  }
  H5Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), "open " + path);
  H5Handle dataset(H5Dopen2(file.get(), "values", H5P_DEFAULT), "open dataset");
  std::int64_t back[4] = {};
  check_h5(H5Dread(dataset.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, back), "read");
  EXPECT_EQ(back[1], -2);
  EXPECT_EQ(back[3], 1LL << 40);
}

TEST_F(H5HandleTest, FailuresCarryTheHdf5ErrorStack) {
  TempDir dir;
  const std::string path = dir.write("not-hdf5.h5", "this is not an HDF5 file\n");
  try {
    H5Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), "open checkpoint " + path);
    FAIL() << "opened a text file as HDF5";
  } catch (const CheckpointError& e) {
    EXPECT_THAT(e.what(), HasSubstr("open checkpoint " + path + ": "));
    EXPECT_THAT(e.what(), HasSubstr("file signature not found"));
  }
  // The stack was consumed: the next failure reports only its own cause.
  try {
    check_h5_id(H5Gopen2(-1, "x", H5P_DEFAULT), "open group x");
    FAIL();
  } catch (const CheckpointError& e) {
    EXPECT_THAT(e.what(), testing::Not(HasSubstr("signature")));
  }
}

TEST_F(H5HandleTest, MovesTransferOwnership) {
  H5Handle a(H5Screate(H5S_SCALAR), "scalar space");
  const hid_t id = a.get();
  H5Handle b(std::move(a));
  EXPECT_FALSE(a.valid());
  EXPECT_EQ(b.get(), id);
  H5Handle c;
  c = std::move(b);
  EXPECT_EQ(c.get(), id);
  EXPECT_GT(H5Iis_valid(id), 0);
  c = H5Handle();
  EXPECT_LE(H5Iis_valid(id), 0) << "the identifier was not closed";
}

}  // namespace
}  // namespace hpctrial::checkpoint
