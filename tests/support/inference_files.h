// Batch inference in the scheduler tiers: the mlp example trained and then predicted over its
// validation set, and two result files compared byte for byte.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "hpctrial/checkpoint/format.h"

namespace hpctrial::testing_support {

// The mlp example's data in `data_dir` (train.h5, validation.h5, as mlp_make_dataset writes).
inline std::string mlp_data_yaml(const std::string& data_dir) {
  return "data: {train: " + data_dir + "/train.h5, validation: " + data_dir + "/validation.h5}\n";
}

// The mlp example trained for `batches` on 2 ranks.
inline std::string mlp_training_yaml(const std::string& name, const std::string& mlp, const std::string& data_dir,
                                     int batches) {
  return "name: " + name + "\nentrypoint: " + mlp + "\n"
         "hyperparameters: {global_batch_size: 64, learning_rate: 0.05, hidden: 64, classes: 10}\n"
         "searcher: {name: single, metric: validation_loss, max_length: {batches: " + std::to_string(batches) + "}}\n"
         "resources: {slots_per_trial: 2}\nreproducibility: {experiment_seed: 1234}\n" + mlp_data_yaml(data_dir);
}

// Its validation set predicted on 2 ranks with the weights of trial 0 of `trained` (an
// experiment directory); `extra`: more top-level keys (resources, scheduler).
inline std::string mlp_inference_yaml(const std::string& name, const std::string& mlp, const std::string& data_dir,
                                      const std::string& trained, const std::string& extra) {
  return "name: " + name + "\nentrypoint: " + mlp + "\n"
         "inference: {checkpoint: " + trained + ", trial_id: 0, batch_size: 64, progress_period: {batches: 4}}\n" +
         mlp_data_yaml(data_dir) + extra;
}

// The two result files hold the same datasets, byte for byte (and read whole: every CRC checked).
inline void expect_same_predictions(const std::string& path, const std::string& reference) {
  const checkpoint::Contents mine = checkpoint::read_checkpoint(path);
  const checkpoint::Contents theirs = checkpoint::read_checkpoint(reference);
  ASSERT_EQ(mine.datasets.size(), theirs.datasets.size());
  for (const auto& want : theirs.datasets) {
    const checkpoint::Dataset* got = mine.find(want.name);
    ASSERT_NE(got, nullptr) << want.name;
    EXPECT_EQ(got->shape, want.shape) << want.name;
    ASSERT_EQ(got->nbytes(), want.nbytes()) << want.name;
    EXPECT_EQ(std::memcmp(got->data->data(), want.data->data(), want.nbytes()), 0) << want.name;
  }
}

}  // namespace hpctrial::testing_support
