// The loop's training data: an indexed dataset's order (sampler.h) or a stream, read ahead;
// and the per-rank state a checkpoint carries besides the model: where each rank's stream
// stands, and its custom training reducers.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/trainer/engine_trial.h"
#include "loop/loop.h"

namespace hpctrial::trainer::detail {

namespace {
// Every rank's `mine`, on the chief as an array in rank order (null elsewhere). A collective.
nlohmann::json gather_to_chief(comm::Communicator& comm, const nlohmann::json& mine) {
  const auto parts = comm.gather(mine.dump(), 0);
  nlohmann::json all = nlohmann::json::array();
  for (const auto& part : parts) all.push_back(nlohmann::json::parse(part));
  return all;
}
}  // namespace

// Every rank's model-parallel unit, checked against the others': as many replicas everywhere,
// and each replica made of as many ranks. A rank's part of the model is its place among the
// ranks of its replica (rank order); the first replica's rank of each part writes it into
// checkpoints. ConfigError on every rank for units that do not fit together.
ModelLayout agree_on_model_layout(comm::Communicator& comm, const core::ExperimentConfig& config,
                                  const ModelParallelUnit& mine) {
  const std::string line = std::to_string(mine.data_parallel_rank) + " " + std::to_string(mine.data_parallel_world_size);
  const auto all = comm.size() > 1 ? comm.allgather(line) : std::vector<std::string>{line};
  const int replicas = mine.data_parallel_world_size;
  std::vector<int> ranks_of_replica(static_cast<std::size_t>(replicas), 0);
  int part = 0;
  for (std::size_t r = 0; r < all.size(); ++r) {
    const auto space = all[r].find(' ');
    const int replica = std::stoi(all[r].substr(0, space)), size = std::stoi(all[r].substr(space + 1));
    if (size != replicas) {
      throw ConfigError("the model-parallel units disagree: rank " + std::to_string(r) + " has data_parallel_world_size " +
                        std::to_string(size) + " and rank " + std::to_string(comm.rank()) + " " +
                        std::to_string(replicas) + "; call context.set_mpu with the same number of replicas on "
                        "every rank (or on none)");
    }
    if (static_cast<int>(r) < comm.rank() && replica == mine.data_parallel_rank) ++part;
    ++ranks_of_replica.at(static_cast<std::size_t>(replica));
  }
  const int parts = comm.size() / replicas;
  for (int replica = 0; replica < replicas; ++replica) {
    if (ranks_of_replica[static_cast<std::size_t>(replica)] != parts) {
      throw ConfigError("the model-parallel units disagree: data-parallel replica " + std::to_string(replica) +
                        " has " + std::to_string(ranks_of_replica[static_cast<std::size_t>(replica)]) +
                        " rank(s), not " + std::to_string(parts) + " (" + std::to_string(comm.size()) + " ranks / " +
                        std::to_string(replicas) + " replicas); give each rank of one replica the same "
                        "data_parallel_rank");
    }
  }
  ModelLayout layout;
  layout.parts = parts;
  layout.part = parts > 1 ? "model_parallel/" + std::to_string(part) + "/" : "";
  // engine.pipeline's stages: the parts hold layers named by their place in the whole model.
  layout.pipeline = parts > 1 && config.engine && config.engine->pipeline.stages == parts;
  return layout;
}

void Loop::agree_on_model_parallelism() {
  const ModelLayout layout = agree_on_model_layout(comm_, config_, context_->mpu());
  identity_.parts = layout.parts;
  identity_.part = layout.part;
  identity_.pipeline = layout.pipeline;
  if (layout.parts > 1 && chief()) {
    core::log_info("model parallelism: {} replica(s) of a model in {} parts", replicas(), layout.parts);
  }
}

// An engine trial's batch: train_batch_size records a step, in gradient_accumulation_steps
// micro-batches on each rank (hyperparameters.global_batch_size wins over train_batch_size).
void resolve_engine_batch(const core::ExperimentConfig& config, comm::Communicator& comm, TrialSettings& settings) {
  std::optional<std::int64_t> global_batch_size;
  if (const auto it = settings.hparams.find("global_batch_size"); it != settings.hparams.end()) {
    if (!it->is_number_integer() || it->get<std::int64_t>() < 1) {
      throw ConfigError("hyperparameters.global_batch_size must be a positive integer, got " + it->dump());
    }
    global_batch_size = it->get<std::int64_t>();
  }
  std::string error;
  // Over the data-parallel replicas: a pipeline's stages share each micro-batch.
  const auto replicas = core::engine_replicas(*config.engine, comm.size(), error);
  if (!replicas) throw ConfigError("engine: " + error);
  const auto batch = core::resolve_engine_batch(*config.engine, global_batch_size, *replicas, error);
  if (!batch) {
    throw ConfigError("engine: " + error + " (with " + std::to_string(comm.size()) + " ranks" +
                      (*replicas != comm.size() ? ", " + std::to_string(*replicas) + " data-parallel replica(s)" : "") +
                      ")");
  }
  settings.global_batch_size = batch->train_batch_size;
  settings.aggregation_frequency = batch->accumulation_steps;
  settings.engine = *config.engine;
  if (comm.is_chief()) {
    if (global_batch_size && config.engine->train_batch_size && *config.engine->train_batch_size != *global_batch_size) {
      core::log_info("hyperparameters.global_batch_size ({}) overrides engine.train_batch_size ({})",
                     *global_batch_size, *config.engine->train_batch_size);
    }
    if (*replicas == comm.size()) {
      core::log_info("engine: train_batch_size {} = micro-batch {} x {} accumulation step(s) x {} rank(s)",
                     batch->train_batch_size, batch->micro_batch_size, batch->accumulation_steps, comm.size());
    } else {
      core::log_info("engine: train_batch_size {} = micro-batch {} x {} accumulation step(s) x {} replica(s) of {} "
                     "pipeline stages", batch->train_batch_size, batch->micro_batch_size, batch->accumulation_steps,
                     *replicas, config.engine->pipeline.stages);
    }
  }
}

std::int64_t Loop::training_records_per_epoch() const {
  if (train_loader_->is_stream()) {
    if (config_.records_per_epoch <= 0) {
      throw ConfigError(
          (config_.source_path.empty() ? std::string("the experiment config") : config_.source_path) +
          ": records_per_epoch is required when the training data is a stream (StreamDataset), whose samples "
          "cannot be counted; set records_per_epoch: N, the samples of one epoch over all ranks");
    }
    return config_.records_per_epoch;
  }
  const auto dataset_size = static_cast<std::int64_t>(train_loader_->dataset().size());
  return static_cast<std::int64_t>(epoch_records(config_.records_per_epoch > 0 ? config_.records_per_epoch
                                                                               : dataset_size,
                                                 global_batch_, train_loader_->drop_last()));
}

// After resume(): the training stream goes on from batches_trained_.
void Loop::start_training_data(std::uint64_t data_seed) {
  const std::size_t workers = options_.prefetch_depth == 0 ? 0 : train_loader_->options().workers();
  if (train_loader_->is_stream()) {
    stream_trained_ = resumed_stream_position();
    // Each replica reads a stream of its own; the ranks of one replica read the same.
    stream_reader_ = std::make_unique<StreamReader>(*train_loader_, stream_trained_, replica());
    StreamReader* reader = stream_reader_.get();
    prefetcher_ = std::make_unique<Prefetcher>([reader](const std::vector<std::int64_t>&) { return reader->next(); },
                                               [] { return std::vector<std::int64_t>(); }, workers,
                                               options_.prefetch_depth);
    return;
  }
  if (engine_runner_) {
    // The engine takes the shape the batches are cut for, from the next one on.
    engine_runner_->reshape(batches_trained_, adaptive_->shape().local_batch, adaptive_->shape().accumulation);
  }
  sampler_ = std::make_unique<TrainingSampler>(
      StreamOrder(train_loader_->dataset().size(), data_seed, train_loader_->shuffle(),
                  static_cast<std::uint64_t>(records_per_epoch_)),
      static_cast<std::uint64_t>(adaptive_ ? loop_local_batch() * comm_.size() : global_batch_),
      replica(), replicas(), static_cast<std::uint64_t>(records_trained()));
  const DataLoader* loader = train_loader_.get();
  // A rank whose model-parallel unit reads no data takes the same batches without their records.
  prefetcher_ = std::make_unique<Prefetcher>(
      [loader, read = reads_data()](const std::vector<std::int64_t>& indices) {
        return read ? loader->read(indices) : Batch();
      },
      [this] { return sampler_->next_batch(); }, workers, options_.prefetch_depth);
}

// This rank's stream position in the checkpoint resumed. Each rank reads a stream of its own, so
// a resume needs the ranks that wrote the checkpoint.
StreamPosition Loop::resumed_stream_position() const {
  if (resumed_from_.empty()) return {};
  const nlohmann::json& positions = resumed_stream_positions_;
  if (!positions.is_array()) {
    if (batches_trained_ == 0) return {};
    throw CheckpointError(resumed_from_ + " was written by the trial while its training data was not a stream, and "
                          "build_training_data_loader now returns a StreamDataset: where the stream stood is not "
                          "known; resume with the loader the checkpoint was written with, or train the trial afresh "
                          "elsewhere");
  }
  if (positions.size() != static_cast<std::size_t>(comm_.size())) {
    throw CheckpointError(resumed_from_ + " holds where the training streams of " + std::to_string(positions.size()) +
                          " rank(s) stood, and this run has " + std::to_string(comm_.size()) +
                          ": each rank reads a StreamDataset of its own, so a resume needs as many ranks; resume "
                          "with resources.slots_per_trial: " + std::to_string(positions.size()));
  }
  try {
    const auto& mine = positions.at(static_cast<std::size_t>(comm_.rank()));
    StreamPosition position{mine.at("pass").get<std::int64_t>(), mine.at("offset").get<std::uint64_t>()};
    if (position.pass < 0) throw CheckpointError(resumed_from_ + ": a negative stream pass");
    return position;
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(resumed_from_ + ": progress/stream_positions is malformed: " + e.what());
  }
}

// Every rank's stream position after the last batch trained; on the chief, one entry a rank.
// A collective: every rank calls it.
nlohmann::json Loop::gather_stream_positions() {
  if (!stream_reader_) return nullptr;
  return gather_to_chief(comm_, {{"pass", stream_trained_.pass}, {"offset", stream_trained_.offset}});
}

// Every rank's custom training reducers, part way through the reporting period; on the chief,
// one entry a rank. A collective: every rank calls it.
nlohmann::json Loop::gather_reducer_states() {
  nlohmann::json mine = nlohmann::json::object();
  bool any = false;
  for (const auto& wrapped : context_->reducers()) {
    if (!wrapped.for_training) continue;
    any = true;
    mine[wrapped.key] = wrapped.reducer->state_dict();
  }
  if (!any) return nullptr;
  return gather_to_chief(comm_, mine);
}

// Each rank takes back its own reducers' state; saved by another number of ranks, the partial
// period cannot be divided again, and the first report after the resume says only what follows.
void Loop::restore_reducer_states(const nlohmann::json& states) {
  if (!states.is_array()) return;
  if (states.size() != static_cast<std::size_t>(comm_.size())) {
    if (chief()) {
      core::log_warning("the custom training reducers were saved by {} rank(s) and are resumed by {}: their first "
                        "report after the resume covers only the batches after it", states.size(), comm_.size());
    }
    return;
  }
  const nlohmann::json& mine = states.at(static_cast<std::size_t>(comm_.rank()));
  for (const auto& wrapped : context_->reducers()) {
    if (!wrapped.for_training || !mine.contains(wrapped.key) || mine.at(wrapped.key).is_null()) continue;
    wrapped.reducer->load_state_dict(mine.at(wrapped.key));
  }
}

}  // namespace hpctrial::trainer::detail
