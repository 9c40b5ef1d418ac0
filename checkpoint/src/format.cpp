#include "hpctrial/checkpoint/format.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "hpctrial/core/error.h"

namespace hpctrial::checkpoint {

Buffer::Buffer(std::size_t size) : size_(size) {
  // Large buffers take transparent huge pages where the kernel offers them on request: first
  // touching fresh 4 KiB pages costs more than the copy into them (about 1.5 against 10 GB/s).
  constexpr std::size_t kHugePage = std::size_t{2} << 20;
  const std::size_t alignment = size >= kHugePage ? kHugePage : kAlignment;
  const std::size_t rounded = (size + alignment - 1) / alignment * alignment;
  data_ = std::aligned_alloc(alignment, rounded == 0 ? alignment : rounded);
  if (data_ == nullptr) throw std::bad_alloc();
  if (alignment == kHugePage) ::madvise(data_, rounded, MADV_HUGEPAGE);  // advice only: failure is harmless
}

Buffer::~Buffer() {
  if (!keeper_) std::free(data_);
}

std::string Dataset::text() const {
  const std::shared_ptr<const Buffer> bytes = bytes_of(*this);
  return bytes ? std::string(static_cast<const char*>(bytes->data()), bytes->size()) : std::string();
}

void Contents::add(const std::string& name, DType dtype, std::vector<std::int64_t> shape, const void* bytes) {
  std::size_t count = 1;
  for (std::int64_t d : shape) count *= static_cast<std::size_t>(d);
  auto buffer = std::make_shared<Buffer>(count * dtype_size(dtype));
  if (buffer->size() > 0) std::memcpy(buffer->data(), bytes, buffer->size());
  add(name, dtype, std::move(shape), std::move(buffer));
}

void Contents::add(const std::string& name, DType dtype, std::vector<std::int64_t> shape,
                   std::shared_ptr<const Buffer> data) {
  if (find(name) != nullptr) throw InternalError("checkpoint contents: dataset '" + name + "' added twice");
  datasets.push_back({name, dtype, std::move(shape), std::move(data), 0});
}

void Contents::add_text(const std::string& name, std::string_view text) {
  add(name, DType::kUInt8, {static_cast<std::int64_t>(text.size())}, text.data());
}

const Dataset* Contents::find(const std::string& name) const {
  for (const auto& d : datasets) {
    if (d.name == name) return &d;
  }
  return nullptr;
}

const Dataset& Contents::at(const std::string& name, const std::string& file) const {
  const Dataset* d = find(name);
  if (d == nullptr) throw CheckpointError(file + ": the checkpoint has no dataset '" + name + "'");
  return *d;
}

}  // namespace hpctrial::checkpoint
