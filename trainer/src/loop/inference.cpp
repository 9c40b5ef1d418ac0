// Batch inference: an experiment with `inference:` runs the trial's predict_batch over its
// inference data with a trained checkpoint's weights and writes one row per record into one
// HDF5 file in the checkpoint format (TrialLayout::predictions_file), every rank its own rows.
//
// The records are cut into batches of inference.batch_size from the first record not yet durable;
// rank r predicts batches r, r + R, r + 2R, ... (R ranks), one a round, and writes each output's
// rows at their place in the file, which the chief laid out (checkpoint::plan_checkpoint) once
// the first batches showed the outputs' names, dtypes and row shapes. At a progress point every
// rank makes its rows durable, then the chief records in inference-progress.json how many records
// are (every batch of the rounds so far) and the checksum of each output's rows up to there. A
// stop (a signal, the stop file) is agreed on after a round and ends at a progress point; a
// crash loses the rounds since the last one. The next run starts from the record the progress
// names, on any number of ranks, and writes the rows after it again, identically; the last
// progress point publishes the file with its manifest (finish_checkpoint). No row is lost, and
// none is in the result twice.
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <numeric>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>

#include "api/config_json.h"
#include "api/engine_access.h"
#include "data/prefetcher.h"
#include "hpctrial/checkpoint/shared_write.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/rank/runtime.h"
#include "hpctrial/trainer/random.h"
#include "loop/inference_record.h"
#include "loop/loop.h"
#include "parallel/autocast.h"
#include "state/checkpointing.h"
#include "state/sharded_checkpoint.h"
#include "state/state_io.h"

namespace hpctrial::trainer::detail {
namespace {

using json = nlohmann::json;
using comm::DType;
using comm::ReduceOp;

// One inference run on this rank.
class InferenceRun {
 public:
  InferenceRun(const core::ExperimentConfig& config, const TrialFactory& factory, comm::Communicator& comm,
               const LoopOptions& options)
      : config_(config), factory_(factory), comm_(comm), options_(options), layout_{options.trial_dir} {}
  LoopResult run();

 private:
  bool chief() const { return comm_.is_chief(); }
  void setup();
  std::string read_progress();
  void build_trial(const checkpoint::CheckpointStore::Loaded& source);
  void start_reading();
  void record_run() const;
  // Round `round`'s batch of this rank, predicted; nothing when it has none.
  std::optional<Predictions> predict(std::int64_t k);
  // Every rank, after a round: a stop requested, a progress point due.
  std::vector<Output> outputs_of(const Predictions& predictions, std::int64_t k) const;
  mode_t file_mode() const;
  // On a resume: the temporary the progress names is there (or the file it became).
  void check_temporary();
  void lay_out(const std::optional<Predictions>& mine, std::int64_t k);
  void write_rows(std::int64_t k, const Predictions& predictions);
  std::array<std::int64_t, 2> agree(std::int64_t round);
  void publish(std::int64_t rounds_done);
  void finish();
  // Batch k of this run (from its first record): where it starts and its records.
  std::int64_t first_of(std::int64_t k) const { return start_ + k * batch_; }
  std::int64_t rows_of(std::int64_t k) const { return std::min(batch_, progress_.records - first_of(k)); }

  const core::ExperimentConfig& config_;
  const TrialFactory& factory_;
  comm::Communicator& comm_;
  LoopOptions options_;
  core::TrialLayout layout_;
  std::unique_ptr<rank::FaultPlan> faults_;
  std::unique_ptr<rank::StopFile> stop_file_;
  std::unique_ptr<TrialContext> context_;
  std::unique_ptr<Trial> trial_;
  std::unique_ptr<DataLoader> loader_;
  std::unique_ptr<Prefetcher> prefetcher_;
  InferenceProgress progress_;
  std::int64_t start_ = 0;  // the first record this run predicts
  std::int64_t batch_ = 0;  // records a batch
  std::int64_t batches_ = 0;  // this run's batches, over every rank
  std::int64_t next_read_ = 0;  // the next batch of this rank the prefetcher reads
  std::unique_ptr<checkpoint::PieceWriter> writer_;
  std::vector<std::pair<std::int64_t, std::vector<std::uint32_t>>> crcs_;  // this rank's, since the last progress
  std::map<std::int64_t, std::vector<std::uint32_t>> pending_;            // the chief's, by batch
  std::int64_t published_rounds_ = 0;
  std::int64_t combined_ = 0;  // the chief's: batches whose checksums are in progress_.crcs
  std::chrono::steady_clock::time_point last_progress_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  LoopResult result_;
};

// The progress recorded, as the chief read it (every rank gets it): empty text for a fresh start.
// A record damaged or missing, or the temporary it counts on gone, is a ConfigError (exit 2, not
// restarted): nothing a restart mends, and never a fresh start over rows already written.
std::string InferenceRun::read_progress() {
  std::string text;
  if (chief()) {
    const std::string path = layout_.inference_progress_file();
    std::error_code ec;
    if (std::filesystem::exists(path, ec)) {
      try {
        text = core::read_json_file(path).dump();
      } catch (const Error& e) {
        text = "!" + std::string(e.what()) + ": move it and the predictions' temporary away to predict again";
      }
    } else if (std::filesystem::exists(layout_.predictions_file(), ec)) {
      text = "!" + layout_.predictions_file() + " exists but its progress record " + path +
             " is missing: the result cannot be trusted to be whole; move it away to predict again";
    }
  }
  comm_.broadcast(text, 0);
  if (!text.empty() && text.front() == '!') throw ConfigError(text.substr(1));
  return text;
}

void InferenceRun::setup() {
  faults_ = std::make_unique<rank::FaultPlan>(options_.fault, comm_.rank(), options_.restart_count);
  if (chief() && !options_.stop_file.empty()) stop_file_ = std::make_unique<rank::StopFile>(options_.stop_file);
  if (chief()) core::create_directories(options_.trial_dir, config_.checkpoint_storage.group_readable ? 0750 : 0700);
  const core::Inference& inference = *config_.inference;
  const std::string recorded = read_progress();
  std::string source_path = inference.checkpoint;
  std::optional<int> trial_id = inference.trial_id;
  if (!recorded.empty()) {
    try {
      // The records are counted once the data is built; the layout is checked against them then.
      const json j = json::parse(recorded);
      source_path = j.at("source_checkpoint").get<std::string>();  // the same file, whatever came since
      trial_id.reset();
    } catch (const std::exception& e) {
      throw ConfigError(layout_.inference_progress_file() + " is damaged (" + e.what() +
                            "): move it and the predictions' temporary away to predict again from the start");
    }
  }
  const checkpoint::CheckpointStore::Loaded source = load_source_checkpoint(
      source_path, trial_id, recorded.empty() ? "inference.checkpoint" : layout_.inference_progress_file(), comm_);
  build_trial(source);
  progress_.source = source.path;
  progress_.trial_id = options_.trial_id;
  if (!options_.identity_dir.empty()) {
    progress_.experiment_id = core::require_experiment_identity(core::ExperimentLayout{options_.identity_dir}).id;
  }
  progress_.records = static_cast<std::int64_t>(loader_->dataset().size());
  if (progress_.records == 0) throw ConfigError("build_inference_data_loader: the dataset has no records to predict");
  if (recorded.empty()) return;
  InferenceProgress p;
  try {
    p = progress_from(json::parse(recorded), progress_.records);
  } catch (const std::exception& e) {
    throw ConfigError(layout_.inference_progress_file() + " is damaged (" + e.what() +
                          "): move it and the predictions' temporary away to predict again from the start");
  }
  if (p.experiment_id != progress_.experiment_id || p.trial_id != progress_.trial_id) {
    throw ConfigError(layout_.inference_progress_file() + " belongs to experiment " + p.experiment_id + " trial " +
                      std::to_string(p.trial_id) + ", not to this one (" + progress_.experiment_id + " trial " +
                      std::to_string(progress_.trial_id) + ")");
  }
  if (p.records != progress_.records) {
    throw ConfigError("the inference data has " + std::to_string(progress_.records) + " records, but the run " +
                      layout_.inference_progress_file() + " records predicted " + std::to_string(p.records) +
                      ": the data changed; restore it, or predict again from the start in a new experiment");
  }
  progress_ = std::move(p);
}

void InferenceRun::build_trial(const checkpoint::CheckpointStore::Loaded& source) {
  json hparams;
  try {
    hparams = json::parse(source.contents.at("meta/hparams", source.path).text());
  } catch (const json::exception& e) {
    throw CheckpointError(source.path + ": meta/hparams is malformed: " + e.what());
  }
  // The trained model's hyperparameters, which shape it; the experiment's own add to them.
  const json own = trial_hparams(config_);
  if (own.is_object()) hparams.update(own);
  const std::uint64_t trial_seed = derive_seed(options_.experiment_seed, static_cast<std::uint64_t>(options_.trial_id));
  torch::manual_seed(derive_seed(trial_seed, kTorchSeedStream));
  TrialSettings settings = trial_settings(config_, comm_, hparams, trial_seed);
  settings.distributed = options_.distributed;
  settings.trial_id = options_.trial_id;
  settings.experiment_dir = options_.experiment_dir;
  context_ = std::make_unique<TrialContext>(std::move(settings), comm_, options_.device_communicator);
  trial_ = factory_(*context_);
  if (!trial_) throw ConfigError("the trial factory returned no trial");
  if (dynamic_cast<EngineTrialRunner*>(trial_.get()) != nullptr) {
    throw ConfigError("inference: an EngineTrial has no predict_batch yet; predict with a Trial that builds the "
                      "same model (load_trial_from_checkpoint loads an engine trial's model for your own loop)");
  }
  const ModelLayout layout = agree_on_model_layout(comm_, config_, context_->mpu());
  if (layout.parts > 1) {
    throw ConfigError("inference: the trial splits its model over " + std::to_string(layout.parts) +
                      " ranks, and each rank predicts batches of its own with the whole model; build the whole "
                      "model on each rank");
  }
  TrialIdentity identity;
  identity.hparams = hparams;
  identity.trial_id = options_.trial_id;
  identity.world_size = comm_.size();
  restore_weights(source.contents, source.path, *context_, identity);
  for (const auto& model : context_->models()) model->eval();
  loader_ = std::make_unique<DataLoader>(trial_->build_inference_data_loader());
  if (loader_->is_stream()) {
    throw ConfigError("build_inference_data_loader: inference writes a row per record at the record's index, and a "
                      "stream has none; give an indexed Dataset (Hdf5Dataset, TensorDataset)");
  }
  batch_ = config_.inference->batch_size.value_or(loader_->batch_size());
  if (chief()) {
    core::log_info("inference with the weights of {} ({} batches trained) on {} rank(s), {} records a batch",
                   source.path, source.batches, comm_.size(), batch_);
  }
}

mode_t InferenceRun::file_mode() const { return config_.checkpoint_storage.group_readable ? 0640 : 0600; }

void InferenceRun::check_temporary() {
  std::string error;
  if (chief() && !progress_.complete) {
    std::error_code ec;
    const bool published = progress_.done == progress_.records && std::filesystem::exists(progress_.plan.path, ec);
    if (!published && !std::filesystem::exists(progress_.plan.temp, ec)) {
      error = "the predictions being written, " + progress_.plan.temp + ", are gone, though " +
              layout_.inference_progress_file() + " records " + std::to_string(progress_.done) +
              " records in them; move the progress record away to predict again from the start";
    }
  }
  comm_.broadcast(error, 0);
  if (!error.empty()) throw ConfigError(error);
}

void InferenceRun::start_reading() {
  next_read_ = comm_.rank();
  const auto next = [this] {
    std::vector<std::int64_t> indices;
    if (next_read_ < batches_) {
      indices.resize(static_cast<std::size_t>(rows_of(next_read_)));
      std::iota(indices.begin(), indices.end(), first_of(next_read_));
    }
    next_read_ += comm_.size();
    return indices;
  };
  const auto read = [this](const std::vector<std::int64_t>& indices) {
    return indices.empty() ? Batch() : loader_->read(indices);
  };
  const std::size_t workers = loader_->options().workers();
  prefetcher_ = std::make_unique<Prefetcher>(read, next, workers, std::max<std::size_t>(2, 2 * workers));
}

void InferenceRun::record_run() const {
  json line = {{"started", core::utc_now_iso()}, {"ranks", comm_.size()}, {"restart", options_.restart_count},
               {"batch", batch_ * comm_.size()}, {"local_batch", batch_}, {"accumulation", 1}, {"batches", 0},
               {"inference", {{"records", progress_.records}, {"from_record", start_}}},
               {"source_checkpoint", progress_.source}, {"launcher", core::mpi_name(config_.launcher.mpi)}};
  if (!options_.code_digest.empty()) line["code"] = options_.code_digest;
  std::ofstream out(layout_.runs_file(), std::ios::app);
  out << line.dump() << "\n";
  if (!out) core::log_warning("cannot record this run in {}", layout_.runs_file());
}

std::optional<Predictions> InferenceRun::predict(std::int64_t k) {
  if (k >= batches_) return std::nullopt;
  Batch batch = context_->to_device(prefetcher_->next());
  try {
    const AutocastScope autocast(context_->device(), context_->mixed_precision());
    return trial_->predict_batch(batch);
  } catch (const NotOverridden&) {
    throw ConfigError("the trial does not override predict_batch, which an inference experiment (inference:) runs: "
                      "implement `Predictions predict_batch(Batch& batch) override`, returning named tensors with a "
                      "row per record of the batch");
  }
}

std::vector<Output> InferenceRun::outputs_of(const Predictions& predictions, std::int64_t k) const {
  const std::string where = "rank " + std::to_string(comm_.rank()) + "'s predict_batch for records [" +
                            std::to_string(first_of(k)) + ", " + std::to_string(first_of(k) + rows_of(k)) + ")";
  if (predictions.empty()) throw ConfigError(where + " returned no outputs; return at least one named tensor");
  std::vector<Output> outputs;
  for (const auto& [name, tensor] : predictions) {
    if (!tensor.defined() || tensor.dim() < 1 || tensor.size(0) != rows_of(k)) {
      throw ConfigError(where + " gives '" + name + "' " +
                        (tensor.defined() ? "of shape " + shape_text(tensor.sizes().vec()) : std::string("undefined")) +
                        ", which is not one row per record (" + std::to_string(rows_of(k)) + " rows)");
    }
    const auto dtype = to_dtype(tensor.scalar_type());
    if (!dtype) throw ConfigError(where + " gives '" + name + "' of a dtype the result file cannot hold");
    const auto sizes = tensor.sizes().vec();
    outputs.push_back({name, *dtype, std::vector<std::int64_t>(sizes.begin() + 1, sizes.end())});
  }
  return outputs;
}

// Collective, once, on a fresh start: the first batches' outputs agreed on, the file laid out by
// the chief, and every rank told where each output goes.
void InferenceRun::lay_out(const std::optional<Predictions>& mine, std::int64_t k) {
  const auto all = comm_.allgather(mine ? outputs_json(outputs_of(*mine, k)).dump() : std::string());
  std::optional<int> first;
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    const std::vector<Output> theirs = outputs_from(json::parse(all[r]));
    if (!first) {
      progress_.outputs = theirs;
      first = static_cast<int>(r);
    } else if (theirs != progress_.outputs) {
      throw ConfigError("predict_batch gives rank " + std::to_string(*first) + " " + describe_all(progress_.outputs) +
                        " but rank " + std::to_string(r) + " " + describe_all(theirs) +
                        ": every batch must give the same names, dtypes and row shapes");
    }
  }
  std::string laid_out;
  if (chief()) {
    std::map<std::string, std::string> attributes = {
        {"kind", "predictions"}, {"records", std::to_string(progress_.records)},
        {"source_checkpoint", progress_.source}, {"trial_id", std::to_string(progress_.trial_id)}};
    if (!progress_.experiment_id.empty()) attributes["experiment_id"] = progress_.experiment_id;
    if (!options_.code_digest.empty()) attributes["code_digest"] = options_.code_digest;
    std::vector<checkpoint::DatasetSpec> datasets;
    for (const auto& o : progress_.outputs) datasets.push_back({o.name, o.dtype, with_rows(o, progress_.records)});
    try {
      progress_.plan = checkpoint::plan_checkpoint(layout_.predictions_file(), std::move(datasets), attributes,
                                                   checkpoint::WriteOptions{file_mode(), false, nullptr});
      progress_.crcs.assign(progress_.outputs.size(), 0);
      laid_out = to_json(progress_).dump();
    } catch (const Error& e) {
      laid_out = "!" + std::string(e.what());
    }
  }
  comm_.broadcast(laid_out, 0);
  if (laid_out.front() == '!') throw CheckpointError("inference: " + laid_out.substr(1));
  progress_ = progress_from(json::parse(laid_out), progress_.records);
}

void InferenceRun::write_rows(std::int64_t k, const Predictions& predictions) {
  const std::vector<Output> outputs = outputs_of(predictions, k);
  if (outputs != progress_.outputs) {
    throw ConfigError("rank " + std::to_string(comm_.rank()) + "'s predict_batch for records from " +
                      std::to_string(first_of(k)) + " gives " + describe_all(outputs) + ", but the result file holds " +
                      describe_all(progress_.outputs) + ": every batch must give the same names, dtypes and row shapes");
  }
  if (!writer_) {
    writer_ = std::make_unique<checkpoint::PieceWriter>(progress_.plan.temp,
                                                        checkpoint::WriteOptions{file_mode(), false, nullptr});
  }
  std::vector<std::uint32_t> crcs;
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const torch::Tensor rows = predictions.at(outputs[i].name).to(torch::kCPU).contiguous();
    const auto offset = progress_.plan.offsets[i] + static_cast<std::uint64_t>(first_of(k)) * outputs[i].row_bytes();
    writer_->write(offset, rows.data_ptr(), rows.nbytes());
    crcs.push_back(checkpoint::crc32c(rows.data_ptr(), rows.nbytes()));
  }
  crcs_.emplace_back(k, std::move(crcs));
}

std::array<std::int64_t, 2> InferenceRun::agree(std::int64_t round) {
  rank::record_step(round + 1);
  if (const auto* record = rank::RankRecord::current()) record->check();
  const bool stop = (options_.external_stop != nullptr && options_.external_stop->load()) ||
                    (stop_file_ && stop_file_->requested());
  const core::Length& period = config_.inference->progress_period;
  const bool due = period.unit == core::LengthUnit::kBatches
                       ? round + 1 - published_rounds_ >= period.value
                       : chief() && std::chrono::duration<double>(Clock::now() - last_progress_).count() >=
                                        static_cast<double>(period.value);
  std::array<std::int64_t, 2> flags = {stop ? 1 : 0, due ? 1 : 0};
  rank::record_phase(core::RankPhase::kAgreement);
  faults_->at(rank::FaultPhase::kAgreement, round + 1);
  comm_.allreduce(flags.data(), 2, DType::kInt64, ReduceOp::kMax);
  return flags;
}

// A progress point after `rounds` rounds: every rank's rows durable, then the chief's record of
// them (and of their checksums, gathered from every rank).
void InferenceRun::publish(std::int64_t rounds) {
  rank::record_phase(core::RankPhase::kCheckpoint);
  faults_->at(rank::FaultPhase::kCheckpoint, rounds);
  std::string failed;
  try {
    if (writer_) writer_->sync();
  } catch (const Error& e) {
    failed = e.what();
  }
  writer_.reset();
  failed = detail::agree(comm_, failed);
  if (!failed.empty()) throw CheckpointError("inference: the rows predicted could not be made durable: " + failed);
  json mine = json::array();
  for (const auto& [k, crcs] : crcs_) mine.push_back({k, crcs});
  crcs_.clear();
  const std::vector<std::string> gathered = comm_.gather(mine.dump(), 0);
  published_rounds_ = rounds;
  last_progress_ = Clock::now();
  if (!chief()) return;
  for (const auto& text : gathered) {
    for (const auto& item : json::parse(text)) pending_[item[0].get<std::int64_t>()] = item[1].get<std::vector<std::uint32_t>>();
  }
  const std::int64_t batches = std::min(batches_, rounds * comm_.size());
  for (; combined_ < batches; ++combined_) {
    const auto it = pending_.find(combined_);
    if (it == pending_.end()) throw InternalError("inference: no checksums of batch " + std::to_string(combined_));
    for (std::size_t i = 0; i < progress_.outputs.size(); ++i) {
      const auto bytes = static_cast<std::uint64_t>(rows_of(combined_)) * progress_.outputs[i].row_bytes();
      progress_.crcs[i] = checkpoint::crc32c_combine(progress_.crcs[i], it->second[i], bytes);
    }
    pending_.erase(it);
  }
  progress_.done = std::min(progress_.records, first_of(batches));
  core::write_json_file(layout_.inference_progress_file(), to_json(progress_));
  const double seconds = std::chrono::duration<double>(Clock::now() - started_).count();
  core::log_info("inference: {} of {} records predicted and durable ({:.0f} records/s in this run)", progress_.done,
                 progress_.records, static_cast<double>(progress_.done - start_) / std::max(seconds, 1e-9));
}

// The chief publishes the result, whose every row is durable, and records it complete.
void InferenceRun::finish() {
  rank::record_phase(core::RankPhase::kShutdown);
  if (!chief()) return;
  if (progress_.done != progress_.records) {
    throw InternalError("inference: finishing with " + std::to_string(progress_.done) + " of " +
                        std::to_string(progress_.records) + " records durable");
  }
  std::error_code ec;
  // A run that ended between publishing the file and recording it leaves the file, whole.
  if (std::filesystem::exists(progress_.plan.temp, ec) || !std::filesystem::exists(progress_.plan.path, ec)) {
    checkpoint::finish_checkpoint(progress_.plan, progress_.crcs, checkpoint::WriteOptions{file_mode(), false, nullptr});
  }
  progress_.complete = true;
  core::write_json_file(layout_.inference_progress_file(), to_json(progress_));
  core::log_info("inference: {} records predicted into {}", progress_.records, progress_.plan.path);
}

LoopResult InferenceRun::run() {
  rank::record_phase(core::RankPhase::kStartup);
  setup();
  faults_->at(rank::FaultPhase::kStartup, 0);
  result_.predictions_path = layout_.predictions_file();
  if (progress_.complete) {
    if (chief()) core::log_info("inference: {} is complete already", progress_.plan.path);
    return result_;
  }
  if (!progress_.outputs.empty()) check_temporary();
  start_ = progress_.done;
  batches_ = (progress_.records - start_ + batch_ - 1) / batch_;
  combined_ = 0;
  const std::int64_t rounds = (batches_ + comm_.size() - 1) / comm_.size();
  if (chief()) record_run();
  start_reading();
  const torch::NoGradGuard no_grad;
  for (std::int64_t round = 0; round < rounds; ++round) {
    rank::record_phase(core::RankPhase::kBatch);
    faults_->at(rank::FaultPhase::kBatch, round);
    const std::int64_t k = round * comm_.size() + comm_.rank();
    const std::optional<Predictions> mine = predict(k);
    if (progress_.outputs.empty()) lay_out(mine, k);
    if (mine) write_rows(k, *mine);
    const auto flags = agree(round);
    const bool last = round + 1 == rounds;
    if (flags[0] != 0 || flags[1] != 0 || last) publish(round + 1);
    if (flags[0] != 0 && !last) {
      result_.stopped_early = true;
      result_.checkpoint_path = layout_.inference_progress_file();
      break;
    }
  }
  prefetcher_.reset();
  if (!result_.stopped_early) finish();
  result_.records_predicted = progress_.done - start_;
  return result_;
}

}  // namespace

LoopResult run_inference(const core::ExperimentConfig& config, const TrialFactory& factory, comm::Communicator& comm,
                         const LoopOptions& options) {
  InferenceRun run(config, factory, comm, options);
  return run.run();
}

}  // namespace hpctrial::trainer::detail
