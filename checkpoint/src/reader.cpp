#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "h5_types.h"
#include "hpctrial/checkpoint/format.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"

namespace hpctrial::checkpoint {
namespace {

using detail::kMaxIo;
using detail::kRawThreshold;

constexpr std::int64_t kMaxDimension = std::int64_t{1} << 48;
constexpr std::size_t kMaxManifestBytes = std::size_t{64} << 20;

using Fd = core::UniqueFd;

[[noreturn]] void bad(const std::string& path, const std::string& why) { throw CheckpointError(path + ": " + why); }

void read_all(int fd, char* data, std::size_t size, off_t offset, const std::string& path, const std::string& name) {
  while (size > 0) {
    const ssize_t n = ::pread(fd, data, std::min(size, kMaxIo), offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      bad(path, "cannot read dataset " + name + ": " + std::strerror(errno));
    }
    if (n == 0) bad(path, "dataset " + name + " ends past the end of the file: the file is truncated");
    data += n;
    size -= static_cast<std::size_t>(n);
    offset += n;
  }
}

[[noreturn]] void corrupt(const std::string& path, const Dataset& d, std::uint32_t crc) {
  bad(path, "dataset " + d.name + " is corrupt: its CRC-32C is " + std::to_string(crc) + ", the manifest says " +
                std::to_string(d.crc32c));
}

// The CRC of a dataset left in its file, read through a buffer of a few MiB.
void verify_in_file(const Dataset& d) {
  constexpr std::uint64_t kChunk = std::uint64_t{8} << 20;
  Buffer buffer(static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, d.nbytes())));
  std::uint32_t crc = 0;
  for (std::uint64_t at = 0; at < d.nbytes(); at += kChunk) {
    const std::uint64_t size = std::min<std::uint64_t>(kChunk, d.nbytes() - at);
    read_bytes(d, at, size, buffer.data());
    crc = crc32c(buffer.data(), static_cast<std::size_t>(size), crc);
  }
  if (crc != d.crc32c) corrupt(d.in_file->path, d, crc);
}

struct Planned {
  std::size_t index;  // into Contents::datasets
  haddr_t offset;
  std::uint32_t crc;
};

std::map<std::string, std::string> attributes_of(const std::string& path, const nlohmann::json& manifest) {
  std::map<std::string, std::string> out;
  if (!manifest.contains("attributes")) return out;
  if (!manifest["attributes"].is_object()) bad(path, "the manifest's attributes are not a map");
  for (const auto& [key, value] : manifest["attributes"].items()) {
    if (!value.is_string()) bad(path, "attribute " + key + " is not a string");
    out[key] = value.get<std::string>();
  }
  return out;
}

// Opens `path` and checks the format; reads and verifies the manifest. With h5_mutex held.
nlohmann::json open_manifest(const std::string& path, hid_t file, std::uint64_t file_size) {
  const std::string format = detail::read_string_attribute(file, "format", path);
  if (format != kFormatName) bad(path, "not an hpctrial checkpoint (format '" + format + "')");
  const auto version = detail::read_uint_attribute(file, "format_version", path);
  if (version > static_cast<std::uint64_t>(kFormatVersion)) {
    bad(path, "written in checkpoint format " + std::to_string(version) + ", newer than this hpctrial reads (" +
                  std::to_string(kFormatVersion) + "); resume with the hpctrial that wrote it or a newer one");
  }
  const auto stored_crc = detail::read_uint_attribute(file, "manifest_crc32c", path);
  if (H5Lexists(file, "manifest", H5P_DEFAULT) <= 0) bad(path, "the manifest is missing");
  H5Handle set(H5Dopen2(file, "manifest", H5P_DEFAULT), path + ": opening the manifest");
  H5Handle space(H5Dget_space(set.get()), "H5Dget_space");
  H5Handle type(H5Dget_type(set.get()), "H5Dget_type");
  const hssize_t points = H5Sget_simple_extent_npoints(space.get());
  if (H5Sget_simple_extent_ndims(space.get()) != 1 || H5Tget_size(type.get()) != 1 || points <= 0 ||
      static_cast<std::uint64_t>(points) > std::min<std::uint64_t>(kMaxManifestBytes, file_size)) {
    bad(path, "the manifest is not a byte string of a plausible size");
  }
  std::string text(static_cast<std::size_t>(points), '\0');
  check_h5(H5Dread(set.get(), H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, text.data()),
           path + ": reading the manifest");
  if (crc32c(text.data(), text.size()) != stored_crc) bad(path, "the manifest is corrupt (its checksum does not match)");
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    bad(path, std::string("the manifest is not valid JSON: ") + e.what());
  }
}

std::uint64_t size_of_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) bad(path, std::string("cannot read it: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) bad(path, "not a regular file");
  return static_cast<std::uint64_t>(st.st_size);
}

H5Handle open_file(const std::string& path) {
  silence_h5_errors();
  const hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (id < 0) {
    std::string why = h5_error_stack();
    if (why.find("unable to lock file") != std::string::npos) {
      why += " (this filesystem does not support file locks: set HDF5_USE_FILE_LOCKING=FALSE)";
    }
    bad(path, "not a readable HDF5 file (truncated or damaged?): " + why);
  }
  return H5Handle(id, path);
}

}  // namespace

Summary read_summary(const std::string& path) {
  const std::uint64_t file_size = size_of_file(path);
  std::lock_guard<std::mutex> lock(h5_mutex());
  H5Handle file = open_file(path);
  Summary summary;
  summary.format_version = static_cast<int>(detail::read_uint_attribute(file.get(), "format_version", path));
  const nlohmann::json manifest = open_manifest(path, file.get(), file_size);
  summary.manifest_json = manifest.dump();
  summary.attributes = attributes_of(path, manifest);
  return summary;
}

Contents read_checkpoint(const std::string& path, const ReadOptions& options) {
  const std::uint64_t file_size = size_of_file(path);
  Contents out;
  std::vector<Planned> raw;
  std::vector<std::uint32_t> crcs;
  {
    std::lock_guard<std::mutex> lock(h5_mutex());
    H5Handle file = open_file(path);
    const nlohmann::json manifest = open_manifest(path, file.get(), file_size);
    if (!manifest.contains("datasets") || !manifest["datasets"].is_array()) bad(path, "the manifest lists no datasets");
    out.attributes = attributes_of(path, manifest);
    std::uint64_t total = 0;
    for (const auto& entry : manifest["datasets"]) {
      if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string()) {
        bad(path, "a manifest entry has no name");
      }
      const std::string name = entry["name"].get<std::string>();
      if (!detail::is_valid_dataset_name(name) || name == "manifest") bad(path, "the manifest names an invalid dataset");
      auto fail = [&](const std::string& why) { bad(path, "dataset " + name + ": " + why); };
      if (!entry.contains("dtype") || !entry["dtype"].is_string()) fail("no dtype in the manifest");
      const auto dtype = dtype_from_string(entry["dtype"].get<std::string>());
      if (!dtype) fail("unknown dtype '" + entry["dtype"].get<std::string>() + "'");
      if (!entry.contains("shape") || !entry["shape"].is_array() || entry["shape"].size() > 32) fail("no plausible shape");
      std::vector<std::int64_t> shape;
      std::uint64_t count = 1;
      for (const auto& d : entry["shape"]) {
        if (!d.is_number_integer() || d.get<std::int64_t>() < 0 || d.get<std::int64_t>() > kMaxDimension) {
          fail("a dimension is negative or absurd: " + entry["shape"].dump());
        }
        shape.push_back(d.get<std::int64_t>());
        if (__builtin_mul_overflow(count, static_cast<std::uint64_t>(shape.back()), &count)) fail("its size overflows");
      }
      std::uint64_t nbytes = 0;
      if (__builtin_mul_overflow(count, static_cast<std::uint64_t>(dtype_size(*dtype)), &nbytes)) fail("its size overflows");
      if (!entry.contains("nbytes") || entry["nbytes"] != nbytes) fail("its byte size does not match its shape");
      if (!entry.contains("crc32c") || !entry["crc32c"].is_number_unsigned()) fail("no checksum in the manifest");
      total += nbytes;
      if (total > file_size) {
        fail("the datasets declare more bytes (" + std::to_string(total) + ") than the file holds (" +
             std::to_string(file_size) + ")");
      }
      // The dataset itself must be what the manifest says.
      if (H5Lexists(file.get(), name.c_str(), H5P_DEFAULT) <= 0) fail("listed in the manifest but missing");
      H5Handle set(H5Dopen2(file.get(), name.c_str(), H5P_DEFAULT), path + ": opening dataset " + name);
      H5Handle space(H5Dget_space(set.get()), "H5Dget_space");
      H5Handle type(H5Dget_type(set.get()), "H5Dget_type");
      const int rank = H5Sget_simple_extent_ndims(space.get());
      std::vector<hsize_t> dims(static_cast<std::size_t>(std::max(rank, 0)));
      if (rank < 0 || H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr) < 0 ||
          !std::equal(dims.begin(), dims.end(), shape.begin(), shape.end(),
                      [](hsize_t a, std::int64_t b) { return a == static_cast<hsize_t>(b); })) {
        fail("its shape in the file differs from the manifest");
      }
      if (H5Tget_size(type.get()) != dtype_size(*dtype)) fail("its type in the file differs from the manifest");
      H5Handle dcpl(H5Dget_create_plist(set.get()), "H5Dget_create_plist");
      if (H5Pget_layout(dcpl.get()) != H5D_CONTIGUOUS) fail("not stored contiguously");
      if (H5Dget_storage_size(set.get()) != nbytes) fail("its storage size differs from the manifest");

      const haddr_t offset = nbytes > 0 ? H5Dget_offset(set.get()) : HADDR_UNDEF;
      const bool in_place = nbytes >= kRawThreshold && offset != HADDR_UNDEF;
      if (in_place && offset + nbytes > file_size) fail("it ends past the end of the file: the file is truncated");
      crcs.push_back(entry["crc32c"].get<std::uint32_t>());
      if (in_place && options.leave_unread && options.leave_unread(name)) {
        out.datasets.push_back({name, *dtype, std::move(shape), nullptr, crcs.back()});
        out.datasets.back().in_file = std::make_shared<const InFile>(InFile{path, offset, nbytes});
        continue;
      }
      auto buffer = std::make_shared<Buffer>(static_cast<std::size_t>(nbytes));
      if (in_place) {
        raw.push_back({out.datasets.size(), offset, 0});
      } else if (nbytes > 0) {
        check_h5(H5Dread(set.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, buffer->data()),
                 path + ": reading dataset " + name);
      }
      out.datasets.push_back({name, *dtype, std::move(shape), buffer, crcs.back()});
    }
  }

  auto check_crc = [&](const Dataset& d) {
    const std::uint32_t crc = d.nbytes() > 0 ? crc32c(d.data->data(), d.nbytes()) : 0;
    if (crc != d.crc32c) corrupt(path, d, crc);
  };
  // Large datasets: a thread reads them in file order while this one checks the CRC of each
  // as soon as it has arrived, so that checking costs no time beside the device.
  std::vector<bool> from_raw(out.datasets.size(), false);
  if (!raw.empty()) {
    Fd buffered(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (buffered.get() < 0) bad(path, std::string("cannot open it: ") + std::strerror(errno));
    Fd direct(options.direct_io ? ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT) : -1);
    std::mutex mutex;
    std::condition_variable arrived;
    std::size_t done = 0;
    std::size_t prefaulted = 0;  // the reader reads dataset i only once its pages are touched
    bool stop = false;
    std::exception_ptr error;
    // Touching a buffer's pages (the kernel zeroes them) costs as much as reading into it: this
    // thread does it one dataset ahead of the reader, which waits for it (the touch writes).
    auto prefault = [&](std::size_t i) {
      if (i >= raw.size()) return;
      auto* bytes = static_cast<volatile char*>(const_cast<void*>(out.datasets[raw[i].index].data->data()));
      const std::size_t size = out.datasets[raw[i].index].nbytes();
      for (std::size_t at = 0; at < size; at += Buffer::kAlignment) bytes[at] = 0;
      std::lock_guard<std::mutex> lock(mutex);
      prefaulted = i + 1;
      arrived.notify_all();
    };
    prefault(0);
    std::thread reader([&] {
      for (std::size_t i = 0; i < raw.size(); ++i) {
        const Planned& p = raw[i];
        {
          std::unique_lock<std::mutex> lock(mutex);
          arrived.wait(lock, [&] { return prefaulted > i || stop; });
          if (stop) return;
        }
        try {
          Dataset& d = out.datasets[p.index];
          auto* bytes = static_cast<char*>(const_cast<void*>(d.data->data()));
          const std::size_t size = d.nbytes();
          std::size_t aligned = 0;
          if (direct.get() >= 0 && p.offset % Buffer::kAlignment == 0) aligned = size / Buffer::kAlignment * Buffer::kAlignment;
          if (aligned > 0) read_all(direct.get(), bytes, aligned, static_cast<off_t>(p.offset), path, d.name);
          if (size > aligned) {
            read_all(buffered.get(), bytes + aligned, size - aligned, static_cast<off_t>(p.offset + aligned), path, d.name);
          }
        } catch (...) {
          std::lock_guard<std::mutex> lock(mutex);
          error = std::current_exception();
          arrived.notify_all();
          return;
        }
        std::lock_guard<std::mutex> lock(mutex);
        ++done;
        arrived.notify_all();
        if (stop) return;
      }
    });
    try {
      for (std::size_t i = 0; i < raw.size(); ++i) {
        prefault(i + 1);
        {
          std::unique_lock<std::mutex> lock(mutex);
          arrived.wait(lock, [&] { return done > i || error; });
          if (done <= i) std::rethrow_exception(error);
        }
        from_raw[raw[i].index] = true;
        check_crc(out.datasets[raw[i].index]);
      }
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mutex);
        stop = true;
      }
      arrived.notify_all();  // the reader may be waiting for a dataset this thread will not touch now
      reader.join();
      throw;
    }
    reader.join();
  }
  for (std::size_t i = 0; i < out.datasets.size(); ++i) {
    const Dataset& d = out.datasets[i];
    if (d.in_file && options.verify_unread) {
      verify_in_file(d);
    } else if (!d.in_file && !from_raw[i]) {
      check_crc(d);
    }
  }
  return out;
}

void read_bytes(const Dataset& dataset, std::uint64_t first, std::uint64_t size, void* to) {
  if (first > dataset.nbytes() || size > dataset.nbytes() - first) {
    throw CheckpointError((dataset.in_file ? dataset.in_file->path + ": " : std::string()) + "bytes [" +
                          std::to_string(first) + ", " + std::to_string(first + size) + ") of dataset " + dataset.name +
                          " lie past its end (" + std::to_string(dataset.nbytes()) + " bytes)");
  }
  if (size == 0) return;
  if (!dataset.in_file) {
    std::memcpy(to, static_cast<const char*>(dataset.data->data()) + first, size);
    return;
  }
  const InFile& file = *dataset.in_file;
  Fd fd(::open(file.path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) bad(file.path, std::string("cannot open it: ") + std::strerror(errno));
  read_all(fd.get(), static_cast<char*>(to), size, static_cast<off_t>(file.offset + first), file.path, dataset.name);
}

std::shared_ptr<const Buffer> bytes_of(const Dataset& dataset) {
  if (!dataset.in_file) return dataset.data;
  auto buffer = std::make_shared<Buffer>(dataset.nbytes());
  read_bytes(dataset, 0, dataset.nbytes(), buffer->data());
  const std::uint32_t crc = crc32c(buffer->data(), buffer->size());
  if (crc != dataset.crc32c) corrupt(dataset.in_file->path, dataset, crc);
  return buffer;
}

}  // namespace hpctrial::checkpoint
