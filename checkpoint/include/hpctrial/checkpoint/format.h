// The checkpoint file format (docs/checkpoint-format.md), without LibTorch: buffers, dtypes and
// shapes.
//
// A checkpoint is one HDF5 file of contiguous datasets. Every piece of state is a dataset - a
// tensor in its own dtype, or a text (JSON) as a 1-D uint8 dataset - under a slash-separated
// name ("model/0/fc1.weight", "meta/config"). A manifest (JSON in the dataset "manifest") lists
// every dataset's name, dtype, shape, byte size and CRC-32C; the root attributes carry the
// format name and version and the manifest's own CRC. Readers check the manifest before they
// trust any dataset, and every dataset's CRC when they read it.
//
// write_checkpoint() lays the file's structure out with HDF5 (early allocation, no fill values,
// large datasets aligned to 4 KiB), then writes the raw bytes at each dataset's offset with
// O_DIRECT, fsyncs, and renames the file into place (see store.h for the `latest` pointer).
// read_checkpoint() validates sizes before allocating: a crafted file cannot make it allocate
// more than the file holds.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "hpctrial/core/dtype.h"
#include "hpctrial/core/files.h"

namespace hpctrial::checkpoint {

constexpr int kFormatVersion = 1;
constexpr const char* kFormatName = "hpctrial-checkpoint";

using core::DType;
using core::dtype_from_string;
using core::dtype_size;
using core::to_string;

// Host memory aligned for direct I/O (4 KiB), owned. The usable size is `size()`; the
// allocation is rounded up to whole 4 KiB blocks. Or a view of memory that `keeper` holds (a
// mapping of a copy in node memory), released with the last of its views.
class Buffer {
 public:
  static constexpr std::size_t kAlignment = 4096;
  explicit Buffer(std::size_t size);
  Buffer(std::shared_ptr<const void> keeper, void* data, std::size_t size)
      : data_(data), size_(size), keeper_(std::move(keeper)) {}
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* data() { return data_; }
  const void* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  std::size_t size_ = 0;
  std::shared_ptr<const void> keeper_;
};

// Where the bytes of a dataset read_checkpoint() left in its file are (ReadOptions::leave_unread).
struct InFile {
  std::string path;
  std::uint64_t offset = 0;  // of the dataset's first byte
  std::uint64_t nbytes = 0;
};

struct Dataset {
  std::string name;
  DType dtype = DType::kUInt8;
  std::vector<std::int64_t> shape;  // empty: a scalar
  std::shared_ptr<const Buffer> data;
  std::uint32_t crc32c = 0;  // computed by write_checkpoint, checked by read_checkpoint
  // Set by a producer that computed crc32c of `data` as it filled it (saving the writer a
  // second pass over memory); write_checkpoint then stores crc32c as given.
  bool crc32c_known = false;
  // Set, with `data` null: the bytes are in the file still, read by read_bytes() or bytes_of().
  std::shared_ptr<const InFile> in_file = nullptr;

  std::size_t nbytes() const { return data ? data->size() : in_file ? static_cast<std::size_t>(in_file->nbytes) : 0; }
  // The bytes as text (for uint8 datasets holding JSON or other text); read from the file for a
  // dataset left there.
  std::string text() const;
};

struct Contents {
  std::vector<Dataset> datasets;
  // Small facts (batches, the searcher metric, versions): kept in the manifest, and as root
  // string attributes for other readers. Names: lower-case letters, digits and '_'.
  std::map<std::string, std::string> attributes;

  // Adds `bytes` of `dtype` with `shape` (copied into an aligned buffer).
  void add(const std::string& name, DType dtype, std::vector<std::int64_t> shape, const void* bytes);
  // Adds an existing buffer without copying.
  void add(const std::string& name, DType dtype, std::vector<std::int64_t> shape,
           std::shared_ptr<const Buffer> data);
  void add_text(const std::string& name, std::string_view text);
  const Dataset* find(const std::string& name) const;
  // The dataset `name`, or CheckpointError naming the file and the dataset.
  const Dataset& at(const std::string& name, const std::string& file) const;
};

// Where bytes go: the seam through which the writer's raw data, syncs and renames pass, so that
// tests can inject ENOSPC, EACCES or a crash at any point. HDF5's own metadata writes go
// through HDF5. Calls return what the POSIX call would (-1 and errno on failure).
// The system calls of a save, as a seam for fault-injection tests (core/files.h).
using core::FileSystem;
using core::posix_file_system;

struct WriteOptions {
  mode_t mode = 0600;
  bool direct_io = true;  // O_DIRECT for large datasets, where the filesystem supports it
  FileSystem* fs = nullptr;  // null: posix_file_system()
};

// Writes `contents` to `path` atomically: a temporary ".<name>.tmp" beside it, fsynced, renamed
// into place, the directory fsynced. CheckpointError or IoError (naming the path and errno) on
// failure, with the temporary removed.
void write_checkpoint(const std::string& path, const Contents& contents, const WriteOptions& options = {});

// The temporary name write_checkpoint() uses for `path`.
std::string temporary_path(const std::string& path);

struct ReadOptions {
  bool direct_io = true;
  // The datasets it names, of at least 4 KiB, are left in the file (Dataset::in_file): a reader
  // that needs ranges of them only (a ZeRO-3 rank its parts) need not hold them whole. With
  // `verify_unread` their CRC is checked now, through a buffer of a few MiB.
  std::function<bool(const std::string& name)> leave_unread;
  bool verify_unread = true;
};

// Reads and verifies the whole file: format, manifest, every dataset's shape, size and CRC.
// CheckpointError naming the path and the reason on any problem.
Contents read_checkpoint(const std::string& path, const ReadOptions& options = {});

// Bytes [first, first + size) of `dataset`: from its buffer, or read from its file.
// CheckpointError naming the file and the dataset for a range past its end or a failed read.
void read_bytes(const Dataset& dataset, std::uint64_t first, std::uint64_t size, void* to);
// The bytes of `dataset` whole: its buffer, or read from its file now and checked against its CRC.
std::shared_ptr<const Buffer> bytes_of(const Dataset& dataset);

// Root attributes and the manifest only (no tensor data is read): for listings.
struct Summary {
  int format_version = 0;
  std::string manifest_json;
  std::map<std::string, std::string> attributes;
};
Summary read_summary(const std::string& path);

std::uint32_t crc32c(const void* data, std::size_t size, std::uint32_t crc = 0);
// Copies `size` bytes and returns their CRC-32C (continuing `crc`), reading the source from
// memory once: each piece is checksummed while it is in the cache, and the destination is
// written with streaming stores. For the bytes of a checkpoint taken while training runs.
std::uint32_t copy_crc32c(void* to, const void* from, std::size_t size, std::uint32_t crc = 0);
// The CRC-32C of A followed by B, from crc32c(A), crc32c(B) and B's size: the checksum of a
// dataset from those of its pieces, written by several ranks.
std::uint32_t crc32c_combine(std::uint32_t first, std::uint32_t second, std::uint64_t second_size);

}  // namespace hpctrial::checkpoint
