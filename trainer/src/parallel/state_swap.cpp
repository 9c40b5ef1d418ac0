#include "parallel/state_swap.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <system_error>

#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "state/state_io.h"

namespace hpctrial::trainer::detail {
namespace {

// Direct I/O wants the buffer's address, the file offset and the length aligned to the disk's
// logical block (4096 covers every disk); a checkpoint maps regions of the file, whose offsets
// must be whole pages.
std::int64_t alignment() {
  static const std::int64_t a = std::max<std::int64_t>(4096, ::sysconf(_SC_PAGESIZE));
  return a;
}

std::int64_t aligned(std::int64_t n) { return (n + alignment() - 1) / alignment() * alignment(); }

void free_aligned(void* p) { std::free(p); }

// A buffer for `nbytes` that direct I/O can fill, as a storage's data.
c10::DataPtr aligned_buffer(std::int64_t nbytes) {
  void* p = std::aligned_alloc(static_cast<std::size_t>(alignment()),
                               static_cast<std::size_t>(aligned(std::max<std::int64_t>(nbytes, 1))));
  if (p == nullptr) throw std::bad_alloc();
  return c10::DataPtr(p, p, &free_aligned, c10::Device(c10::kCPU));
}

bool owns_aligned(const c10::Storage& storage) { return storage.data_ptr().get_deleter() == &free_aligned; }

// Frees a storage's bytes; the tensor keeps its shape.
void release(const torch::Tensor& tensor) {
  c10::Storage storage = tensor.storage();
  storage.set_data_ptr_noswap(c10::DataPtr(nullptr, c10::Device(c10::kCPU)));
  storage.set_nbytes(0);
}

// pread or pwrite the whole length of `fd` at `offset`, retrying EINTR and any error `handled`
// takes care of (returns true: try again); the errors name `what`.
void transfer_all(int fd, bool writing, char* data, std::int64_t length, std::int64_t offset, const std::string& what,
                  const std::function<bool(int err)>& handled = {}) {
  while (length > 0) {
    const ssize_t n = writing ? ::pwrite(fd, data, static_cast<std::size_t>(length), offset)
                              : ::pread(fd, data, static_cast<std::size_t>(length), offset);
    const int err = errno;
    if (n < 0 && (err == EINTR || (handled && handled(err)))) continue;
    if (n < 0) core::throw_errno(std::string(writing ? "writing " : "reading ") + what, err);
    if (n == 0) throw IoError("reading " + what + ": it ends early (truncated by another process?)");
    data += n;
    length -= n;
    offset += n;
  }
}

}  // namespace

PartSpill::PartSpill(const std::filesystem::path& dir, std::string key) : dir_(dir), key_(std::move(key)) {
  SwapOptions options;  // the swap's message for a path that is not a directory
  options.nvme_path = dir_;
  options.key = key_;
  StateSwapper::check(options);
  std::string name = (dir_ / "hpctrial-parts-XXXXXX").string();
  fd_ = ::mkostemp(name.data(), O_CLOEXEC);
  if (fd_ < 0) {
    const int err = errno;
    throw ConfigError(key_ + " " + dir_.string() + ": cannot make a file there for the parameters' parts: " +
                      std::strerror(err) + "; give a directory every rank can write");
  }
  ::unlink(name.c_str());
}

PartSpill::~PartSpill() {
  if (fd_ >= 0) ::close(fd_);
}

std::int64_t PartSpill::write(const torch::Tensor& part) {
  if (!part.device().is_cpu() || !part.is_contiguous()) throw InternalError("PartSpill: a part that is not a contiguous CPU tensor");
  const auto nbytes = static_cast<std::int64_t>(part.nbytes());
  const std::int64_t offset = end_;
  transfer_all(fd_, true, static_cast<char*>(part.data_ptr()), nbytes, offset, what());
  end_ += nbytes;
  release(part);
  return offset;
}

void PartSpill::read(std::int64_t offset, std::int64_t nbytes, void* into) const {
  transfer_all(fd_, false, static_cast<char*>(into), nbytes, offset, what());
}

struct StateSwapper::Loaded {
  struct Entry {
    torch::Tensor tensor;
    std::int64_t offset = 0, nbytes = 0;
    c10::DataPtr data;
  };
  std::vector<Entry> entries;
};

void StateSwapper::check(const SwapOptions& options) {
  std::error_code ec;
  if (!std::filesystem::is_directory(options.nvme_path, ec)) {
    throw ConfigError(options.key + " " + options.nvme_path.string() + " is not a directory: create it on each "
                      "node's local disk (a fast one: the optimizer state is read and written there every step), or "
                      "give another");
  }
}

StateSwapper::StateSwapper(torch::optim::Optimizer& optimizer, SwapOptions options)
    : optimizer_(optimizer), options_(std::move(options)) {
  check(options_);
  const std::string where = options_.key + " " + options_.nvme_path.string();
  if (!has_state_codec(optimizer_)) {
    throw ConfigError(where + ": the optimizer's class keeps its state in a form hpctrial cannot swap; use SGD, Adam, "
                      "AdamW, Adagrad or RMSprop, or remove offload_optimizer");
  }
  std::string name = (options_.nvme_path / ("hpctrial-optimizer-rank" + std::to_string(options_.rank) + "-XXXXXX"));
  if (::mkdtemp(name.data()) == nullptr) {
    const int err = errno;
    throw ConfigError(where + ": cannot make this rank's swap directory there: " + std::strerror(err) +
                      "; give a directory every rank can write");
  }
  dir_ = name;
  file_ = dir_ / "state.swp";
  try {
    // Created buffered, then switched to direct I/O: a file system that refuses O_DIRECT (tmpfs
    // before Linux 6.6) keeps the page cache.
    fd_ = ::open(file_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd_ < 0) {
      const int err = errno;
      throw ConfigError(where + ": cannot make the swap file " + file_.string() + ": " + std::strerror(err));
    }
    const int flags = ::fcntl(fd_, F_GETFL);
    if (flags < 0 || ::fcntl(fd_, F_SETFL, flags | O_DIRECT) != 0) buffered();
    plan();
    write_out_all();  // state made with the optimizer (Adagrad's sums)
  } catch (...) {
    if (fd_ >= 0) ::close(fd_);
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    throw;
  }
}

StateSwapper::~StateSwapper() {
  if (fd_ >= 0) ::close(fd_);
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

void StateSwapper::buffered() {
  if (!direct_.exchange(false)) return;
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags >= 0) ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT);
  core::log_warning("{} {} does not take direct I/O (O_DIRECT): the optimizer state is swapped through the page cache",
                    options_.key, options_.nvme_path.string());
}

void StateSwapper::transfer(bool writing, char* data, std::int64_t length, std::int64_t offset) {
  // Opened direct, but a file system that refuses direct transfers says EINVAL: buffered then.
  transfer_all(fd_, writing, data, length, offset, "the optimizer state swap file " + file_.string(), [this](int err) {
    if (err != EINVAL || !direct_) return false;
    buffered();
    return true;
  });
}

void StateSwapper::plan() {
  for (auto& group : optimizer_.param_groups()) {
    std::int64_t filled = 0;
    for (const auto& p : group.params()) {
      if (filled == 0) sub_groups_.emplace_back();
      sub_groups_.back().push_back(p);
      filled += p.numel();
      if (filled >= options_.sub_group_elements) filled = 0;
    }
  }
}

std::vector<torch::Tensor> StateSwapper::state_of(const torch::Tensor& parameter) const {
  auto tensors = parameter_state_tensors(optimizer_, parameter);
  std::vector<torch::Tensor> out;
  for (auto& t : tensors) {
    if (t.numel() > 0) out.push_back(std::move(t));
  }
  return out;
}

std::size_t StateSwapper::fields(std::size_t sub_group) {
  for (const auto& p : sub_groups_.at(sub_group)) {
    const auto tensors = state_of(p);
    if (!tensors.empty()) return tensors.size();
  }
  return 0;
}

StateSwapper::Slot& StateSwapper::slot(const torch::Tensor& parameter, std::size_t field, std::int64_t nbytes) {
  Slot& s = slots_[{parameter.unsafeGetTensorImpl(), field}];
  if (s.nbytes != nbytes) {  // a new tensor, or one of another size
    if (s.nbytes > 0 && mapped(s.unmapped)) retired_.push_back({s.offset, aligned(s.nbytes), s.unmapped});
    s.offset = allocate(aligned(nbytes));
    s.nbytes = nbytes;
    s.unmapped.reset();
  } else if (mapped(s.unmapped)) {  // a checkpoint still reads the last bytes: these go elsewhere
    retired_.push_back({s.offset, aligned(nbytes), s.unmapped});
    s.offset = allocate(aligned(nbytes));
    s.unmapped.reset();
  }
  s.mapping.reset();
  return s;
}

std::int64_t StateSwapper::allocate(std::int64_t length) {
  for (auto it = retired_.begin(); it != retired_.end(); ++it) {
    if (it->length == length && !mapped(it->unmapped)) {
      const std::int64_t offset = it->offset;
      retired_.erase(it);
      return offset;
    }
  }
  const std::int64_t offset = end_;
  end_ += length;
  return offset;
}

std::shared_ptr<const checkpoint::Buffer> StateSwapper::bytes_of(const torch::Tensor& state) {
  const auto nbytes = static_cast<std::size_t>(state.nbytes());
  if (!swapped_out(state)) {
    auto copy = std::make_shared<checkpoint::Buffer>(nbytes);
    if (nbytes > 0) std::memcpy(copy->data(), state.contiguous().data_ptr(), nbytes);
    return copy;
  }
  const auto it = slot_of_storage_.find(state.storage().unsafeGetStorageImpl());
  if (it == slot_of_storage_.end()) throw InternalError("a swapped-out optimizer state tensor has no place in " + file_.string());
  Slot& s = slots_.at(it->second);
  if (auto live = s.mapping.lock()) return std::make_shared<checkpoint::Buffer>(live, s.mapped, nbytes);
  void* mapped = ::mmap(nullptr, nbytes, PROT_READ, MAP_SHARED, fd_, s.offset);
  if (mapped == MAP_FAILED) {
    const int err = errno;
    core::throw_errno("mapping the optimizer state swap file " + file_.string(), err);
  }
  // The region is free again once unmapped, not before: a direct write must not meet its pages.
  auto unmapped = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<const void> mapping(mapped, [nbytes, unmapped](const void* p) {
    ::munmap(const_cast<void*>(p), nbytes);
    unmapped->store(true);
  });
  s.mapping = mapping;
  s.mapped = mapped;
  s.unmapped = unmapped;
  return std::make_shared<checkpoint::Buffer>(mapping, mapped, nbytes);
}

std::vector<std::pair<std::size_t, torch::Tensor>> StateSwapper::swapped_of(const torch::Tensor& parameter) const {
  std::vector<std::pair<std::size_t, torch::Tensor>> out;
  auto state = state_of(parameter);
  for (std::size_t f = 0; f < state.size(); ++f) out.emplace_back(f, std::move(state[f]));
  if (options_.parameters && parameter.numel() > 0) out.emplace_back(kParameter, parameter);
  return out;
}

void StateSwapper::add_entries(Loaded& loaded, const torch::Tensor& parameter,
                               const std::vector<std::pair<std::size_t, torch::Tensor>>& tensors) {
  for (const auto& [field, tensor] : tensors) {
    if (!swapped_out(tensor)) continue;  // in memory already
    const auto it = slots_.find({parameter.unsafeGetTensorImpl(), field});
    if (it == slots_.end()) throw InternalError("a swapped-out optimizer tensor has no place in " + file_.string());
    loaded.entries.push_back({tensor, it->second.offset, it->second.nbytes, {}});
  }
}

StateSwapper::Loaded StateSwapper::read(std::size_t sub_group) {
  // Listed on the optimizer's thread (a step may add state meanwhile); fill() reads the bytes.
  Loaded loaded;
  for (const auto& p : sub_groups_.at(sub_group)) add_entries(loaded, p, swapped_of(p));
  return loaded;
}

void StateSwapper::bring_in(const std::vector<torch::Tensor>& parameters) {
  if (!options_.parameters) return;
  Loaded loaded;
  for (const auto& p : parameters) add_entries(loaded, p, {{kParameter, p}});
  fill(loaded);
  install(loaded);
}

void StateSwapper::let_go(const std::vector<torch::Tensor>& parameters, bool changed) {
  if (!options_.parameters) return;
  for (const auto& p : parameters) {
    if (p.numel() == 0 || swapped_out(p)) continue;
    // Unchanged, the bytes in the file are the parameter's still (read by bring_in or written by a step).
    if (changed || slot_of_storage_.count(p.storage().unsafeGetStorageImpl()) == 0) {
      write_tensor(p, kParameter, p);
    } else {
      release(p);
    }
  }
}

void StateSwapper::take_over(const torch::Tensor& parameter, const PartSpill& spill, std::int64_t offset) {
  if (!options_.parameters || !swapped_out(parameter)) throw InternalError("StateSwapper::take_over: nothing to take");
  const auto nbytes = static_cast<std::int64_t>(parameter.nbytes());
  c10::DataPtr data = aligned_buffer(nbytes);
  spill.read(offset, nbytes, data.get());
  c10::Storage storage = parameter.storage();
  storage.set_data_ptr_noswap(std::move(data));
  storage.set_nbytes(static_cast<std::size_t>(nbytes));
  write_tensor(parameter, kParameter, parameter);
}

void StateSwapper::fill(Loaded& loaded) {
  for (auto& e : loaded.entries) {
    e.data = aligned_buffer(e.nbytes);
    transfer(false, static_cast<char*>(e.data.get()), aligned(e.nbytes), e.offset);
  }
}

void StateSwapper::install(Loaded& loaded) {
  for (auto& e : loaded.entries) {
    c10::Storage storage = e.tensor.storage();
    storage.set_data_ptr_noswap(std::move(e.data));
    storage.set_nbytes(static_cast<std::size_t>(e.nbytes));
  }
  loaded.entries.clear();
}

void StateSwapper::write_tensor(const torch::Tensor& parameter, std::size_t field, const torch::Tensor& tensor) {
  c10::Storage storage = tensor.storage();
  const auto nbytes = static_cast<std::int64_t>(storage.nbytes());
  if (nbytes == 0) return;  // out already
  const Slot& s = slot(parameter, field, nbytes);
  char* data = static_cast<char*>(storage.data());
  c10::DataPtr staging;
  if (!owns_aligned(storage)) {  // made by the optimizer: copied where direct I/O can take it
    staging = aligned_buffer(nbytes);
    std::memcpy(staging.get(), data, static_cast<std::size_t>(nbytes));
    data = static_cast<char*>(staging.get());
  }
  try {
    transfer(true, data, aligned(nbytes), s.offset);
  } catch (...) {
    // The file does not hold these bytes: the tensor keeps them, and is written again next time.
    slot_of_storage_.erase(storage.unsafeGetStorageImpl());
    throw;
  }
  slot_of_storage_[storage.unsafeGetStorageImpl()] = {parameter.unsafeGetTensorImpl(), field};
  release(tensor);
}

void StateSwapper::write_out(std::size_t sub_group) {
  for (const auto& p : sub_groups_.at(sub_group)) write_out_parameter(p);
}

void StateSwapper::step() {
  // Every parameter's gradient set aside: the optimizer steps those of one sub-group at a time.
  std::vector<std::vector<torch::Tensor>> grads(sub_groups_.size());
  for (std::size_t k = 0; k < sub_groups_.size(); ++k) {
    for (auto& p : sub_groups_[k]) grads[k].push_back(std::exchange(p.mutable_grad(), torch::Tensor()));
  }
  const auto restore = [&] {
    for (std::size_t k = 0; k < sub_groups_.size(); ++k) {
      for (std::size_t i = 0; i < sub_groups_[k].size(); ++i) sub_groups_[k][i].mutable_grad() = grads[k][i];
    }
  };
  Loaded next, following;
  std::future<void> ahead;  // fills `following`; declared after it, so that it ends first
  try {
    next = read(0);
    fill(next);
    for (std::size_t k = 0; k < sub_groups_.size(); ++k) {
      install(next);
      following = {};
      if (k + 1 < sub_groups_.size()) {
        following = read(k + 1);
        // Read ahead while this sub-group steps, when the buffers hold both sub-groups' state.
        if (fields(k) + fields(k + 1) <= static_cast<std::size_t>(options_.buffer_count)) {
          ahead = std::async(std::launch::async, [this, &following] { fill(following); });
        }
      }
      for (std::size_t i = 0; i < sub_groups_[k].size(); ++i) sub_groups_[k][i].mutable_grad() = grads[k][i];
      optimizer_.step();
      for (std::size_t i = 0; i < sub_groups_[k].size(); ++i) {  // stepped: freed
        sub_groups_[k][i].mutable_grad() = torch::Tensor();
        grads[k][i] = torch::Tensor();
      }
      if (fields(k) > static_cast<std::size_t>(options_.buffer_count)) {
        throw ConfigError(options_.key.substr(0, options_.key.rfind('.')) + ".buffer_count " +
                          std::to_string(options_.buffer_count) + " holds fewer than the " + std::to_string(fields(k)) +
                          " state tensors the optimizer keeps for a parameter: raise it to at least that");
      }
      write_out(k);
      if (ahead.valid()) {
        ahead.get();
      } else if (k + 1 < sub_groups_.size()) {
        fill(following);
      }
      next = std::move(following);
    }
  } catch (...) {
    if (ahead.valid()) ahead.wait();
    restore();
    throw;
  }
}

void StateSwapper::write_out_parameter(const torch::Tensor& parameter) {
  for (const auto& [field, tensor] : swapped_of(parameter)) write_tensor(parameter, field, tensor);
}

void StateSwapper::write_out_all() {
  for (std::size_t k = 0; k < sub_groups_.size(); ++k) write_out(k);
}

std::int64_t StateSwapper::swapped_elements() const {
  std::int64_t sum = 0;
  for (const auto& group : sub_groups_) {
    for (const auto& p : group) {
      for (const auto& t : state_of(p)) sum += swapped_out(t) ? t.numel() : 0;
    }
  }
  return sum;
}

}  // namespace hpctrial::trainer::detail
