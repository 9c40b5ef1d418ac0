// TensorBoard event files: what TensorBoard reads from a log directory, written without
// TensorFlow. A file is a sequence of records, each
//   uint64 length | uint32 masked CRC-32C of the length | data | uint32 masked CRC-32C of data
// (little-endian), whose data is one serialized Event (tensorboard/proto/tensorboard.proto).
// No LibTorch: values arrive as numbers and bytes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace hpctrial::tensorboard {

// The masked CRC-32C (Castagnoli) of the record format, ((crc >> 15 | crc << 17) + 0xa282ead8),
// which keeps a CRC of data holding CRCs well spread. The CRC is the checkpoints' (SSE4.2).
std::uint32_t masked_crc32c(std::string_view data);

// The counts of values in buckets, as TensorBoard's histogram dashboard shows them.
struct Histogram {
  double min = 0;
  double max = 0;
  double num = 0;
  double sum = 0;
  double sum_squares = 0;
  std::vector<double> bucket_limit;  // right edges, increasing
  std::vector<double> bucket;        // counts; bucket i is (bucket_limit[i-1], bucket_limit[i]]
};

// `bins` equal buckets from the smallest value to the largest (one bucket when all are equal).
// Non-finite values are left out of every figure. InternalError when bins < 1.
Histogram make_histogram(const std::vector<double>& values, int bins = 64);

// 8-bit pixels, row after row, each pixel `channels` bytes: 1 grey, 3 RGB, 4 RGBA.
struct Image {
  int height = 0;
  int width = 0;
  int channels = 0;
  std::vector<std::uint8_t> pixels;
};

// The image as a PNG file's bytes (libpng). InternalError when its size or channels are wrong.
std::string encode_png(const Image& image);

// One event file of a log directory, named as TensorBoard expects
// (events.out.tfevents.<seconds>.<host>.<pid>.<n>), private (0600), created with its first record
// (the file version) by the constructor, which also makes the directory (0700) but never its
// parent: a trial directory removed under a run is not made again. Records are buffered and
// written whole by flush() and when the buffer fills; a record cut short by a crash is at the end
// of a file, where readers stop. Not thread-safe: one writer per thread. IoError naming the path
// when the directory or the file cannot be made.
class EventWriter {
 public:
  explicit EventWriter(std::string log_dir);
  ~EventWriter();  // flushes; never throws
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;

  void add_scalar(const std::string& tag, double value, std::int64_t step);
  void add_histogram(const std::string& tag, const Histogram& histogram, std::int64_t step);
  void add_image(const std::string& tag, const Image& image, std::int64_t step);
  void add_text(const std::string& tag, const std::string& text, std::int64_t step);
  // TensorBoard drops what earlier files of this directory hold at `step` and after: a resumed
  // run calls it with the first step it will train, so the steps a crashed run trained beyond
  // its checkpoint do not show twice.
  void purge_from(std::int64_t step);
  // Writes the buffered records to the file (not fsync: the records are worth a crash at most).
  // IoError naming the file when the write fails.
  void flush();

  const std::string& log_dir() const { return log_dir_; }
  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& serialized);
  void open();

  std::string log_dir_;
  std::string path_;
  std::string buffer_;
  int fd_ = -1;
};

}  // namespace hpctrial::tensorboard
