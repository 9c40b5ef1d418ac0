// A rank's copies in node memory: the slots in its folder, the thread that fills them, and the
// check that two copies of every rank on the node fit.
#include "state/memory_level.h"

#include <torch/torch.h>

#include <sched.h>

#include <chrono>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
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
  slots_ = std::make_shared<checkpoint::MemorySlots>(memory_.dir());
  thread_ = std::thread([this] { run(); });
  try {
    copier_ = std::thread([this] { copy_pieces(); });
  } catch (...) {
    stop_thread();
    throw;
  }
}

MemoryLevel::~MemoryLevel() {
  stop_thread();
  {
    std::lock_guard<std::mutex> lock(progress_->mutex);
    progress_->closed = true;
  }
  progress_->changed.notify_all();
}

void MemoryLevel::stop_thread() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
  if (!copier_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);  // the level's thread handed out its last work
    copier_stopping_ = true;
  }
  changed_.notify_all();
  copier_.join();
}

void MemoryLevel::set_partners(std::unique_ptr<comm::Communicator> comm, rank::Partners partners) {
  partner_comm_ = std::move(comm);
  partners_ = std::move(partners);
}

void MemoryLevel::check_fits(std::uint64_t bytes) const {
  // Two copies of each rank's own, and two of each it keeps for a partner (of about its size).
  const auto copies = static_cast<std::uint64_t>(2 * (1 + partners_.receive_from.size()));
  const std::uint64_t needed = copies * bytes * static_cast<std::uint64_t>(ranks_on_node_);
  const std::uint64_t node = rank::NodeMemory::node_bytes();
  const auto allowed = static_cast<std::uint64_t>(levels_.memory_max_share * static_cast<double>(node));
  if (node > 0 && needed > allowed) {
    throw ConfigError("checkpoint_levels.memory: " + std::to_string(copies) + " copies of each of this node's " +
                      std::to_string(ranks_on_node_) + " ranks' state (two of its own" +
                      (copies > 2 ? std::string(", two of each partner's") : std::string()) + ") take " + gib(needed) + ", over max_share " +
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
  if (free > 0 && copies * bytes > free + own) {
    throw ConfigError("checkpoint_levels.memory: " + std::to_string(copies) + " copies of this rank's state take " +
                      gib(copies * bytes) + " and " +
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
  if (!copying_) return;
  const auto started = std::chrono::steady_clock::now();
  std::shared_ptr<CopyWork> taken;
  while (true) {
    changed_.wait(lock, [&] { return !copying_ || (work_ && work_ != taken); });
    if (!copying_) break;
    taken = work_;
    lock.unlock();
    taken->take(mutex_, changed_);
    lock.lock();
  }
  waited_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
}

bool MemoryLevel::next_copy_would_wait(std::int64_t batches) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (busy_ || pending_) {  // the copy in flight changes which slot the next one takes
      std::lock_guard<std::mutex> pins(progress_->mutex);
      return !progress_->pinned.empty();
    }
  }
  std::lock_guard<std::mutex> pins(progress_->mutex);
  const auto replaced = slots_->replaces(batches);
  return replaced && progress_->pinned.count(*replaced) != 0;
}

void MemoryLevel::CopyWork::take(std::mutex& mutex, std::condition_variable& changed) {
  for (std::size_t i = next++; i < pieces.size(); i = next++) {
    Piece& piece = pieces[i];
    try {
      piece.crc = checkpoint::copy_crc32c(to[piece.tensor] + piece.offset, from[piece.tensor] + piece.offset, piece.size);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!error) error = std::current_exception();
    }
    if (++done == pieces.size()) {
      { std::lock_guard<std::mutex> lock(mutex); }  // the thread waiting for the last piece sees it
      changed.notify_all();
    }
  }
}

std::optional<double> MemoryLevel::take_wait_seconds() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(wait_seconds_, std::nullopt);
}

// The live tensors' pieces take only the cycles training leaves (a step waiting for its device,
// for its peers, for data): at the idle scheduling class, this thread runs when no other thread
// of the node wants a core. Training that leaves none takes the pieces itself when its optimizer
// must wait for them (wait_for_copies). The level's thread, which commits the copy and exchanges
// it with the partners, keeps the ordinary class: a copy is held as soon as its bytes are in.
void MemoryLevel::copy_pieces() {
  sched_param idle{};
  if (::sched_setscheduler(0, SCHED_IDLE, &idle) != 0) {
    core::log_debug("checkpoint_levels.memory: the copying thread keeps its scheduling class: {}", std::strerror(errno));
  }
  std::shared_ptr<CopyWork> seen;
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return (work_ && work_ != seen) || copier_stopping_; });
    if (!work_ || work_ == seen) return;
    seen = work_;
    lock.unlock();
    seen->take(mutex_, changed_);
    lock.lock();
  }
}

void MemoryLevel::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return stopping_ || pending_.has_value(); });
    if (!pending_) return;
    Snapshot snapshot = std::move(*pending_);
    pending_.reset();
    busy_ = true;
    wait_seconds_.reset();
    lock.unlock();
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
    if (!error) wait_seconds_ = waited_s_;
    waited_s_ = 0;
    changed_.notify_all();
  }
}

// This rank's copy, then, with partners, the exchange: sent whether or not the copy was made (the
// partner waits for it), then the error, if any.
void MemoryLevel::write(Snapshot& snapshot) {
  const std::int64_t batches = std::stoll(snapshot.contents.attributes.at(checkpoint::kBatchesAttribute));
  std::exception_ptr error;
  try {
    write_own(snapshot, batches);
  } catch (...) {
    error = std::current_exception();
    snapshot.deferred.clear();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      copying_ = false;
    }
    changed_.notify_all();
  }
  finished(batches, error);
  if (partner_comm_) exchange(batches, error == nullptr);
  if (error) std::rethrow_exception(error);
}

void MemoryLevel::finished(std::int64_t batches, const std::exception_ptr& error) {
  std::string why;
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      why = e.what();
    } catch (...) {
      why = "an unknown error";
    }
  }
  {
    std::lock_guard<std::mutex> lock(progress_->mutex);
    progress_->finished = batches;
    if (error) {
      progress_->failed = batches;
      progress_->error = why;
    }
  }
  progress_->changed.notify_all();
}

std::function<checkpoint::Contents()> MemoryLevel::pinned_copy(std::int64_t batches) {
  const std::shared_ptr<Progress> progress = progress_;
  {
    std::lock_guard<std::mutex> lock(progress->mutex);
    progress->pinned.insert(batches);
  }
  // Unpins when the last of the function and the views is gone.
  std::shared_ptr<const void> pin(nullptr, [progress, batches](const void*) {
    {
      std::lock_guard<std::mutex> lock(progress->mutex);
      progress->pinned.erase(progress->pinned.find(batches));
    }
    progress->changed.notify_all();
  });
  return [progress, pin, slots = slots_, batches] {
    {
      std::unique_lock<std::mutex> lock(progress->mutex);
      progress->changed.wait(lock, [&] { return progress->finished >= batches || progress->closed; });
      if (progress->failed == batches) {
        throw CheckpointError("the copy in node memory of batch " + std::to_string(batches) +
                              ", which the checkpoint is written from, failed: " + progress->error);
      }
      if (progress->finished < batches) {
        throw CheckpointError("the memory level closed before its copy of batch " + std::to_string(batches) +
                              ", which the checkpoint is written from, was made");
      }
    }
    return slots->load(batches, pin).contents;
  };
}

// Before a copy replaces one a checkpoint is being written from: until it is written.
void MemoryLevel::wait_until_unpinned(std::int64_t batches) {
  std::unique_lock<std::mutex> lock(progress_->mutex);
  progress_->changed.wait(lock, [&] {
    const auto replaced = slots_->replaces(batches);
    return !replaced || progress_->pinned.count(*replaced) == 0;
  });
}

// The copy goes to the partner while those of the ranks this one keeps arrive; every rank of the
// trial exchanges at the same copy.
void MemoryLevel::exchange(std::int64_t batches, bool have_copy) {
  const auto started = std::chrono::steady_clock::now();
  std::optional<checkpoint::MemorySlots::Image> image;
  if (have_copy) image = slots_->image(batches);
  std::vector<char> no_header;
  std::vector<comm::WorkHandle> sends;
  if (partners_.send_to >= 0) sends = rank::send_copy(*partner_comm_, image, partners_.send_to, no_header);
  std::exception_ptr error;
  for (const int source : partners_.receive_from) {
    try {
      rank::receive_copy(*partner_comm_, kept_slots(source), source);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  for (auto& send : sends) send->wait();
  if (error) std::rethrow_exception(error);
  core::log_debug("memory copy of batch {}: exchanged with the partners in {:.3f} s", batches,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
}

checkpoint::MemorySlots& MemoryLevel::kept_slots(int source) {
  auto& slots = kept_[source];
  if (!slots) {
    const std::string dir = rank::partner_dir(memory_.dir(), source);
    std::error_code ec;
    std::filesystem::create_directory(dir, ec);
    if (ec) throw IoError("cannot make " + dir + ": " + ec.message());
    std::filesystem::permissions(dir, std::filesystem::perms::owner_all, ec);
    slots = std::make_unique<checkpoint::MemorySlots>(dir);
  }
  return *slots;
}

std::map<int, std::vector<std::int64_t>> MemoryLevel::kept() {
  std::map<int, std::vector<std::int64_t>> out;
  for (const int source : rank::partner_sources(memory_.dir())) {
    auto held = kept_slots(source).held();
    if (!held.empty()) out[source] = std::move(held);
  }
  return out;
}

void MemoryLevel::restore(const std::vector<std::pair<int, int>>& moves, std::int64_t batches) {
  if (!partner_comm_) throw CheckpointError("no partner level to restore copies from");
  const int me = partner_comm_->rank();
  std::vector<std::vector<char>> no_headers(moves.size());
  std::vector<std::optional<checkpoint::MemorySlots::Image>> images(moves.size());
  std::vector<comm::WorkHandle> sends;
  for (std::size_t i = 0; i < moves.size(); ++i) {
    const auto [owner, keeper] = moves[i];
    if (keeper != me) continue;
    images[i] = kept_slots(owner).image(batches);
    for (auto& send : rank::send_copy(*partner_comm_, images[i], owner, no_headers[i])) sends.push_back(std::move(send));
  }
  std::string problem;
  for (const auto& [owner, keeper] : moves) {
    if (owner != me) continue;
    try {
      const auto got = rank::receive_copy(*partner_comm_, *slots_, keeper);
      if (got != batches) {
        problem = "rank " + std::to_string(keeper) + " holds no whole copy of this rank's state at batch " +
                  std::to_string(batches);
      }
    } catch (const Error& e) {
      problem = e.what();
    }
  }
  for (auto& send : sends) send->wait();
  if (!problem.empty()) throw CheckpointError(problem);
}

void MemoryLevel::drop_kept_of_others() {
  for (const int source : rank::partner_sources(memory_.dir())) {
    const auto& mine = partners_.receive_from;
    if (std::find(mine.begin(), mine.end(), source) != mine.end()) continue;
    kept_.erase(source);
    std::error_code ignored;
    std::filesystem::remove_all(rank::partner_dir(memory_.dir(), source), ignored);
  }
}

// The live tensors first, each copied into the slot and checksummed in one pass (training waits
// for them), then the rest of the snapshot, then the commit.
void MemoryLevel::write_own(Snapshot& snapshot, std::int64_t batches) {
  const std::size_t live = snapshot.deferred.size();
  std::vector<checkpoint::SlotDataset> datasets;
  for (const auto& d : snapshot.deferred) {
    datasets.push_back({d.name, checkpoint_dtype(d.tensor.scalar_type()), d.tensor.sizes().vec(),
                        static_cast<std::size_t>(d.tensor.nbytes())});
  }
  for (const auto& d : snapshot.contents.datasets) datasets.push_back({d.name, d.dtype, d.shape, d.nbytes()});
  wait_until_unpinned(batches);
  const auto started = std::chrono::steady_clock::now();
  checkpoint::MemorySlots::Copy copy = slots_->begin(batches, std::move(datasets), snapshot.contents.attributes);
  // The live tensors in pieces of at most 8 MiB, for the copier (copy_pieces) and for a training
  // thread that must wait for them (wait_for_copies); each piece is checksummed as it is copied.
  constexpr std::size_t kPiece = std::size_t{8} << 20;
  auto work = std::make_shared<CopyWork>();
  std::vector<torch::Tensor> sources;
  for (std::size_t k = 0; k < live; ++k) {
    sources.push_back(snapshot.deferred[k].tensor.contiguous());
    const auto size = static_cast<std::size_t>(sources.back().nbytes());
    work->from.push_back(static_cast<const char*>(sources.back().data_ptr()));
    work->to.push_back(static_cast<char*>(copy.data(k)));
    for (std::size_t at = 0; at < size; at += kPiece) work->pieces.push_back({k, at, std::min(kPiece, size - at), 0});
  }
  {
    std::unique_lock<std::mutex> lock(mutex_);
    work_ = work;
    changed_.notify_all();  // the copier takes the pieces, and so does training when it must wait
    changed_.wait(lock, [&] { return work->done == work->pieces.size(); });
    work_.reset();
  }
  changed_.notify_all();
  if (work->error) {
    snapshot.deferred.clear();
    std::rethrow_exception(work->error);
  }
  std::vector<std::uint32_t> crcs(live, checkpoint::crc32c(nullptr, 0));
  std::vector<bool> begun(live, false);
  for (const CopyWork::Piece& piece : work->pieces) {
    crcs[piece.tensor] = begun[piece.tensor] ? checkpoint::crc32c_combine(crcs[piece.tensor], piece.crc, piece.size)
                                             : piece.crc;
    begun[piece.tensor] = true;
  }
  for (std::size_t k = 0; k < live; ++k) copy.set_crc32c(k, crcs[k]);
  sources.clear();
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
  kept_.clear();
  memory_.remove();
}

}  // namespace hpctrial::trainer::detail
