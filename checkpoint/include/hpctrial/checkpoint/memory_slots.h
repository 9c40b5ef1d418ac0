// A rank's copies of its state in node memory (checkpoint_levels.memory): two slot files in a
// folder of a tmpfs, written in place by turns, so that the copy being written never replaces the
// good one before it and the pages of both are allocated once, not at every copy.
//
// A slot file is a 4 KiB header, the datasets' bytes (each at a 64-byte aligned offset), then a
// manifest (JSON: the attributes and each dataset's name, dtype, shape, offset, size and
// CRC-32C). The header holds the format's name and version, the batch count, where the manifest
// is and its CRC, and the header's own CRC. A copy first marks its slot as being written, then
// fills the datasets (through a mapping: the producer copies the live state straight into the
// file, checksumming it as it goes), then writes the manifest, and the header last: a copy cut
// short, by the rank's death or the writer's error, reads as no copy at all. A copy is read
// whole and verified (every dataset's size and CRC) before it is used.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/checkpoint/store.h"

namespace hpctrial::checkpoint {

// What one dataset of a copy is: its bytes are put at Copy::data(k).
struct SlotDataset {
  std::string name;
  DType dtype = DType::kUInt8;
  std::vector<std::int64_t> shape;
  std::size_t nbytes = 0;
};

class MemorySlots {
 public:
  static constexpr int kSlots = 2;
  // The header's room at the start of a slot file; the datasets follow it.
  static constexpr std::size_t kHeaderBytes = 4096;
  // Opens (or creates, mode 0600) the slot files in `dir`, which must exist.
  explicit MemorySlots(std::string dir);
  ~MemorySlots();
  MemorySlots(const MemorySlots&) = delete;
  MemorySlots& operator=(const MemorySlots&) = delete;

  // A copy being written into the slot that holds no copy, or the older one. Its datasets' bytes
  // go to data(k) (checksummed by the producer: set_crc32c), then commit() makes it a copy.
  // Destroyed uncommitted, the slot holds nothing.
  class Copy {
   public:
    void* data(std::size_t k) const;
    void set_crc32c(std::size_t k, std::uint32_t crc);
    // Writes the manifest and then the header: from here on the copy is held.
    void commit();
    int slot() const { return slot_; }

   private:
    friend class MemorySlots;
    Copy(MemorySlots& slots, int slot, std::int64_t batches, std::vector<SlotDataset> datasets,
         std::map<std::string, std::string> attributes, std::vector<std::size_t> offsets, std::size_t end);
    MemorySlots* slots_;
    int slot_;
    std::int64_t batches_;
    std::vector<SlotDataset> datasets_;
    std::map<std::string, std::string> attributes_;
    std::vector<std::size_t> offsets_;
    std::size_t end_;  // where the datasets end and the manifest goes
    std::vector<std::uint32_t> crcs_;
  };
  // IoError (naming the slot file and errno) when the slot cannot be sized or mapped.
  Copy begin(std::int64_t batches, std::vector<SlotDataset> datasets, std::map<std::string, std::string> attributes);

  // A held copy's bytes as its slot file has them, for a copy of it elsewhere (a partner's): the
  // header (kHeaderBytes) first, then the rest (the datasets and the manifest). Valid until the
  // slot is written again. nullopt when no copy of `batches` is held.
  struct Image {
    const char* data = nullptr;
    std::size_t size = 0;  // kHeaderBytes and the rest
  };
  std::optional<Image> image(std::int64_t batches);

  // A copy arriving whole from elsewhere, written by the same rules as one made here: its slot is
  // marked as being written, the rest of its bytes go to rest(), and commit() checks its manifest
  // against the header's CRC and writes the header last.
  class Incoming {
   public:
    char* rest() const;
    std::size_t rest_size() const { return size_ - kHeaderBytes; }
    std::int64_t batches() const;
    // CheckpointError (naming the slot file) when the manifest that arrived is not the header's.
    void commit();

   private:
    friend class MemorySlots;
    Incoming(MemorySlots& slots, int slot, std::vector<char> header, std::size_t size);
    MemorySlots* slots_;
    int slot_;
    std::vector<char> header_;
    std::size_t size_;
  };
  // The slot for the copy whose header is `header` (kHeaderBytes, as image() gives them);
  // nullopt when the header is not a complete copy's (the sender had none: nothing follows).
  std::optional<Incoming> accept(const char* header);

  // The batch counts of the copies held (their headers and manifests intact), newest first.
  std::vector<std::int64_t> held() const;
  // The batch count of the copy held in the slot a copy of `batches` would be written into (the
  // same batch, written again, or an older one); nullopt when that slot holds none.
  std::optional<std::int64_t> replaces(std::int64_t batches) const;
  // The copy at `batches`, verified whole; CheckpointError naming the slot file otherwise. Its
  // datasets are views of the slot's mapping (read-only, kept while any of them lives, and `keep`
  // with it): use them before the next copy into that slot.
  CheckpointStore::Loaded load(std::int64_t batches, std::shared_ptr<const void> keep = nullptr) const;
  // The bytes both slots take in their folder.
  std::uint64_t bytes() const;
  const std::string& dir() const { return dir_; }
  std::string path(int slot) const;

 private:
  struct Header;
  struct Slot {
    int fd = -1;
    void* map = nullptr;
    std::size_t mapped = 0;
  };
  std::optional<Header> read_header(int slot) const;
  int slot_to_write(std::int64_t batches) const;
  void mark_being_written(int slot, std::int64_t batches) const;
  void* map_for(int slot, std::size_t size);
  void write_at(int slot, const void* bytes, std::size_t size, std::size_t offset) const;

  std::string dir_;
  Slot slots_[kSlots];
};

}  // namespace hpctrial::checkpoint
