// The checkpoint file: every dtype round-trips, files are private, damage of any kind is found
// and reported with the path and the dataset, and crafted files cannot make the reader allocate
// what the file does not hold.
#include <sys/stat.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <hdf5.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <vector>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>

#include "../../support/temp_dir.h"
#include "hpctrial/checkpoint/format.h"
#include "hpctrial/checkpoint/h5_handle.h"
#include "hpctrial/core/error.h"

namespace hpctrial::checkpoint {
namespace {

using testing::HasSubstr;
using testing_support::TempDir;

Contents sample() {
  Contents c;
  std::vector<float> big(300001);  // > 4 KiB and not a whole number of blocks
  std::iota(big.begin(), big.end(), 0.5f);
  c.add("model/0/fc1.weight", DType::kFloat32, {300001}, big.data());
  const double d[] = {1.5, -2.25};
  c.add("model/0/scale", DType::kFloat64, {2}, d);
  const std::uint16_t h[] = {0x3c00, 0xc000, 0x7bff};
  c.add("model/0/half", DType::kFloat16, {3}, h);
  c.add("model/0/bf", DType::kBFloat16, {3}, h);
  const std::int64_t i64 = -7;
  c.add("optimizer/0/step", DType::kInt64, {}, &i64);  // a scalar
  const std::int32_t i32[] = {1, 2, 3, 4, 5, 6};
  c.add("x/i32", DType::kInt32, {2, 3}, i32);
  const std::int16_t i16 = 3;
  c.add("x/i16", DType::kInt16, {1}, &i16);
  const std::int8_t i8 = -3;
  c.add("x/i8", DType::kInt8, {1}, &i8);
  const bool flags[] = {true, false};
  c.add("x/bool", DType::kBool, {2}, flags);
  c.add("x/empty", DType::kFloat32, {0, 4}, nullptr);
  c.add_text("meta/config", "name: test\n");
  c.attributes["batches"] = "120";
  c.attributes["searcher_metric"] = "0.25";
  return c;
}

TEST(CheckpointFormat, EveryDtypeAndShapeRoundTrips) {
  TempDir dir;
  const std::string path = (dir.path() / "ckpt-120.h5").string();
  const Contents written = sample();
  write_checkpoint(path, written);
  EXPECT_FALSE(std::filesystem::exists(temporary_path(path)));
  const Contents read = read_checkpoint(path);
  ASSERT_EQ(read.datasets.size(), written.datasets.size());
  for (const auto& w : written.datasets) {
    const Dataset& r = read.at(w.name, path);
    EXPECT_EQ(r.dtype, w.dtype) << w.name;
    EXPECT_EQ(r.shape, w.shape) << w.name;
    ASSERT_EQ(r.nbytes(), w.nbytes()) << w.name;
    EXPECT_EQ(std::memcmp(r.data->data(), w.data->data(), w.nbytes()), 0) << w.name;
  }
  EXPECT_EQ(read.at("meta/config", path).text(), "name: test\n");
  EXPECT_EQ(read.attributes, written.attributes);
  const Summary summary = read_summary(path);
  EXPECT_EQ(summary.format_version, kFormatVersion);
  EXPECT_EQ(summary.attributes.at("batches"), "120");
  EXPECT_THAT(summary.manifest_json, HasSubstr("\"name\":\"model/0/fc1.weight\""));
}

// The reader thread and the thread that prepares buffers ahead of it must never touch the same
// dataset at once: many small datasets, read again and again, always verify.

// A checksum the producer computed while filling the buffer is stored as given: right, the file
// reads back; wrong (the buffer changed after it was computed), the damage is found on reading.
TEST(Crc32c, PiecesCombineIntoTheWhole) {
  // Any split of any buffer: the pieces' CRCs combine into the whole's.
  std::vector<unsigned char> bytes(100'003);
  std::uint32_t state = 12345;
  for (auto& b : bytes) b = static_cast<unsigned char>((state = state * 1103515245u + 12345u) >> 24);
  const std::uint32_t whole = crc32c(bytes.data(), bytes.size());
  for (std::size_t split : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4096}, std::size_t{65537},
                            bytes.size() - 1, bytes.size()}) {
    const std::uint32_t a = crc32c(bytes.data(), split);
    const std::uint32_t b = crc32c(bytes.data() + split, bytes.size() - split);
    EXPECT_EQ(crc32c_combine(a, b, bytes.size() - split), whole) << "split at " << split;
  }
  // Three pieces, combined left to right, as a dataset written by three ranks.
  const std::size_t p1 = 33'333, p2 = 66'666;
  std::uint32_t crc = crc32c(bytes.data(), p1);
  crc = crc32c_combine(crc, crc32c(bytes.data() + p1, p2 - p1), p2 - p1);
  crc = crc32c_combine(crc, crc32c(bytes.data() + p2, bytes.size() - p2), bytes.size() - p2);
  EXPECT_EQ(crc, whole);
}

TEST(CheckpointFormat, AChecksumComputedWhileCopyingIsStoredAsGiven) {
  TempDir dir;
  Contents c = sample();
  Dataset& big = c.datasets.front();
  big.crc32c = crc32c(big.data->data(), big.nbytes());
  big.crc32c_known = true;
  const std::string good = (dir.path() / "ckpt-1.h5").string();
  write_checkpoint(good, c);
  EXPECT_EQ(read_checkpoint(good).at("model/0/fc1.weight", good).crc32c, big.crc32c);

  big.crc32c ^= 1;
  const std::string bad = (dir.path() / "ckpt-2.h5").string();
  write_checkpoint(bad, c);
  try {
    read_checkpoint(bad);
    ADD_FAILURE() << "a stale checksum went unnoticed";
  } catch (const CheckpointError& e) {
    EXPECT_THAT(e.what(), HasSubstr("model/0/fc1.weight"));
  }
}

TEST(CheckpointFormat, ManySmallDatasetsReadBackIntactEveryTime) {
  TempDir dir;
  Contents c;
  for (int i = 0; i < 300; ++i) {
    std::vector<float> values(2048 + i, static_cast<float>(i) + 0.25f);
    c.add("model/0/t" + std::to_string(i), DType::kFloat32, {static_cast<std::int64_t>(values.size())}, values.data());
  }
  const std::string path = (dir.path() / "ckpt-1.h5").string();
  write_checkpoint(path, c);
  for (int round = 0; round < 40; ++round) {
    ReadOptions options;
    options.direct_io = round % 2 == 0;  // from the page cache, the reader thread runs far ahead
    const Contents read = read_checkpoint(path, options);
    ASSERT_EQ(read.datasets.size(), 300u);
    const auto* last = static_cast<const float*>(read.at("model/0/t299", path).data->data());
    ASSERT_EQ(last[2048 + 298], 299.25f);
  }
}

TEST(CheckpointFormat, BufferedWritesAndReadsGiveTheSameFile) {
  TempDir dir;
  const std::string direct = (dir.path() / "direct.h5").string(), buffered = (dir.path() / "buffered.h5").string();
  write_checkpoint(direct, sample());
  WriteOptions options;
  options.direct_io = false;
  write_checkpoint(buffered, sample(), options);
  ReadOptions read;
  read.direct_io = false;
  const Contents a = read_checkpoint(direct, read), b = read_checkpoint(buffered);
  EXPECT_EQ(std::memcmp(a.at("model/0/fc1.weight", direct).data->data(), b.at("model/0/fc1.weight", buffered).data->data(),
                        300001 * 4),
            0);
}

TEST(CheckpointFormat, FilesArePrivateWhateverTheUmask) {
  TempDir dir;
  const mode_t old = ::umask(0);
  const std::string path = (dir.path() / "ckpt-1.h5").string();
  write_checkpoint(path, sample());
  ::umask(old);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  WriteOptions group;
  group.mode = 0640;
  write_checkpoint(path, sample(), group);
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
}

// Flips one byte at `offset` (from the end when negative).
void flip_byte(const std::string& path, long offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(0, std::ios::end);
  const long size = static_cast<long>(f.tellg());
  const long at = offset < 0 ? size + offset : offset;
  f.seekg(at);
  char c;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(at);
  f.write(&c, 1);
}

// Where the raw bytes of dataset `name` start in the file.
long offset_of(const std::string& path, const std::string& name) {
  H5Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), path);
  H5Handle set(H5Dopen2(file.get(), name.c_str(), H5P_DEFAULT), name);
  return static_cast<long>(H5Dget_offset(set.get()));
}

std::string error_reading(const std::string& path) {
  try {
    read_checkpoint(path);
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "read without error";
}

TEST(CheckpointFormat, AFlippedByteInDataIsFoundAndNamed) {
  TempDir dir;
  const std::string path = (dir.path() / "ckpt-5.h5").string();
  write_checkpoint(path, sample());
  flip_byte(path, offset_of(path, "model/0/fc1.weight") + 1000);
  EXPECT_THAT(error_reading(path), HasSubstr(path + ": dataset model/0/fc1.weight is corrupt: its CRC-32C is"));
  write_checkpoint(path, sample());
  flip_byte(path, offset_of(path, "model/0/scale") + 3);  // a small dataset, read through HDF5
  EXPECT_THAT(error_reading(path), HasSubstr("dataset model/0/scale is corrupt"));
  write_checkpoint(path, sample());
  flip_byte(path, offset_of(path, "manifest") + 10);
  EXPECT_THAT(error_reading(path), HasSubstr("the manifest is corrupt"));
}

// A reader that needs ranges of the large datasets only (a ZeRO-3 rank, its parts) leaves them in
// the file: they are checked all the same (or, asked not to, left to the reader that did), and
// their ranges and whole bytes read later are what was written.
TEST(CheckpointFormat, DatasetsLeftInTheFileAreCheckedAndReadByRange) {
  TempDir dir;
  const std::string path = (dir.path() / "ckpt-5.h5").string();
  write_checkpoint(path, sample());
  ReadOptions options;
  options.leave_unread = [](const std::string& name) { return name.rfind("model/", 0) == 0; };
  const Contents c = read_checkpoint(path, options);
  const Dataset& big = c.at("model/0/fc1.weight", path);
  ASSERT_EQ(big.data, nullptr);
  ASSERT_NE(big.in_file, nullptr);
  EXPECT_EQ(big.nbytes(), 300001u * 4);
  EXPECT_EQ(big.in_file->path, path);
  // Small datasets are read as ever (a leave_unread dataset needs 4 KiB at least).
  ASSERT_NE(c.at("model/0/scale", path).data, nullptr);
  std::vector<float> range(1000);
  read_bytes(big, 4 * 299001, 4 * 1000, range.data());
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(range[i], 299001.5f + static_cast<float>(i)) << i;
  EXPECT_THROW(read_bytes(big, 4 * 299001, 4 * 1001, range.data()), CheckpointError);
  read_bytes(big, big.nbytes(), 0, range.data());  // an empty range at the end
  const auto whole = bytes_of(big);
  ASSERT_EQ(whole->size(), big.nbytes());
  EXPECT_EQ(static_cast<const float*>(whole->data())[300000], 300000.5f);
  // A range of a dataset in memory reads the same.
  const Contents in_memory = read_checkpoint(path);
  read_bytes(in_memory.at("model/0/fc1.weight", path), 4 * 7, 4, range.data());
  EXPECT_EQ(range[0], 7.5f);

  // Damage in a dataset left in the file is found when it is read, or by bytes_of later.
  flip_byte(path, offset_of(path, "model/0/fc1.weight") + 4 * 200000 + 1);
  try {
    read_checkpoint(path, options);
    ADD_FAILURE() << "a damaged dataset left in the file was not checked";
  } catch (const CheckpointError& e) {
    EXPECT_THAT(e.what(), HasSubstr(path + ": dataset model/0/fc1.weight is corrupt: its CRC-32C is"));
  }
  options.verify_unread = false;
  const Contents unchecked = read_checkpoint(path, options);
  try {
    bytes_of(unchecked.at("model/0/fc1.weight", path));
    ADD_FAILURE() << "bytes_of took a damaged dataset";
  } catch (const CheckpointError& e) {
    EXPECT_THAT(e.what(), HasSubstr(path + ": dataset model/0/fc1.weight is corrupt"));
  }
}

// Runs `read` in a thread of its own and fails the test, ending the process, if it has not
// returned within a minute: a reader that waits forever on an error path hangs every resume.
std::string without_hang(const std::function<std::string()>& read) {
  auto result = std::async(std::launch::async, read);
  if (result.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    ADD_FAILURE() << "the read did not return within 60 s";
    std::fflush(nullptr);
    std::_Exit(1);  // the stuck thread cannot be joined
  }
  return result.get();
}

// Many large datasets, so that the reader thread runs ahead of the checksums while this thread
// fails on an early one: every error path of the handoff between them, again and again.
TEST(CheckpointFormat, DamagedFilesFailEveryTimeWithoutAHang) {
  TempDir dir;
  Contents c;
  for (int i = 0; i < 12; ++i) {
    std::vector<float> values(64 * 1024 + 7 * i, static_cast<float>(i));
    c.add("model/0/t" + std::to_string(i), DType::kFloat32, {static_cast<std::int64_t>(values.size())}, values.data());
  }
  const std::string flipped = (dir.path() / "ckpt-1.h5").string();
  write_checkpoint(flipped, c);
  flip_byte(flipped, offset_of(flipped, "model/0/t0") + 1000);
  const std::string truncated = (dir.path() / "ckpt-2.h5").string();
  write_checkpoint(truncated, c);
  std::filesystem::resize_file(truncated, static_cast<std::uintmax_t>(offset_of(truncated, "model/0/t3") + 100));
  for (int round = 0; round < 200; ++round) {
    ReadOptions options;
    options.direct_io = round % 2 == 0;
    const auto attempt = [&](const std::string& path) {
      return without_hang([&] {
        try {
          read_checkpoint(path, options);
        } catch (const CheckpointError& e) {
          return std::string(e.what());
        }
        return std::string("read without error");
      });
    };
    ASSERT_THAT(attempt(flipped), HasSubstr(flipped + ": dataset model/0/t0 is corrupt")) << "round " << round;
    ASSERT_THAT(attempt(truncated), HasSubstr(truncated + ": ")) << "round " << round;
  }
}

TEST(CheckpointFormat, TruncatedAndForeignFilesAreReported) {
  TempDir dir;
  const std::string path = (dir.path() / "ckpt-5.h5").string();
  write_checkpoint(path, sample());
  const auto size = std::filesystem::file_size(path);
  for (auto keep : {size / 2, size - 10, std::uintmax_t{100}, std::uintmax_t{0}}) {
    write_checkpoint(path, sample());
    std::filesystem::resize_file(path, keep);
    const std::string error = error_reading(path);
    EXPECT_THAT(error, HasSubstr(path + ": ")) << keep;
    EXPECT_NE(error, "read without error") << keep;
  }
  EXPECT_THAT(error_reading(dir.write("text.h5", "not hdf5 at all")), HasSubstr("not a readable HDF5 file"));
  EXPECT_THAT(error_reading((dir.path() / "missing.h5").string()), HasSubstr("cannot read it: No such file"));
  // An HDF5 file that is not a checkpoint.
  const std::string other = (dir.path() / "other.h5").string();
  H5Fclose(H5Fcreate(other.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
  EXPECT_THAT(error_reading(other), HasSubstr("attribute 'format' is missing"));
}

// A file with the given manifest text (its CRC correct) and one real dataset "a" of 4 floats.
std::string crafted(const TempDir& dir, const std::string& manifest, const std::string& format = kFormatName,
                    std::uint64_t version = kFormatVersion) {
  const std::string path = (dir.path() / "crafted.h5").string();
  H5Handle file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), path);
  const hsize_t four = 4, n = manifest.size();
  H5Handle space(H5Screate_simple(1, &four, nullptr), "space");
  H5Handle set(H5Dcreate2(file.get(), "a", H5T_IEEE_F32LE, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), "a");
  const float values[4] = {1, 2, 3, 4};
  H5Dwrite(set.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, values);
  H5Handle mspace(H5Screate_simple(1, &n, nullptr), "space");
  H5Handle mset(H5Dcreate2(file.get(), "manifest", H5T_STD_U8LE, mspace.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), "m");
  H5Dwrite(mset.get(), H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, manifest.data());
  auto attribute = [&](const char* name, hid_t type, const void* value) {
    H5Handle s(H5Screate(H5S_SCALAR), "s");
    H5Handle a(H5Acreate2(file.get(), name, type, s.get(), H5P_DEFAULT, H5P_DEFAULT), name);
    H5Awrite(a.get(), type, value);
  };
  H5Handle string_type(H5Tcopy(H5T_C_S1), "t");
  H5Tset_size(string_type.get(), format.size());
  attribute("format", string_type.get(), format.data());
  attribute("format_version", H5T_NATIVE_UINT64, &version);
  const std::uint64_t crc = crc32c(manifest.data(), manifest.size());
  attribute("manifest_crc32c", H5T_NATIVE_UINT64, &crc);
  return path;
}

std::string entry(const std::string& shape, const std::string& dtype = "float32", const std::string& nbytes = "16",
                  const std::string& name = "a") {
  return R"({"format":"hpctrial-checkpoint","format_version":1,"datasets":[{"name":")" + name + R"(","dtype":")" +
         dtype + R"(","shape":)" + shape + R"(,"nbytes":)" + nbytes + R"(,"crc32c":0}]})";
}

TEST(CheckpointFormat, CraftedManifestsAreRefusedBeforeAnyAllocation) {
  TempDir dir;
  EXPECT_THAT(error_reading(crafted(dir, entry("[1099511627776,1099511627776]", "float32", "0"))),
              HasSubstr("dataset a: its size overflows"));
  EXPECT_THAT(error_reading(crafted(dir, entry("[-4]"))), HasSubstr("dataset a: a dimension is negative or absurd"));
  EXPECT_THAT(error_reading(crafted(dir, entry("[268435456]", "float32", "1073741824"))),
              HasSubstr("the datasets declare more bytes (1073741824) than the file holds"));
  EXPECT_THAT(error_reading(crafted(dir, entry("[4]", "complex128"))), HasSubstr("dataset a: unknown dtype 'complex128'"));
  EXPECT_THAT(error_reading(crafted(dir, entry("[4]", "float32", "17"))),
              HasSubstr("dataset a: its byte size does not match its shape"));
  EXPECT_THAT(error_reading(crafted(dir, entry("[2,2]"))), HasSubstr("its shape in the file differs from the manifest"));
  EXPECT_THAT(error_reading(crafted(dir, entry("[2]", "float64"))), HasSubstr("differs from the manifest"));
  EXPECT_THAT(error_reading(crafted(dir, entry("[4]", "float32", "16", "b"))),
              HasSubstr("dataset b: listed in the manifest but missing"));
  EXPECT_THAT(error_reading(crafted(dir, entry("[4]", "float32", "16", "../etc/passwd"))),
              HasSubstr("the manifest names an invalid dataset"));
  EXPECT_THAT(error_reading(crafted(dir, "{not json")), HasSubstr("the manifest is not valid JSON"));
  EXPECT_THAT(error_reading(crafted(dir, entry("[4]"), "something-else")), HasSubstr("not an hpctrial checkpoint"));
  EXPECT_THAT(error_reading(crafted(dir, entry("[4]"), kFormatName, 99)),
              HasSubstr("written in checkpoint format 99, newer than this hpctrial reads"));
  // The real dataset with a wrong checksum: found when read.
  EXPECT_THAT(error_reading(crafted(dir, entry("[4]"))), HasSubstr("dataset a is corrupt"));
}

TEST(Crc32c, MatchesTheStandardCheckValue) {
  const char* text = "123456789";
  EXPECT_EQ(crc32c(text, 9), 0xe3069283u);
  EXPECT_EQ(crc32c(text + 4, 5, crc32c(text, 4)), 0xe3069283u);  // incremental
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
}

// The bitwise definition: what the three-lane hardware path and the table must both agree with.
std::uint32_t crc32c_bitwise(const unsigned char* p, std::size_t n) {
  std::uint32_t crc = ~0u;
  for (std::size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc & 1) ? (crc >> 1) ^ 0x82f63b78u : crc >> 1;
  }
  return ~crc;
}

TEST(Crc32c, EveryLengthAndAlignmentMatchesTheDefinition) {
  std::vector<unsigned char> bytes(3 * 4096 * 2 + 3 * 256 + 100);
  std::uint32_t x = 12345;
  for (auto& b : bytes) b = static_cast<unsigned char>((x = x * 1103515245u + 12345u) >> 16);
  // Lengths around the lane sizes (3 x 256, 3 x 4096) and every alignment of the start.
  for (std::size_t length : {0, 1, 7, 8, 9, 767, 768, 769, 1000, 12287, 12288, 12289, 24576 + 768 + 13}) {
    for (std::size_t start = 0; start < 9; ++start) {
      ASSERT_LE(start + length, bytes.size());
      EXPECT_EQ(crc32c(bytes.data() + start, length), crc32c_bitwise(bytes.data() + start, length))
          << "length " << length << " from byte " << start;
    }
  }
}

TEST(Crc32c, CopyChecksumsWhatItCopies) {
  std::vector<unsigned char> from((std::size_t{1} << 18) + 77), to(from.size() + 32, 0xee);
  std::uint32_t x = 7;
  for (auto& b : from) b = static_cast<unsigned char>((x = x * 1103515245u + 12345u) >> 16);
  for (std::size_t offset : {0, 3, 16}) {  // destinations aligned and not
    std::fill(to.begin(), to.end(), 0xee);
    const std::uint32_t crc = copy_crc32c(to.data() + offset, from.data(), from.size(), 0);
    EXPECT_EQ(crc, crc32c(from.data(), from.size())) << "offset " << offset;
    EXPECT_TRUE(std::equal(from.begin(), from.end(), to.begin() + static_cast<std::ptrdiff_t>(offset))) << "offset " << offset;
    EXPECT_EQ(to[offset + from.size()], 0xee) << "nothing is written past the end";
    // Continuing a CRC, as the writer does piece by piece.
    const std::uint32_t first = crc32c(from.data(), 1000);
    EXPECT_EQ(copy_crc32c(to.data() + offset, from.data() + 1000, from.size() - 1000, first), crc);
  }
  EXPECT_EQ(copy_crc32c(nullptr, nullptr, 0, 5u), 5u) << "nothing to copy: the CRC goes on unchanged";
}

}  // namespace
}  // namespace hpctrial::checkpoint
