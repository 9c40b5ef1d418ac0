// The mlp example trained on a GPU the way users run it (`hpctrial run`, one rank, NCCL as the
// device communicator, CUDA tensors in the checkpoint): stopped at batch 200 and resumed, it ends
// bitwise equal to an uninterrupted run. Skips without a GPU, or with a LibTorch built without
// CUDA (Debian's), and says which.
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "../support/same_weights.h"
#include "../support/temp_dir.h"
#include "hpctrial/core/subprocess.h"
#include "synthetic_data.h"

namespace hpctrial {
namespace {

using testing::HasSubstr;
using testing_support::TempDir;

core::RunResult run(const std::vector<std::string>& argv) {
  core::RunOptions options;
  options.timeout = std::chrono::seconds(300);
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  return core::run_process(argv, options);
}

TEST(GpuTraining, StoppedAndResumedOnTheGpuEqualsAnUninterruptedRunBitwise) {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess || count == 0) {
    GTEST_SKIP() << "no GPU visible: cudaGetDeviceCount says " << (rc != cudaSuccess ? cudaGetErrorString(rc) : "0 devices");
  }
  TempDir dir;
  mlp_example::SyntheticSpec spec;
  const std::string train = (dir.path() / "train.h5").string(), validation = (dir.path() / "validation.h5").string();
  mlp_example::write_synthetic_dataset(train, spec);
  spec.samples = 2048;
  spec.seed = 2;
  mlp_example::write_synthetic_dataset(validation, spec);
  const auto hpctrial_run = [&](const std::string& experiment, const std::vector<std::string>& more) {
    std::vector<std::string> argv = {HPCTRIAL_CLI, "run", HPCTRIAL_SOURCE_DIR "/examples/mlp/experiment.yaml",
                                     "--experiment", experiment,
                                     "--set", "entrypoint=" HPCTRIAL_MLP,
                                     "--set", "data.train=" + train, "--set", "data.validation=" + validation,
                                     "--set", "resources.slots_per_trial=1", "--set", "resources.gpus_per_slot=1"};
    argv.insert(argv.end(), more.begin(), more.end());
    return run(argv);
  };
  const std::string a = (dir.path() / "a").string(), b = (dir.path() / "b").string();
  const auto straight = hpctrial_run(a, {});
  if (!straight.ok() && straight.err.find("LibTorch without CUDA") != std::string::npos) {
    GTEST_SKIP() << "this LibTorch has no CUDA (a GPU is visible): " << straight.err.substr(0, 300);
  }
  ASSERT_TRUE(straight.ok()) << straight.describe() << "\n" << straight.err;
  EXPECT_THAT(straight.err, HasSubstr("trains on cuda:0 (gradients all-reduced by NCCL)"));

  const auto first = hpctrial_run(b, {"--set", "searcher.max_length.batches=200"});
  ASSERT_TRUE(first.ok()) << first.describe() << "\n" << first.err;
  const auto second = hpctrial_run(b, {});
  ASSERT_TRUE(second.ok()) << second.describe() << "\n" << second.err;
  EXPECT_THAT(second.err, HasSubstr("after 200 batches")) << "the second run did not resume";

  const std::string end = "/trial-0/checkpoints/ckpt-400.h5";
  testing_support::expect_same_weights(a + end, b + end);
  // It learned: the last validation's accuracy, as the CPU run reaches.
  std::ifstream metrics(a + "/trial-0/metrics.jsonl");
  std::string line, last_validation;
  while (std::getline(metrics, line)) {
    if (line.find("\"validation\"") != std::string::npos) last_validation = line;
  }
  EXPECT_THAT(last_validation, testing::ContainsRegex("\"accuracy\":0\\.9[0-9]*"));
}

}  // namespace
}  // namespace hpctrial
