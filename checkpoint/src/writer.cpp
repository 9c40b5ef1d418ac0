#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>

#include "h5_types.h"
#include "hpctrial/checkpoint/format.h"
#include "hpctrial/core/error.h"

namespace hpctrial::checkpoint {
namespace {

using detail::kMaxIo;
using detail::kRawThreshold;

// A descriptor opened through the FileSystem seam, closed on scope exit.
class SeamFd {
 public:
  SeamFd(FileSystem& fs, int fd) : fs_(fs), fd_(fd) {}
  ~SeamFd() {
    if (fd_ >= 0) fs_.close(fd_);
  }
  SeamFd(const SeamFd&) = delete;
  SeamFd& operator=(const SeamFd&) = delete;
  int get() const { return fd_; }
  void close(const std::string& path) {
    const int fd = fd_;
    fd_ = -1;
    if (fs_.close(fd) != 0) core::throw_errno("cannot close " + path, errno);
  }

 private:
  FileSystem& fs_;
  int fd_;
};

void write_all(FileSystem& fs, int fd, const char* data, std::size_t size, off_t offset, const std::string& path) {
  while (size > 0) {
    const ssize_t n = fs.pwrite(fd, data, std::min(size, kMaxIo), offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      core::throw_errno("cannot write " + path, errno);
    }
    if (n == 0) throw IoError("cannot write " + path + ": the write made no progress");
    data += n;
    size -= static_cast<std::size_t>(n);
    offset += n;
  }
}

struct Placed {
  const Dataset* dataset;
  haddr_t offset;
};

// Lays out the file with HDF5: every dataset allocated at creation, small ones written, large
// ones left for the raw pass. Returns where the large ones are.
std::vector<Placed> lay_out(const std::string& temp, const Contents& contents, const std::string& manifest,
                            std::uint32_t manifest_crc) {
  std::lock_guard<std::mutex> lock(h5_mutex());
  silence_h5_errors();
  H5Handle fapl(H5Pcreate(H5P_FILE_ACCESS), "H5Pcreate");
  check_h5(H5Pset_alignment(fapl.get(), kRawThreshold, Buffer::kAlignment), "H5Pset_alignment");
  H5Handle file(H5Fcreate(temp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), "creating " + temp);
  H5Handle lcpl(H5Pcreate(H5P_LINK_CREATE), "H5Pcreate");
  check_h5(H5Pset_create_intermediate_group(lcpl.get(), 1), "H5Pset_create_intermediate_group");
  H5Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), "H5Pcreate");
  check_h5(H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS), "H5Pset_layout");
  check_h5(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY), "H5Pset_alloc_time");
  check_h5(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER), "H5Pset_fill_time");

  std::vector<Placed> raw;
  auto create = [&](const Dataset& d) {
    H5Handle type = detail::file_type(d.dtype);
    std::vector<hsize_t> dims(d.shape.begin(), d.shape.end());
    H5Handle space(d.shape.empty() ? H5Screate(H5S_SCALAR)
                                   : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                   "H5Screate");
    H5Handle set(H5Dcreate2(file.get(), d.name.c_str(), type.get(), space.get(), lcpl.get(), dcpl.get(), H5P_DEFAULT),
                 "creating dataset " + d.name + " in " + temp);
    detail::write_string_attribute(set.get(), "dtype", to_string(d.dtype));
    if (d.nbytes() == 0) return;
    if (d.nbytes() >= kRawThreshold) {
      const haddr_t offset = H5Dget_offset(set.get());
      if (offset != HADDR_UNDEF) {
        raw.push_back({&d, offset});
        return;
      }
    }
    check_h5(H5Dwrite(set.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, d.data->data()),
             "writing dataset " + d.name + " to " + temp);
  };
  for (const auto& d : contents.datasets) create(d);
  Dataset manifest_set{"manifest", DType::kUInt8, {static_cast<std::int64_t>(manifest.size())}, nullptr, manifest_crc};
  auto manifest_buffer = std::make_shared<Buffer>(manifest.size());
  std::memcpy(manifest_buffer->data(), manifest.data(), manifest.size());
  manifest_set.data = manifest_buffer;
  create(manifest_set);
  if (!raw.empty() && raw.back().dataset == &manifest_set) {
    // The manifest is written by HDF5 here: its Dataset does not outlive this function.
    raw.pop_back();
    H5Handle set(H5Dopen2(file.get(), "manifest", H5P_DEFAULT), "opening the manifest");
    check_h5(H5Dwrite(set.get(), H5T_STD_U8LE, H5S_ALL, H5S_ALL, H5P_DEFAULT, manifest.data()), "writing the manifest");
  }
  for (const auto& [key, value] : contents.attributes) detail::write_string_attribute(file.get(), key.c_str(), value);
  detail::write_string_attribute(file.get(), "format", kFormatName);
  detail::write_uint_attribute(file.get(), "format_version", kFormatVersion);
  detail::write_uint_attribute(file.get(), "manifest_crc32c", manifest_crc);
  file.close();
  return raw;
}

// Writes the large datasets' bytes at their offsets: whole 4 KiB blocks with O_DIRECT (when the
// filesystem takes it), the tail through the page cache.
void write_raw(FileSystem& fs, const std::string& temp, const std::vector<Placed>& raw, bool direct_io) {
  SeamFd buffered(fs, fs.open(temp, O_WRONLY | O_CLOEXEC, 0));
  if (buffered.get() < 0) core::throw_errno("cannot open " + temp, errno);
  int direct_fd = -1;
  if (direct_io) {
    direct_fd = fs.open(temp, O_WRONLY | O_CLOEXEC | O_DIRECT, 0);
    // Filesystems without direct I/O (tmpfs) say EINVAL: the page cache it is.
    if (direct_fd < 0 && errno != EINVAL) core::throw_errno("cannot open " + temp, errno);
  }
  SeamFd direct(fs, direct_fd);
  for (const auto& [d, offset] : raw) {
    const auto* bytes = static_cast<const char*>(d->data->data());
    std::size_t size = d->nbytes();
    std::size_t aligned = 0;
    if (direct.get() >= 0 && offset % Buffer::kAlignment == 0) aligned = size / Buffer::kAlignment * Buffer::kAlignment;
    if (aligned > 0) write_all(fs, direct.get(), bytes, aligned, static_cast<off_t>(offset), temp);
    if (size > aligned) {
      write_all(fs, buffered.get(), bytes + aligned, size - aligned, static_cast<off_t>(offset + aligned), temp);
    }
  }
  if (fs.fsync(buffered.get()) != 0) core::throw_errno("cannot flush " + temp + " to disk", errno);
  if (direct.get() >= 0) direct.close(temp);
  buffered.close(temp);
}

}  // namespace

std::string temporary_path(const std::string& path) {
  const std::filesystem::path p(path);
  return (p.parent_path() / ("." + p.filename().string() + ".tmp")).string();
}

void write_checkpoint(const std::string& path, const Contents& contents, const WriteOptions& options) {
  FileSystem& fs = options.fs != nullptr ? *options.fs : posix_file_system();
  const std::string temp = temporary_path(path);

  // Checksums and the manifest, before any byte is written.
  nlohmann::json entries = nlohmann::json::array();
  for (const auto& d : contents.datasets) {
    if (!detail::is_valid_dataset_name(d.name) || d.name == "manifest") {
      throw InternalError("checkpoint dataset name '" + d.name + "' is not allowed");
    }
    std::size_t count = 1;
    for (std::int64_t n : d.shape) count *= static_cast<std::size_t>(n);
    if (count * dtype_size(d.dtype) != d.nbytes()) {
      throw InternalError("checkpoint dataset '" + d.name + "': its buffer does not match its shape and dtype");
    }
    const std::uint32_t crc = d.crc32c_known ? d.crc32c : d.nbytes() > 0 ? crc32c(d.data->data(), d.nbytes()) : 0;
    entries.push_back({{"name", d.name}, {"dtype", to_string(d.dtype)}, {"shape", d.shape},
                       {"nbytes", d.nbytes()}, {"crc32c", crc}});
  }
  for (const auto& [key, value] : contents.attributes) {
    if (key.empty() || key.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") != std::string::npos ||
        key == "format" || key == "format_version" || key == "manifest_crc32c") {
      throw InternalError("checkpoint attribute name '" + key + "' is not allowed");
    }
  }
  const std::string manifest = nlohmann::json{{"format", kFormatName}, {"format_version", kFormatVersion},
                                              {"attributes", contents.attributes}, {"datasets", entries}}.dump();
  const std::uint32_t manifest_crc = crc32c(manifest.data(), manifest.size());

  fs.unlink(temp);  // a leftover of a crashed save
  bool published = false;
  struct Cleanup {
    FileSystem& fs;
    const std::string& temp;
    const bool& published;
    ~Cleanup() {
      if (!published) fs.unlink(temp);
    }
  } cleanup{fs, temp, published};
  {
    // Created here with the mode asked for, whatever the umask; HDF5 truncates it in place.
    SeamFd created(fs, fs.open(temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, options.mode));
    if (created.get() < 0) core::throw_errno("cannot create " + temp, errno);
    if (::fchmod(created.get(), options.mode) != 0) core::throw_errno("cannot set the mode of " + temp, errno);
    created.close(temp);
  }
  std::vector<Placed> raw;
  try {
    raw = lay_out(temp, contents, manifest, manifest_crc);
  } catch (const CheckpointError& e) {
    std::string message = e.what();
    if (message.find("unable to lock file") != std::string::npos) {
      message += " (this filesystem does not support file locks: set HDF5_USE_FILE_LOCKING=FALSE in the "
                 "environment of the job)";
    }
    throw CheckpointError(message);
  }
  write_raw(fs, temp, raw, options.direct_io);
  core::publish_file(temp, path, fs);
  published = true;
}

}  // namespace hpctrial::checkpoint
