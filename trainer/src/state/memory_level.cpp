// A rank's copies in node memory: the store in its folder, the writer's thread, and the check
// that two copies of every rank on the node fit.
#include "state/memory_level.h"

#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <system_error>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {
namespace {

checkpoint::StoreOptions memory_store_options() {
  checkpoint::StoreOptions options;
  options.keep_latest = 2;  // a copy torn by the failure leaves the one before it
  options.keep_best = 0;
  options.direct_io = false;  // a tmpfs takes no O_DIRECT, and nothing is gained by it there
  return options;
}

std::string gib(std::uint64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return text;
}

}  // namespace

MemoryLevel::MemoryLevel(const core::CheckpointLevels& levels, rank::NodeMemoryPlace place, int ranks_on_node)
    : levels_(levels), ranks_on_node_(std::max(1, ranks_on_node)), memory_(std::move(place)) {
  store_ = std::make_unique<checkpoint::CheckpointStore>(memory_.dir(), memory_store_options());
  store_->remove_temporaries();  // a copy cut short when the rank died
  writer_ = std::make_unique<AsyncCheckpointWriter>(*store_);
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
  writer_->submit(std::move(snapshot));
}

std::vector<std::int64_t> MemoryLevel::held() const {
  std::vector<std::int64_t> out;
  for (const auto& info : store_->list(/*verify=*/false)) {
    if (info.valid) out.push_back(info.batches);
  }
  return out;
}

checkpoint::CheckpointStore::Loaded MemoryLevel::load(std::int64_t batches) const {
  return checkpoint::load_checkpoint_at(store_->path_for(batches));
}

void MemoryLevel::remove() {
  writer_.reset();  // waits for the copy being written
  store_.reset();
  memory_.remove();
}

}  // namespace hpctrial::trainer::detail
