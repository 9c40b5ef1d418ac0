// A loaded trial's evaluation of its whole validation set, batch by batch, as the tests compare it
// with the trained run's.
#pragma once

#include <torch/torch.h>

#include <string>

#include "hpctrial/trainer/load.h"

namespace hpctrial::testing_mpi {

// The mean over the validation loader's batches of evaluate_batch's `metric` (the loop's
// Reducer::kAvg over batches of one size).
inline double mean_evaluation(const trainer::LoadedTrial& loaded, const std::string& metric) {
  torch::NoGradGuard no_grad;
  trainer::DataLoader loader = loaded.any_trial().build_validation_data_loader();
  double sum = 0;
  int batches = 0;
  for (auto batch : loader) {
    trainer::Batch on_device = loaded.context().to_device(batch);
    sum += loaded.any_trial().evaluate_batch(on_device).at(metric).item();
    ++batches;
  }
  return batches == 0 ? 0.0 : sum / batches;
}

}  // namespace hpctrial::testing_mpi
