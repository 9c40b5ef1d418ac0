#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <utility>

#include "h5_types.h"
#include "hpctrial/checkpoint/format.h"
#include "hpctrial/checkpoint/shared_write.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"

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

// Writes with O_DIRECT. Some filesystems open a file with O_DIRECT and then refuse the writes
// with EINVAL: returns how many bytes went out before such a refusal (`size` when none came).
// IoError on any other failure.
std::size_t write_direct(FileSystem& fs, int fd, const char* data, std::size_t size, off_t offset,
                         const std::string& path) {
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = fs.pwrite(fd, data + done, std::min(size - done, kMaxIo), offset + static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EINVAL) return done;
      core::throw_errno("cannot write " + path, errno);
    }
    if (n == 0) throw IoError("cannot write " + path + ": the write made no progress");
    done += static_cast<std::size_t>(n);
  }
  return done;
}

void warn_direct_io_refused(const std::string& path) {
  core::log_warning("{}: the filesystem opened the file for direct I/O (O_DIRECT) but refused a direct write "
                    "(EINVAL); writing the rest of it through the page cache", path);
}

struct Placed {
  const Dataset* dataset;
  haddr_t offset;
};

void check_dataset(const std::string& name, DType dtype, const std::vector<std::int64_t>& shape, std::size_t nbytes) {
  if (!detail::is_valid_dataset_name(name) || name == "manifest") {
    throw InternalError("checkpoint dataset name '" + name + "' is not allowed");
  }
  std::size_t count = 1;
  for (std::int64_t n : shape) count *= static_cast<std::size_t>(n);
  if (count * dtype_size(dtype) != nbytes) {
    throw InternalError("checkpoint dataset '" + name + "': its buffer does not match its shape and dtype");
  }
}

void check_attributes(const std::map<std::string, std::string>& attributes) {
  for (const auto& [key, value] : attributes) {
    if (key.empty() || key.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") != std::string::npos ||
        key == "format" || key == "format_version" || key == "manifest_crc32c") {
      throw InternalError("checkpoint attribute name '" + key + "' is not allowed");
    }
  }
}

nlohmann::json manifest_entry(const std::string& name, DType dtype, const std::vector<std::int64_t>& shape,
                              std::size_t nbytes, std::uint32_t crc) {
  return {{"name", name}, {"dtype", to_string(dtype)}, {"shape", shape}, {"nbytes", nbytes}, {"crc32c", crc}};
}

std::string manifest_text(const nlohmann::json& entries, const std::map<std::string, std::string>& attributes) {
  return nlohmann::json{{"format", kFormatName}, {"format_version", kFormatVersion}, {"attributes", attributes},
                        {"datasets", entries}}.dump();
}

// Creates `temp` with `mode` whatever the umask (HDF5 then truncates it in place), after
// removing a leftover of a crashed save.
void create_temporary(FileSystem& fs, const std::string& temp, mode_t mode) {
  fs.unlink(temp);
  SeamFd created(fs, fs.open(temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode));
  if (created.get() < 0) core::throw_errno("cannot create " + temp, errno);
  if (::fchmod(created.get(), mode) != 0) core::throw_errno("cannot set the mode of " + temp, errno);
  created.close(temp);
}

CheckpointError with_lock_hint(const CheckpointError& e) {
  std::string message = e.what();
  if (message.find("unable to lock file") != std::string::npos) {
    message += " (this filesystem does not support file locks: set HDF5_USE_FILE_LOCKING=FALSE in the "
               "environment of the job)";
  }
  return CheckpointError(message);
}

// Runs `body`; if it throws, removes `temp` and rethrows (HDF5's lock failures with the hint).
template <typename Body>
void removing_on_failure(FileSystem& fs, const std::string& temp, Body body) {
  try {
    body();
  } catch (const CheckpointError& e) {
    fs.unlink(temp);
    throw with_lock_hint(e);
  } catch (...) {
    fs.unlink(temp);
    throw;
  }
}

// Lays out the file with HDF5: every dataset allocated at creation, small ones written, large
// ones left for the raw pass. Returns where the large ones are.
// A new file whose datasets are created contiguous, allocated at once and never filled, large
// ones aligned to 4 KiB. With h5_mutex held.
struct NewFile {
  explicit NewFile(const std::string& path) : path(path) {
    silence_h5_errors();
    H5Handle fapl(H5Pcreate(H5P_FILE_ACCESS), "H5Pcreate");
    check_h5(H5Pset_alignment(fapl.get(), kRawThreshold, Buffer::kAlignment), "H5Pset_alignment");
    file = H5Handle(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), "creating " + path);
    check_h5(H5Pset_create_intermediate_group(lcpl.get(), 1), "H5Pset_create_intermediate_group");
    check_h5(H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS), "H5Pset_layout");
    check_h5(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY), "H5Pset_alloc_time");
    check_h5(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER), "H5Pset_fill_time");
  }
  H5Handle create(const std::string& name, DType dtype, const std::vector<std::int64_t>& shape) {
    H5Handle type = detail::file_type(dtype);
    std::vector<hsize_t> dims(shape.begin(), shape.end());
    H5Handle space(shape.empty() ? H5Screate(H5S_SCALAR)
                                 : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                   "H5Screate");
    H5Handle set(H5Dcreate2(file.get(), name.c_str(), type.get(), space.get(), lcpl.get(), dcpl.get(), H5P_DEFAULT),
                 "creating dataset " + name + " in " + path);
    detail::write_string_attribute(set.get(), "dtype", to_string(dtype));
    return set;
  }
  // The root attributes, with the manifest's checksum.
  void finish(const std::map<std::string, std::string>& attributes, std::uint32_t manifest_crc) {
    for (const auto& [key, value] : attributes) detail::write_string_attribute(file.get(), key.c_str(), value);
    detail::write_string_attribute(file.get(), "format", kFormatName);
    detail::write_uint_attribute(file.get(), "format_version", kFormatVersion);
    detail::write_uint_attribute(file.get(), "manifest_crc32c", manifest_crc);
    file.close();
  }

  std::string path;
  H5Handle file;
  H5Handle lcpl{H5Pcreate(H5P_LINK_CREATE), "H5Pcreate"};
  H5Handle dcpl{H5Pcreate(H5P_DATASET_CREATE), "H5Pcreate"};
};

std::vector<Placed> lay_out(const std::string& temp, const Contents& contents, const std::string& manifest,
                            std::uint32_t manifest_crc) {
  std::lock_guard<std::mutex> lock(h5_mutex());
  NewFile file(temp);
  std::vector<Placed> raw;
  auto create = [&](const Dataset& d) {
    H5Handle set = file.create(d.name, d.dtype, d.shape);
    H5Handle type = detail::file_type(d.dtype);
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
    H5Handle set(H5Dopen2(file.file.get(), "manifest", H5P_DEFAULT), "opening the manifest");
    check_h5(H5Dwrite(set.get(), H5T_STD_U8LE, H5S_ALL, H5S_ALL, H5P_DEFAULT, manifest.data()), "writing the manifest");
  }
  file.finish(contents.attributes, manifest_crc);
  return raw;
}

// Writes the large datasets' bytes at their offsets: whole 4 KiB blocks with O_DIRECT (when the
// filesystem takes it), the tail through the page cache. A filesystem that opens the file with
// O_DIRECT but refuses a direct write gets the rest of the file through the page cache.
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
    if (aligned > 0) {
      const std::size_t sent = write_direct(fs, direct.get(), bytes, aligned, static_cast<off_t>(offset), temp);
      if (sent < aligned) {
        warn_direct_io_refused(temp);
        direct.close(temp);
        aligned = sent;
      }
    }
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
    check_dataset(d.name, d.dtype, d.shape, d.nbytes());
    const std::uint32_t crc = d.crc32c_known ? d.crc32c : d.nbytes() > 0 ? crc32c(d.data->data(), d.nbytes()) : 0;
    entries.push_back(manifest_entry(d.name, d.dtype, d.shape, d.nbytes(), crc));
  }
  check_attributes(contents.attributes);
  const std::string manifest = manifest_text(entries, contents.attributes);
  const std::uint32_t manifest_crc = crc32c(manifest.data(), manifest.size());

  bool published = false;
  struct Cleanup {
    FileSystem& fs;
    const std::string& temp;
    const bool& published;
    ~Cleanup() {
      if (!published) fs.unlink(temp);
    }
  } cleanup{fs, temp, published};
  create_temporary(fs, temp, options.mode);
  std::vector<Placed> raw;
  try {
    raw = lay_out(temp, contents, manifest, manifest_crc);
  } catch (const CheckpointError& e) {
    throw with_lock_hint(e);
  }
  write_raw(fs, temp, raw, options.direct_io);
  core::publish_file(temp, path, fs);
  published = true;
}


// --- checkpoints written by several processes (shared_write.h) -------------------------------

std::size_t DatasetSpec::nbytes() const {
  std::size_t count = 1;
  for (std::int64_t n : shape) count *= static_cast<std::size_t>(n);
  return count * dtype_size(dtype);
}

namespace {

// The longest manifest `plan`'s datasets can make: every CRC with ten digits.
std::string widest_manifest(const FilePlan& plan) {
  nlohmann::json entries = nlohmann::json::array();
  for (const auto& d : plan.datasets) entries.push_back(manifest_entry(d.name, d.dtype, d.shape, d.nbytes(), 4294967295u));
  return manifest_text(entries, plan.attributes);
}

}  // namespace

FilePlan plan_checkpoint(const std::string& path, std::vector<DatasetSpec> datasets,
                         std::map<std::string, std::string> attributes, const WriteOptions& options) {
  FileSystem& fs = options.fs != nullptr ? *options.fs : posix_file_system();
  FilePlan plan;
  plan.path = path;
  plan.temp = temporary_path(path);
  plan.datasets = std::move(datasets);
  plan.attributes = std::move(attributes);
  for (const auto& d : plan.datasets) check_dataset(d.name, d.dtype, d.shape, d.nbytes());
  check_attributes(plan.attributes);
  plan.manifest_capacity = widest_manifest(plan).size();
  create_temporary(fs, plan.temp, options.mode);
  removing_on_failure(fs, plan.temp, [&] {
    std::lock_guard<std::mutex> lock(h5_mutex());
    NewFile file(plan.temp);
    const auto create = [&](const std::string& name, DType dtype, const std::vector<std::int64_t>& shape,
                            std::size_t nbytes) -> std::uint64_t {
      H5Handle set = file.create(name, dtype, shape);
      if (nbytes == 0) return 0;
      const haddr_t offset = H5Dget_offset(set.get());
      if (offset == HADDR_UNDEF) throw CheckpointError(plan.temp + ": dataset " + name + " has no place in the file");
      return offset;
    };
    for (const auto& d : plan.datasets) plan.offsets.push_back(create(d.name, d.dtype, d.shape, d.nbytes()));
    plan.manifest_offset = create("manifest", DType::kUInt8, {static_cast<std::int64_t>(plan.manifest_capacity)},
                                  plan.manifest_capacity);
    file.finish(plan.attributes, 0);  // the manifest's checksum is set by finish_checkpoint
  });
  return plan;
}

PieceWriter::PieceWriter(const std::string& temp, const WriteOptions& options)
    : fs_(options.fs != nullptr ? *options.fs : posix_file_system()), temp_(temp) {
  buffered_ = fs_.open(temp, O_WRONLY | O_CLOEXEC, 0);
  if (buffered_ < 0) core::throw_errno("cannot open " + temp, errno);
  if (options.direct_io) {
    direct_ = fs_.open(temp, O_WRONLY | O_CLOEXEC | O_DIRECT, 0);
    if (direct_ < 0 && errno != EINVAL) {
      const int error = errno;
      fs_.close(buffered_);
      core::throw_errno("cannot open " + temp, error);
    }
  }
}

PieceWriter::~PieceWriter() {
  if (direct_ >= 0) fs_.close(direct_);
  if (buffered_ >= 0) fs_.close(buffered_);
}

void PieceWriter::write(std::uint64_t file_offset, const void* data, std::size_t size) {
  if (buffered_ < 0) throw InternalError("PieceWriter::write after sync()");
  const auto* bytes = static_cast<const char*>(data);
  // O_DIRECT needs the file offset, the memory and the length aligned: the aligned middle goes
  // direct when the memory lines up with the file, the ends through the page cache.
  const std::uint64_t a = Buffer::kAlignment;
  const std::uint64_t head = std::min<std::uint64_t>(size, (a - file_offset % a) % a);
  const std::uint64_t middle = (size - head) / a * a;
  const bool direct = direct_ >= 0 && middle > 0 && reinterpret_cast<std::uintptr_t>(bytes + head) % a == 0;
  if (!direct) {
    write_all(fs_, buffered_, bytes, size, static_cast<off_t>(file_offset), temp_);
    return;
  }
  if (head > 0) write_all(fs_, buffered_, bytes, head, static_cast<off_t>(file_offset), temp_);
  const std::uint64_t sent = write_direct(fs_, direct_, bytes + head, middle, static_cast<off_t>(file_offset + head), temp_);
  if (sent < middle) {
    // Refused (EINVAL): this writer's bytes go through the page cache from here on.
    warn_direct_io_refused(temp_);
    SeamFd(fs_, std::exchange(direct_, -1)).close(temp_);
    write_all(fs_, buffered_, bytes + head + sent, middle - sent, static_cast<off_t>(file_offset + head + sent), temp_);
  }
  const std::uint64_t tail = size - head - middle;
  if (tail > 0) write_all(fs_, buffered_, bytes + head + middle, tail, static_cast<off_t>(file_offset + head + middle), temp_);
}

void PieceWriter::sync() {
  if (buffered_ < 0) return;
  if (fs_.fsync(buffered_) != 0) core::throw_errno("cannot flush " + temp_ + " to disk", errno);
  SeamFd direct(fs_, std::exchange(direct_, -1));
  SeamFd buffered(fs_, std::exchange(buffered_, -1));
  if (direct.get() >= 0) direct.close(temp_);
  buffered.close(temp_);
}

void finish_checkpoint(const FilePlan& plan, const std::vector<std::uint32_t>& crcs, const WriteOptions& options) {
  FileSystem& fs = options.fs != nullptr ? *options.fs : posix_file_system();
  if (crcs.size() != plan.datasets.size()) {
    throw InternalError("finish_checkpoint: " + std::to_string(crcs.size()) + " checksums for " +
                        std::to_string(plan.datasets.size()) + " datasets");
  }
  nlohmann::json entries = nlohmann::json::array();
  for (std::size_t i = 0; i < plan.datasets.size(); ++i) {
    const auto& d = plan.datasets[i];
    entries.push_back(manifest_entry(d.name, d.dtype, d.shape, d.nbytes(), crcs[i]));
  }
  std::string manifest = manifest_text(entries, plan.attributes);
  if (manifest.size() > plan.manifest_capacity) throw InternalError("finish_checkpoint: the manifest outgrew its room");
  manifest.resize(plan.manifest_capacity, ' ');
  const std::uint32_t manifest_crc = crc32c(manifest.data(), manifest.size());
  removing_on_failure(fs, plan.temp, [&] {
    {
      PieceWriter out(plan.temp, WriteOptions{options.mode, false, options.fs});
      out.write(plan.manifest_offset, manifest.data(), manifest.size());
      out.sync();
    }
    {
      std::lock_guard<std::mutex> lock(h5_mutex());
      silence_h5_errors();
      H5Handle file(H5Fopen(plan.temp.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), "opening " + plan.temp);
      H5Handle attribute(H5Aopen(file.get(), "manifest_crc32c", H5P_DEFAULT), "opening manifest_crc32c");
      const std::uint64_t value = manifest_crc;
      check_h5(H5Awrite(attribute.get(), H5T_NATIVE_UINT64, &value), "writing manifest_crc32c");
      attribute.close();
      file.close();
    }
    SeamFd synced(fs, fs.open(plan.temp, O_RDONLY | O_CLOEXEC, 0));
    if (synced.get() < 0) core::throw_errno("cannot open " + plan.temp, errno);
    if (fs.fsync(synced.get()) != 0) core::throw_errno("cannot flush " + plan.temp + " to disk", errno);
    synced.close(plan.temp);
    core::publish_file(plan.temp, plan.path, fs);
  });
}

void abandon_checkpoint(const FilePlan& plan, const WriteOptions& options) {
  FileSystem& fs = options.fs != nullptr ? *options.fs : posix_file_system();
  fs.unlink(plan.temp);
}

}  // namespace hpctrial::checkpoint
