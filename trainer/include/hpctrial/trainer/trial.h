// The Trial API (Determined's PyTorchTrial, in LibTorch C++). Subclass Trial, take a
// TrialContext& in your constructor, and implement at least train_batch, the two data
// loaders, and one of evaluate_batch / evaluate_full_dataset.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>

#include "hpctrial/trainer/callback.h"
#include "hpctrial/trainer/data.h"
#include "hpctrial/trainer/metrics.h"
#include "hpctrial/trainer/trial_context.h"

namespace hpctrial::trainer {

namespace detail {
struct TrialAccess;
}  // namespace detail

// What predict_batch returns: named outputs, one row per record of the batch.
using Predictions = std::map<std::string, torch::Tensor>;

class Trial {
 public:
  virtual ~Trial() = default;

  // One training step on this rank's share of the global batch, already on device(). Call
  // context.backward() and context.step_optimizer() here; return the metrics to report.
  virtual Metrics train_batch(Batch& batch, std::int64_t epoch_idx, std::int64_t batch_idx) = 0;

  // Validation, batch by batch (metrics reduced by evaluation_reducer()) ...
  virtual Metrics evaluate_batch(Batch& batch);
  // ... or over the whole validation set at once (run on the chief, which reports the result).
  virtual MetricValues evaluate_full_dataset(DataLoader& loader);

  virtual DataLoader build_training_data_loader() = 0;
  virtual DataLoader build_validation_data_loader() = 0;

  // Batch inference (an experiment with an `inference:` section, docs/user-guide.md): the
  // outputs for the records of `batch`, already on device(), by name, each with one row per
  // record (its first dimension the batch's). Each name becomes a dataset of the result file,
  // record i at row i; every batch gives the same names, dtypes and row shapes. Runs in eval
  // mode under torch::NoGradGuard.
  virtual Predictions predict_batch(Batch& batch);
  // The records an inference experiment predicts, in order (an indexed dataset): by default the
  // validation data. Its batch size is a rank's unless inference.batch_size sets one.
  virtual DataLoader build_inference_data_loader() { return build_validation_data_loader(); }
  virtual std::map<std::string, std::shared_ptr<Callback>> build_callbacks() { return {}; }
  virtual ReducerSpec evaluation_reducer() { return Reducer::kAvg; }

  // Extra state of the trial that must survive a resume (counters, a running statistic).
  virtual nlohmann::json save_state() { return nullptr; }
  virtual void load_state(const nlohmann::json& /*state*/) {}

  // Files of each rank's own (DeepSpeedTrial's save/load with a path: a model-parallel shard, a
  // tokenizer's cache): at every checkpoint every rank gets an empty private directory to write
  // them into, and they travel in the checkpoint file, checksummed like its tensors. A resumed
  // rank gets a directory with the files the rank of its number saved, before the first batch.
  // Collective in the sense that every rank is called; a checkpoint written by N ranks resumes on
  // N ranks only (each rank's files are its own). Regular files and directories only.
  virtual void save_files(const std::filesystem::path& directory);
  virtual void load_files(const std::filesystem::path& directory);

 private:
  friend struct detail::TrialAccess;
  // Which of the two the class overrides, set by make_trial(); unknown for a trial another
  // factory made (the loop then learns it from the first evaluate_batch call).
  std::optional<bool> evaluates_by_batch_;
};

namespace detail {
// Thrown by the default evaluate_batch / evaluate_full_dataset: the loop then uses the other.
struct NotOverridden {};

struct TrialAccess {
  static void set_evaluates_by_batch(Trial& trial, bool by_batch) { trial.evaluates_by_batch_ = by_batch; }
  static std::optional<bool> evaluates_by_batch(const Trial& trial) { return trial.evaluates_by_batch_; }
};
}  // namespace detail

// Whether TrialClass (or a base between it and Trial) declares its own evaluate_batch /
// evaluate_full_dataset: &TrialClass::f has the type of a member of the class that declares f.
template <typename TrialClass>
constexpr bool overrides_evaluate_batch() {
  return !std::is_same_v<decltype(&TrialClass::evaluate_batch), Metrics (Trial::*)(Batch&)>;
}
template <typename TrialClass>
constexpr bool overrides_evaluate_full_dataset() {
  return !std::is_same_v<decltype(&TrialClass::evaluate_full_dataset), MetricValues (Trial::*)(DataLoader&)>;
}

// What HPCTRIAL_MAIN and TrialRegistry::add check when the trial is compiled: a trial class that
// validates in exactly one way.
template <typename TrialClass>
constexpr void check_trial_class() {
  static_assert(std::is_base_of_v<Trial, TrialClass>, "a trial class derives from hpctrial::trainer::Trial");
  static_assert(!(overrides_evaluate_batch<TrialClass>() && overrides_evaluate_full_dataset<TrialClass>()),
                "the trial overrides both evaluate_batch and evaluate_full_dataset, and only one would run; "
                "keep evaluate_batch (every rank validates its share) or evaluate_full_dataset (the chief "
                "validates the whole set)");
  static_assert(overrides_evaluate_batch<TrialClass>() || overrides_evaluate_full_dataset<TrialClass>(),
                "the trial overrides neither evaluate_batch nor evaluate_full_dataset; implement one of them "
                "to validate");
}

// A TrialClass made for the loop, as HPCTRIAL_MAIN and TrialRegistry::add do: checked when
// compiled, and known to validate by batch or over the full dataset before the first validation.
template <typename TrialClass>
std::unique_ptr<Trial> make_trial(TrialContext& context) {
  check_trial_class<TrialClass>();
  std::unique_ptr<Trial> trial = std::make_unique<TrialClass>(context);
  detail::TrialAccess::set_evaluates_by_batch(*trial, overrides_evaluate_batch<TrialClass>());
  return trial;
}

}  // namespace hpctrial::trainer
