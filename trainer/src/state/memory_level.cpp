// A rank's copies in node memory: the slots in its folder, the thread that fills them, and the
// check that two copies of every rank on the node fit.
#include "state/memory_level.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <system_error>

#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "state/state_io.h"

namespace hpctrial::trainer::detail {
namespace {

std::string gib(std::uint64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return text;
}

}  // namespace

MemoryLevel::MemoryLevel(const core::CheckpointLevels& levels, rank::NodeMemoryPlace place, int ranks_on_node)
    : levels_(levels), ranks_on_node_(std::max(1, ranks_on_node)), memory_(std::move(place)) {
  slots_ = std::make_unique<checkpoint::MemorySlots>(memory_.dir());
  thread_ = std::thread([this] { run(); });
}

MemoryLevel::~MemoryLevel() { stop_thread(); }

void MemoryLevel::stop_thread() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void MemoryLevel::check_fits(std::uint64_t bytes) const {
  const std::uint64_t needed = 2 * bytes * static_cast<std::uint64_t>(ranks_on_node_);
  const std::uint64_t node = rank::NodeMemory::node_bytes();
  const auto allowed = static_cast<std::uint64_t>(levels_.memory_max_share * static_cast<double>(node));
  if (node > 0 && needed > allowed) {
    throw ConfigError("checkpoint_levels.memory: two copies of each of this node's " + std::to_string(ranks_on_node_) +
                      " ranks' state take " + gib(needed) + ", over max_share " +
                      std::to_string(levels_.memory_max_share).substr(0, 4) + " of the node's " + gib(node) +
                      "; raise checkpoint_levels.memory.max_share, or leave the memory level out");
  }
  // This rank's two copies, less what its copies of an earlier attempt take (the new replace them).
  std::uint64_t own = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(memory_.dir(), ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_regular_file(ec)) own += it->file_size(ec);
  }
  const std::uint64_t free = rank::NodeMemory::free_bytes(memory_.dir());
  if (free > 0 && 2 * bytes > free + own) {
    throw ConfigError("checkpoint_levels.memory: two copies of this rank's state take " + gib(2 * bytes) + " and " +
                      levels_.memory_dir + " has " + gib(free) + " free; give it more room (a tmpfs's size=), or "
                      "set checkpoint_levels.memory.dir to one that has it");
  }
}

void MemoryLevel::submit(Snapshot snapshot) {
  if (!checked_) {
    std::uint64_t bytes = 0;
    for (const auto& d : snapshot.contents.datasets) bytes += d.nbytes();
    for (const auto& d : snapshot.deferred) bytes += d.tensor.nbytes();
    check_fits(bytes);
    checked_ = true;
  }
  memory_.touch();
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return !busy_ && !pending_; });
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  copying_ = !snapshot.deferred.empty();
  pending_ = std::move(snapshot);
  changed_.notify_all();
}

void MemoryLevel::wait_for_copies() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return !copying_; });
}

std::optional<double> MemoryLevel::take_write_seconds() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(write_seconds_, std::nullopt);
}

void MemoryLevel::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return stopping_ || pending_.has_value(); });
    if (!pending_) return;
    Snapshot snapshot = std::move(*pending_);
    pending_.reset();
    busy_ = true;
    write_seconds_.reset();
    lock.unlock();
    const auto started = std::chrono::steady_clock::now();
    std::exception_ptr error;
    try {
      write(snapshot);
    } catch (...) {
      error = std::current_exception();
    }
    snapshot = Snapshot();
    lock.lock();
    copying_ = false;
    busy_ = false;
    if (error) error_ = error;
    if (!error) write_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    changed_.notify_all();
  }
}

// The live tensors first, each copied into the slot and checksummed in one pass (training waits
// for them), then the rest of the snapshot, then the commit.
void MemoryLevel::write(Snapshot& snapshot) {
  const std::size_t live = snapshot.deferred.size();
  std::vector<checkpoint::SlotDataset> datasets;
  for (const auto& d : snapshot.deferred) {
    datasets.push_back({d.name, checkpoint_dtype(d.tensor.scalar_type()), d.tensor.sizes().vec(),
                        static_cast<std::size_t>(d.tensor.nbytes())});
  }
  for (const auto& d : snapshot.contents.datasets) datasets.push_back({d.name, d.dtype, d.shape, d.nbytes()});
  const auto started = std::chrono::steady_clock::now();
  const std::int64_t batches = std::stoll(snapshot.contents.attributes.at(checkpoint::kBatchesAttribute));
  checkpoint::MemorySlots::Copy copy = slots_->begin(batches, std::move(datasets), snapshot.contents.attributes);
  try {
    for (std::size_t k = 0; k < live; ++k) {
      const torch::Tensor source = snapshot.deferred[k].tensor.contiguous();
      copy.set_crc32c(k, checkpoint::copy_crc32c(copy.data(k), source.data_ptr(), static_cast<std::size_t>(source.nbytes())));
    }
  } catch (...) {
    snapshot.deferred.clear();
    throw;
  }
  core::log_debug("memory copy of batch {}: live tensors copied in {:.3f} s", batches,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  snapshot.deferred.clear();  // the live tensors are no longer needed: training may step
  {
    std::lock_guard<std::mutex> lock(mutex_);
    copying_ = false;
  }
  changed_.notify_all();
  for (std::size_t j = 0; j < snapshot.contents.datasets.size(); ++j) {
    const checkpoint::Dataset& d = snapshot.contents.datasets[j];
    copy.set_crc32c(live + j, d.nbytes() == 0 ? checkpoint::crc32c(nullptr, 0)
                                              : checkpoint::copy_crc32c(copy.data(live + j), d.data->data(), d.nbytes()));
  }
  if (snapshot.before_publish) snapshot.before_publish();
  copy.commit();
}

std::vector<std::int64_t> MemoryLevel::held() const { return slots_->held(); }

checkpoint::CheckpointStore::Loaded MemoryLevel::load(std::int64_t batches) const { return slots_->load(batches); }

void MemoryLevel::remove() {
  stop_thread();  // waits for the copy being written
  slots_.reset();
  memory_.remove();
}

}  // namespace hpctrial::trainer::detail
