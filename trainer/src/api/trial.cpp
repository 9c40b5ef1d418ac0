#include "hpctrial/trainer/trial.h"

#include "hpctrial/trainer/engine_trial.h"

namespace hpctrial::trainer {

Metrics Trial::evaluate_batch(Batch& /*batch*/) { throw detail::NotOverridden{}; }

MetricValues Trial::evaluate_full_dataset(DataLoader& /*loader*/) { throw detail::NotOverridden{}; }

Predictions Trial::predict_batch(Batch& /*batch*/) { throw detail::NotOverridden{}; }

void Trial::save_files(const std::filesystem::path& /*directory*/) { throw detail::NotOverridden{}; }

void Trial::load_files(const std::filesystem::path& /*directory*/) { throw detail::NotOverridden{}; }

void EngineTrial::save(const std::filesystem::path& /*path*/) { throw detail::NotOverridden{}; }

void EngineTrial::load(const std::filesystem::path& /*path*/) { throw detail::NotOverridden{}; }

}  // namespace hpctrial::trainer
