#include "data/stream_reader.h"

#include <string>
#include <utility>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {

std::vector<Batch> read_samples(StreamDataset& stream, std::uint64_t count) {
  std::vector<Batch> samples;
  samples.reserve(count);
  while (samples.size() < count) {
    auto sample = stream.next();
    if (!sample) break;
    samples.push_back(std::move(*sample));
  }
  return samples;
}

StreamReader::StreamReader(const DataLoader& loader, StreamPosition at, int rank)
    : loader_(loader), rank_(rank), at_(at) {
  StreamDataset& stream = *loader_.stream();
  stream.start(at_.pass);
  if (at_.offset > 0) stream.skip(at_.offset);
}

Batch StreamReader::next() {
  StreamDataset& stream = *loader_.stream();
  const auto batch_size = static_cast<std::uint64_t>(loader_.batch_size());
  std::vector<Batch> samples;
  while (samples.size() < batch_size) {
    auto more = read_samples(stream, batch_size - samples.size());
    at_.offset += more.size();
    for (auto& sample : more) samples.push_back(std::move(sample));
    if (samples.size() == batch_size) break;
    // The pass has ended.
    if (at_.offset == 0) {
      throw ConfigError("pass " + std::to_string(at_.pass) + " of the training stream of rank " +
                        std::to_string(rank_) + " gave no sample: a StreamDataset's every pass needs samples "
                        "(a rank's shard may be empty when there are fewer shards than ranks)");
    }
    if (loader_.drop_last()) {
      if (at_.offset < batch_size) {
        throw ConfigError("pass " + std::to_string(at_.pass) + " of the training stream of rank " +
                          std::to_string(rank_) + " has " + std::to_string(at_.offset) +
                          " sample(s), fewer than one batch of " + std::to_string(batch_size) +
                          ", and drop_last leaves a short batch out: make the passes longer or the batch smaller, "
                          "or drop drop_last");
      }
      samples.clear();
    }
    ++at_.pass;
    at_.offset = 0;
    stream.start(at_.pass);
  }
  Batch batch = loader_.collate_samples(std::move(samples));
  std::lock_guard<std::mutex> lock(mutex_);
  after_.push_back(at_);
  return batch;
}

StreamPosition StreamReader::take_position() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (after_.empty()) throw InternalError("StreamReader: a position taken for a batch not read");
  const StreamPosition position = after_.front();
  after_.pop_front();
  return position;
}

}  // namespace hpctrial::trainer::detail
