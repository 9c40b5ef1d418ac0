// The thread that writes and publishes the chief's checkpoints (checkpointing.h).
#include <chrono>
#include <exception>

#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "state/checkpointing.h"
#include "state/state_io.h"

namespace hpctrial::trainer::detail {
namespace {

// The contents of a snapshot of a copy made elsewhere (Snapshot::source), unless an error came
// first; the seconds spent on it, which training does not wait for: no cost of the checkpoint.
double take_source(Snapshot& snapshot, std::exception_ptr& error) {
  if (!snapshot.source || error) return 0;
  const auto asked = std::chrono::steady_clock::now();
  try {
    snapshot.contents = snapshot.source();
  } catch (...) {
    error = std::current_exception();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - asked).count();
}

}  // namespace

AsyncCheckpointWriter::AsyncCheckpointWriter(checkpoint::CheckpointStore& store)
    : store_(store), thread_([this] { run(); }) {}

AsyncCheckpointWriter::~AsyncCheckpointWriter() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void AsyncCheckpointWriter::submit(Snapshot snapshot) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return !busy_ && !pending_; });
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  copying_ = !snapshot.deferred.empty();
  write_seconds_.reset();
  pending_ = std::move(snapshot);
  changed_.notify_all();
}

void AsyncCheckpointWriter::wait_for_copies() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return !copying_; });
}

std::optional<std::string> AsyncCheckpointWriter::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return !busy_ && !pending_; });
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  return std::exchange(done_, std::nullopt);
}

std::optional<double> AsyncCheckpointWriter::take_write_seconds() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(write_seconds_, std::nullopt);
}

// A checkpoint other ranks write parts of: the chief's datasets into the laid-out file, then,
// once the loop has learnt that every rank's pieces are durable, publication. `written` is called
// whatever happens, since every rank waits for it.
std::exception_ptr AsyncCheckpointWriter::write_planned(PlannedWrite& planned, const checkpoint::Contents& contents,
                                                        std::exception_ptr error) {
  const auto message = [](const std::exception_ptr& e) -> std::string {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      return x.what();
    } catch (...) {
      return "an unknown error";
    }
  };
  bool reported = false;
  if (!error) {
    try {
      auto crcs = write_planned_datasets(contents, planned.plan, store_.write_options());
      planned.written({});
      reported = true;
      const auto shared = planned.pieces();
      crcs.insert(crcs.end(), shared.begin(), shared.end());
      store_.publish_planned(planned.plan, crcs);
      return nullptr;
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (!reported) planned.written(message(error));
  try {
    store_.abandon(planned.plan);
  } catch (...) {  // the first error is the one to tell
  }
  return error;
}

void AsyncCheckpointWriter::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return stopping_ || pending_.has_value(); });
    if (!pending_) return;
    Snapshot snapshot = std::move(*pending_);
    pending_.reset();
    busy_ = true;
    const auto started = std::chrono::steady_clock::now();
    // Buffers for the deferred tensors, from the pool where a size matches.
    std::vector<std::shared_ptr<checkpoint::Buffer>> buffers;
    for (const auto& d : snapshot.deferred) {
      const auto bytes = static_cast<std::size_t>(d.tensor.nbytes());
      const auto it = pool_.find(bytes);
      if (it != pool_.end()) {
        buffers.push_back(std::move(it->second));
        pool_.erase(it);
      } else {
        buffers.push_back(nullptr);
      }
    }
    lock.unlock();
    std::exception_ptr error;
    std::string path;
    try {
      // Copy the live tensors first: training waits for this before its next optimizer step.
      for (std::size_t k = 0; k < snapshot.deferred.size(); ++k) {
        const torch::Tensor source = snapshot.deferred[k].tensor.contiguous();
        if (!buffers[k]) buffers[k] = std::make_shared<checkpoint::Buffer>(static_cast<std::size_t>(source.nbytes()));
        // One pass over the live tensor: each piece is checksummed while it is in the cache.
        const std::uint32_t crc = checkpoint::copy_crc32c(buffers[k]->data(), source.data_ptr(),
                                                          static_cast<std::size_t>(source.nbytes()));
        snapshot.contents.add(snapshot.deferred[k].name, checkpoint_dtype(source.scalar_type()), source.sizes().vec(),
                              buffers[k]);
        snapshot.contents.datasets.back().crc32c = crc;
        snapshot.contents.datasets.back().crc32c_known = true;
      }
    } catch (...) {
      error = std::current_exception();
    }
    snapshot.deferred.clear();  // the live tensors are no longer needed
    lock.lock();
    copying_ = false;
    changed_.notify_all();
    lock.unlock();
    const double waited_for_source_s = take_source(snapshot, error);
    if (snapshot.planned) {
      error = write_planned(*snapshot.planned, snapshot.contents, error);
      if (!error) path = snapshot.planned->plan.path;
    } else if (!error) {
      try {
        path = store_.path_for(std::stoll(snapshot.contents.attributes.at(checkpoint::kBatchesAttribute)));
        if (snapshot.before_publish) snapshot.before_publish();
        store_.publish(snapshot.contents);
      } catch (...) {
        error = std::current_exception();
      }
    }
    snapshot.contents = checkpoint::Contents();  // releases the buffers' other owners
    snapshot.source = nullptr;                   // and the copy it was written from
    lock.lock();
    for (auto& buffer : buffers) {
      if (buffer && buffer.use_count() == 1) pool_.emplace(buffer->size(), std::move(buffer));
    }
    busy_ = false;
    write_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count() -
                     waited_for_source_s;
    if (error) {
      error_ = error;
    } else {
      done_ = path;
    }
    changed_.notify_all();
  }
}

}  // namespace hpctrial::trainer::detail
