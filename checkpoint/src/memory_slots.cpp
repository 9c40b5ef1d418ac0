// The two slot files of a rank's copies in node memory (memory_slots.h).
#include "hpctrial/checkpoint/memory_slots.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <utility>

#include <nlohmann/json.hpp>

#include "hpctrial/core/error.h"

namespace hpctrial::checkpoint {
namespace {

constexpr char kMagic[16] = {'h', 'p', 'c', 't', 'r', 'i', 'a', 'l', '-', 'm', 'e', 'm', 'c', 'o', 'p', 'y'};
constexpr std::uint32_t kVersion = 1;
constexpr std::uint32_t kBeingWritten = 1;
constexpr std::uint32_t kComplete = 2;
constexpr std::size_t kHeaderBytes = MemorySlots::kHeaderBytes;
constexpr std::size_t kAlign = 64;
constexpr std::uint64_t kMaxManifest = std::uint64_t{64} << 20;

std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

struct MemorySlots::Header {
  char magic[16];
  std::uint32_t version;
  std::uint32_t state;
  std::int64_t batches;
  std::uint64_t manifest_offset;
  std::uint64_t manifest_size;
  std::uint32_t manifest_crc;
  std::uint32_t header_crc;  // of every byte before it

  std::uint32_t own_crc() const { return crc32c(this, offsetof(Header, header_crc)); }
};

MemorySlots::MemorySlots(std::string dir) : dir_(std::move(dir)) {
  for (int s = 0; s < kSlots; ++s) {
    const std::string p = path(s);
    slots_[s].fd = ::open(p.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (slots_[s].fd < 0) {
      const int error = errno;
      for (int t = 0; t < s; ++t) ::close(slots_[t].fd);
      throw IoError("cannot open " + p + ": " + std::strerror(error));
    }
  }
}

MemorySlots::~MemorySlots() {
  for (Slot& slot : slots_) {
    if (slot.map) ::munmap(slot.map, slot.mapped);
    if (slot.fd >= 0) ::close(slot.fd);
  }
}

std::string MemorySlots::path(int slot) const { return dir_ + "/slot-" + std::to_string(slot); }

void MemorySlots::write_at(int slot, const void* bytes, std::size_t size, std::size_t offset) const {
  const auto* p = static_cast<const char*>(bytes);
  while (size > 0) {
    const ssize_t n = ::pwrite(slots_[slot].fd, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw IoError("cannot write " + path(slot) + ": " + std::strerror(n < 0 ? errno : ENOSPC));
    p += n;
    size -= static_cast<std::size_t>(n);
    offset += static_cast<std::size_t>(n);
  }
}

// The slot's file holding at least `size` bytes, mapped; kept mapped for the next copies, so that
// its pages are touched once (the texts of a copy change their length from one to the next: the
// mapping is grown with room to spare, never shrunk).
void* MemorySlots::map_for(int slot, std::size_t size) {
  Slot& s = slots_[slot];
  if (s.map && s.mapped >= size) return s.map;
  if (s.map) ::munmap(s.map, s.mapped);
  s.map = nullptr;
  constexpr std::size_t kRoom = std::size_t{1} << 20;
  size = (size + size / 64 + kRoom) / kRoom * kRoom;
  // Its pages allocated now (a full tmpfs is an error here, not a SIGBUS at a store through the
  // mapping), and the file grown, never shrunk: past the data is a manifest, maybe a held copy's.
  if (const int error = ::posix_fallocate(s.fd, 0, static_cast<off_t>(size)); error != 0) {
    throw IoError("cannot make room for " + std::to_string(size) + " bytes in " + path(slot) + ": " +
                  std::strerror(error) + "; give checkpoint_levels.memory.dir more room");
  }
  void* map = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd, 0);
  if (map == MAP_FAILED) throw IoError("cannot map " + path(slot) + ": " + std::strerror(errno));
#ifdef MADV_POPULATE_WRITE
  ::madvise(map, size, MADV_POPULATE_WRITE);  // the pages, writable, at once (advice: Linux 5.14 on)
#endif
  s.map = map;
  s.mapped = size;
  return map;
}

std::optional<MemorySlots::Header> MemorySlots::read_header(int slot) const {
  Header h{};
  if (::pread(slots_[slot].fd, &h, sizeof h, 0) != static_cast<ssize_t>(sizeof h)) return std::nullopt;
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0 || h.version != kVersion || h.state != kComplete ||
      h.header_crc != h.own_crc() || h.manifest_size > kMaxManifest || h.manifest_offset < kHeaderBytes) {
    return std::nullopt;
  }
  return h;
}

// The slot to write: one holding nothing or this batch again, else the older copy.
int MemorySlots::slot_to_write(std::int64_t batches) const {
  const auto a = read_header(0), b = read_header(1);
  if (!a || a->batches == batches) return 0;
  if (!b || b->batches == batches) return 1;
  return a->batches < b->batches ? 0 : 1;
}

// Before any byte of the slot changes.
void MemorySlots::mark_being_written(int slot, std::int64_t batches) const {
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.version = kVersion;
  h.state = kBeingWritten;
  h.batches = batches;
  h.header_crc = h.own_crc();
  write_at(slot, &h, sizeof h, 0);
}

MemorySlots::Copy MemorySlots::begin(std::int64_t batches, std::vector<SlotDataset> datasets,
                                     std::map<std::string, std::string> attributes) {
  const int slot = slot_to_write(batches);
  std::vector<std::size_t> offsets;
  std::size_t end = kHeaderBytes;
  for (const SlotDataset& d : datasets) {
    offsets.push_back(end);
    end = align_up(end + d.nbytes);
  }
  mark_being_written(slot, batches);
  map_for(slot, end);
  return Copy(*this, slot, batches, std::move(datasets), std::move(attributes), std::move(offsets), end);
}

MemorySlots::Copy::Copy(MemorySlots& slots, int slot, std::int64_t batches, std::vector<SlotDataset> datasets,
                        std::map<std::string, std::string> attributes, std::vector<std::size_t> offsets,
                        std::size_t end)
    : slots_(&slots),
      slot_(slot),
      batches_(batches),
      datasets_(std::move(datasets)),
      attributes_(std::move(attributes)),
      offsets_(std::move(offsets)),
      end_(end),
      crcs_(datasets_.size(), 0) {}

void* MemorySlots::Copy::data(std::size_t k) const {
  return static_cast<char*>(slots_->slots_[slot_].map) + offsets_.at(k);
}

void MemorySlots::Copy::set_crc32c(std::size_t k, std::uint32_t crc) { crcs_.at(k) = crc; }

void MemorySlots::Copy::commit() {
  nlohmann::json manifest;
  manifest["attributes"] = attributes_;
  manifest["datasets"] = nlohmann::json::array();
  for (std::size_t k = 0; k < datasets_.size(); ++k) {
    const SlotDataset& d = datasets_[k];
    manifest["datasets"].push_back({{"name", d.name}, {"dtype", core::to_string(d.dtype)}, {"shape", d.shape},
                                    {"offset", offsets_[k]}, {"nbytes", d.nbytes}, {"crc32c", crcs_[k]}});
  }
  const std::string text = manifest.dump();
  const std::size_t at = end_;  // within the mapping or past it: the file grows, never shrinks
  slots_->write_at(slot_, text.data(), text.size(), at);
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.version = kVersion;
  h.state = kComplete;
  h.batches = batches_;
  h.manifest_offset = at;
  h.manifest_size = text.size();
  h.manifest_crc = crc32c(text.data(), text.size());
  h.header_crc = h.own_crc();
  slots_->write_at(slot_, &h, sizeof h, 0);
}

std::optional<MemorySlots::Image> MemorySlots::image(std::int64_t batches) {
  for (int s = 0; s < kSlots; ++s) {
    const auto h = read_header(s);
    if (!h || h->batches != batches) continue;
    const std::size_t size = h->manifest_offset + h->manifest_size;
    struct stat st {};
    if (::fstat(slots_[s].fd, &st) != 0 || static_cast<std::uint64_t>(st.st_size) < size) return std::nullopt;
    return Image{static_cast<const char*>(map_for(s, size)), size};
  }
  return std::nullopt;
}

std::optional<MemorySlots::Incoming> MemorySlots::accept(const char* header) {
  Header h{};
  std::memcpy(&h, header, sizeof h);
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0 || h.version != kVersion || h.state != kComplete ||
      h.header_crc != h.own_crc() || h.manifest_size > kMaxManifest || h.manifest_offset < kHeaderBytes) {
    return std::nullopt;
  }
  const int slot = slot_to_write(h.batches);
  mark_being_written(slot, h.batches);
  const std::size_t size = h.manifest_offset + h.manifest_size;
  map_for(slot, size);
  return Incoming(*this, slot, std::vector<char>(header, header + kHeaderBytes), size);
}

MemorySlots::Incoming::Incoming(MemorySlots& slots, int slot, std::vector<char> header, std::size_t size)
    : slots_(&slots), slot_(slot), header_(std::move(header)), size_(size) {}

char* MemorySlots::Incoming::rest() const { return static_cast<char*>(slots_->slots_[slot_].map) + kHeaderBytes; }

std::int64_t MemorySlots::Incoming::batches() const {
  Header h{};
  std::memcpy(&h, header_.data(), sizeof h);
  return h.batches;
}

void MemorySlots::Incoming::commit() {
  Header h{};
  std::memcpy(&h, header_.data(), sizeof h);
  const char* manifest = static_cast<const char*>(slots_->slots_[slot_].map) + h.manifest_offset;
  if (crc32c(manifest, h.manifest_size) != h.manifest_crc) {
    throw CheckpointError(slots_->path(slot_) + ": the copy of batch " + std::to_string(h.batches) +
                          " that arrived does not match its header's CRC-32C");
  }
  slots_->write_at(slot_, header_.data(), kHeaderBytes, 0);
}

std::vector<std::int64_t> MemorySlots::held() const {
  std::vector<std::int64_t> out;
  for (int s = 0; s < kSlots; ++s) {
    const auto h = read_header(s);
    if (!h) continue;
    std::string text(h->manifest_size, '\0');
    if (::pread(slots_[s].fd, text.data(), text.size(), static_cast<off_t>(h->manifest_offset)) !=
            static_cast<ssize_t>(text.size()) ||
        crc32c(text.data(), text.size()) != h->manifest_crc) {
      continue;
    }
    out.push_back(h->batches);
  }
  std::sort(out.rbegin(), out.rend());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::uint64_t MemorySlots::bytes() const {
  std::uint64_t total = 0;
  for (const Slot& slot : slots_) {
    struct stat st {};
    if (::fstat(slot.fd, &st) == 0) total += static_cast<std::uint64_t>(st.st_size);
  }
  return total;
}

std::optional<std::int64_t> MemorySlots::replaces(std::int64_t batches) const {
  const auto h = read_header(slot_to_write(batches));
  if (!h) return std::nullopt;
  return h->batches;
}

CheckpointStore::Loaded MemorySlots::load(std::int64_t batches, std::shared_ptr<const void> keep) const {
  int slot = -1;
  std::optional<Header> h;
  for (int s = 0; s < kSlots && slot < 0; ++s) {
    h = read_header(s);
    if (h && h->batches == batches) slot = s;
  }
  if (slot < 0) throw CheckpointError(dir_ + " holds no complete copy of batch " + std::to_string(batches));
  const std::string file = path(slot);
  struct stat st {};
  if (::fstat(slots_[slot].fd, &st) != 0 || static_cast<std::uint64_t>(st.st_size) < h->manifest_offset + h->manifest_size) {
    throw CheckpointError(file + ": shorter than its header says");
  }
  std::string text(h->manifest_size, '\0');
  if (::pread(slots_[slot].fd, text.data(), text.size(), static_cast<off_t>(h->manifest_offset)) !=
          static_cast<ssize_t>(text.size()) ||
      crc32c(text.data(), text.size()) != h->manifest_crc) {
    throw CheckpointError(file + ": its manifest does not match its CRC-32C");
  }
  const std::size_t data_end = h->manifest_offset;
  // The datasets are views of the slot's pages, mapped whole at once: restoring a copy touches no
  // fresh memory but the state's own.
  void* map = ::mmap(nullptr, data_end, PROT_READ, MAP_SHARED | MAP_POPULATE, slots_[slot].fd, 0);
  if (map == MAP_FAILED) throw IoError("cannot map " + file + ": " + std::strerror(errno));
  const std::shared_ptr<const void> mapping(map, [data_end, keep = std::move(keep)](const void* p) {
    ::munmap(const_cast<void*>(p), data_end);
  });
  CheckpointStore::Loaded loaded;
  loaded.path = file;
  loaded.batches = batches;
  try {
    const auto manifest = nlohmann::json::parse(text);
    loaded.contents.attributes = manifest.at("attributes").get<std::map<std::string, std::string>>();
    for (const auto& d : manifest.at("datasets")) {
      const std::string name = d.at("name").get<std::string>();
      const auto dtype = core::dtype_from_string(d.at("dtype").get<std::string>());
      const auto shape = d.at("shape").get<std::vector<std::int64_t>>();
      const auto offset = d.at("offset").get<std::uint64_t>();
      const auto nbytes = d.at("nbytes").get<std::uint64_t>();
      std::uint64_t elements = 1;
      bool sane = true;
      for (std::int64_t n : shape) {
        sane = sane && n >= 0 && (n == 0 || elements <= data_end / static_cast<std::uint64_t>(n));
        if (sane) elements *= static_cast<std::uint64_t>(n);
      }
      if (name.empty() || !dtype || !sane || elements * core::dtype_size(*dtype) != nbytes || offset < kHeaderBytes ||
          offset > data_end || nbytes > data_end - offset) {
        throw CheckpointError(file + ": dataset '" + name + "' has a size or place that does not fit the file");
      }
      char* bytes = static_cast<char*>(map) + offset;
      auto buffer = std::make_shared<Buffer>(mapping, bytes, static_cast<std::size_t>(nbytes));
      const std::uint32_t crc = crc32c(bytes, nbytes);
      if (crc != d.at("crc32c").get<std::uint32_t>()) {
        throw CheckpointError(file + ": dataset '" + name + "' does not match its CRC-32C: the copy is damaged");
      }
      loaded.contents.add(name, *dtype, shape, std::move(buffer));
      loaded.contents.datasets.back().crc32c = crc;
      loaded.contents.datasets.back().crc32c_known = true;
    }
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(file + ": its manifest cannot be read: " + std::string(e.what()));
  }
  return loaded;
}

}  // namespace hpctrial::checkpoint
