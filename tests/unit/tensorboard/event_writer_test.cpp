#include "hpctrial/tensorboard/event_writer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <png.h>
#include <sys/stat.h>

#include <fstream>

#include "../../support/event_files.h"
#include "../../support/read_file.h"
#include "../../support/temp_dir.h"
#include "hpctrial/core/error.h"

namespace hpctrial::tensorboard {
namespace {

using testing_support::event_files;
using testing_support::read_events;
using testing_support::read_file;
using testing_support::TempDir;

// Decodes a PNG with libpng's own reader, into 8-bit pixels of the image's channels.
Image decode_png(const std::string& bytes, int channels) {
  png_image png{};
  png.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&png, bytes.data(), bytes.size())) return {};
  png.format = channels == 1 ? PNG_FORMAT_GRAY : channels == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_RGBA;
  Image image;
  image.height = static_cast<int>(png.height);
  image.width = static_cast<int>(png.width);
  image.channels = channels;
  image.pixels.resize(PNG_IMAGE_SIZE(png));
  if (!png_image_finish_read(&png, nullptr, image.pixels.data(), 0, nullptr)) return {};
  return image;
}

std::string base64_decode(const std::string& text) {
  static const std::string alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  int bits = 0, value = 0;
  for (const char c : text) {
    const auto at = alphabet.find(c);
    if (at == std::string::npos) break;
    value = (value << 6) | static_cast<int>(at);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((value >> bits) & 0xff));
    }
  }
  return out;
}

TEST(MaskedCrc32c, MasksTheCastagnoliCrc) {
  // CRC-32C("123456789") is 0xe3069283 (the CRC catalogue's check value).
  const std::uint32_t crc = 0xe3069283u;
  EXPECT_EQ(masked_crc32c("123456789"), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
  EXPECT_EQ(masked_crc32c(""), 0xa282ead8u);
}

TEST(Histogram, CountsEachValueOnceWithEdgesInTheLowerBucket) {
  const Histogram h = make_histogram({0.0, 1.0, 2.0, 3.0, 4.0, std::nan(""), 4.0}, 4);
  EXPECT_EQ(h.num, 6);
  EXPECT_DOUBLE_EQ(h.min, 0.0);
  EXPECT_DOUBLE_EQ(h.max, 4.0);
  EXPECT_DOUBLE_EQ(h.sum, 14.0);
  EXPECT_DOUBLE_EQ(h.sum_squares, 46.0);
  EXPECT_EQ(h.bucket_limit, (std::vector<double>{1, 2, 3, 4}));
  // (-inf, 1] holds 0 and 1; (1, 2] holds 2; (2, 3] holds 3; (3, 4] holds both 4s.
  EXPECT_EQ(h.bucket, (std::vector<double>{2, 1, 1, 2}));

  const Histogram same = make_histogram({5.0, 5.0, 5.0}, 10);
  EXPECT_EQ(same.bucket_limit, std::vector<double>{5.0});
  EXPECT_EQ(same.bucket, std::vector<double>{3.0});
  EXPECT_EQ(make_histogram({}, 10).num, 0);
  EXPECT_THROW(make_histogram({1.0}, 0), InternalError);
}

TEST(Png, EncodesWhatLibpngDecodes) {
  Image image{2, 3, 3, {}};
  for (int i = 0; i < 18; ++i) image.pixels.push_back(static_cast<std::uint8_t>(i * 14));
  const std::string png = encode_png(image);
  ASSERT_GT(png.size(), 8u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  const Image back = decode_png(png, 3);
  EXPECT_EQ(back.height, 2);
  EXPECT_EQ(back.width, 3);
  EXPECT_EQ(back.pixels, image.pixels);

  EXPECT_THROW(encode_png(Image{2, 2, 2, std::vector<std::uint8_t>(8)}), InternalError);
  EXPECT_THROW(encode_png(Image{2, 2, 3, std::vector<std::uint8_t>(5)}), InternalError);
}

TEST(EventWriter, WritesRecordsThatTensorBoardsFormatReadsBack) {
  TempDir dir;
  const std::string log_dir = (dir.path() / "tb").string();
  Image image{4, 5, 1, {}};
  for (int i = 0; i < 20; ++i) image.pixels.push_back(static_cast<std::uint8_t>(i * 12));
  {
    EventWriter writer(log_dir);
    EXPECT_TRUE(std::filesystem::exists(writer.path())) << "made with its first record";
    writer.purge_from(7);
    writer.add_scalar("training/loss", 0.25, 7);
    writer.add_scalar("training/loss", 0.125, 8);
    writer.add_histogram("weights", make_histogram({1, 2, 3, 4}, 2), 8);
    writer.add_image("digits", image, 9);
    writer.add_text("notes", "learning rate 0.1", 9);
  }
  const auto files = event_files(log_dir);
  ASSERT_EQ(files.size(), 1u);
  struct stat st{};
  ASSERT_EQ(::stat(files[0].c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(::stat(log_dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);

  const auto read = read_events(files);
  ASSERT_TRUE(read.ok) << read.error;
  ASSERT_EQ(read.events.size(), 7u);
  EXPECT_EQ(read.events[0]["file_version"], "brain.Event:2");
  EXPECT_EQ(read.events[1]["session_log"], "START");
  EXPECT_EQ(read.events[1]["step"], 7);
  EXPECT_EQ(testing_support::scalars(read.events, "training/loss"),
            (std::vector<std::pair<std::int64_t, double>>{{7, 0.25}, {8, 0.125}}));
  const auto& histogram = read.events[4]["values"][0]["histogram"];
  EXPECT_EQ(histogram["num"], 4);
  EXPECT_EQ(histogram["sum"], 10);
  EXPECT_EQ(histogram["sum_squares"], 30);
  EXPECT_EQ(histogram["bucket_limit"], nlohmann::json({2.5, 4.0}));
  EXPECT_EQ(histogram["bucket"], nlohmann::json({2.0, 2.0}));
  const auto& png = read.events[5]["values"][0]["image"];
  EXPECT_EQ(png["height"], 4);
  EXPECT_EQ(png["width"], 5);
  EXPECT_EQ(png["colorspace"], 1);
  EXPECT_EQ(decode_png(base64_decode(png["png"]), 1).pixels, image.pixels);
  const auto& text = read.events[6]["values"][0];
  EXPECT_EQ(text["tag"], "notes");
  EXPECT_EQ(text["text"], nlohmann::json({"learning rate 0.1"}));
  EXPECT_EQ(text["plugin"], "text");
  EXPECT_EQ(text["dtype"], 7);
  const double now = static_cast<double>(std::time(nullptr));
  for (const auto& e : read.events) EXPECT_NEAR(e["wall_time"].get<double>(), now, 120.0);
}

TEST(EventWriter, BuffersUntilFlushAndEachWriterHasItsOwnFile) {
  TempDir dir;
  EventWriter first(dir.path().string());
  EventWriter second(dir.path().string());
  first.add_scalar("a", 1, 1);
  second.add_scalar("a", 2, 1);
  EXPECT_NE(first.path(), second.path());
  const auto before = std::filesystem::file_size(first.path());
  first.flush();
  EXPECT_GT(std::filesystem::file_size(first.path()), before);
  // Many records: written as the buffer fills, without a flush.
  for (int i = 0; i < 5000; ++i) second.add_scalar("b", i, i);
  EXPECT_GT(std::filesystem::file_size(second.path()), 32768u);
}

TEST(EventWriter, MakesItsFolderButNeverTheFolderAboveIt) {
  TempDir dir;
  const auto gone = dir.path() / "trial-0";  // a trial directory removed under a run
  try {
    EventWriter writer((gone / "tensorboard").string());
    FAIL() << "made " << writer.path();
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("cannot create the TensorBoard folder " + (gone / "tensorboard").string()));
  }
  EXPECT_FALSE(std::filesystem::exists(gone));
}

TEST(EventWriter, ACorruptedRecordIsCaughtByTheReader) {
  TempDir dir;
  std::string path;
  {
    EventWriter writer(dir.path().string());
    writer.add_scalar("loss", 1.5, 3);
    path = writer.path();
  }
  std::string bytes = read_file(path);
  bytes[bytes.size() - 6] ^= 0x40;  // inside the last record's data
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  const auto read = read_events({path});
  EXPECT_FALSE(read.ok);
  EXPECT_NE(read.error.find("data CRC of the record at offset"), std::string::npos) << read.error;
}

}  // namespace
}  // namespace hpctrial::tensorboard
