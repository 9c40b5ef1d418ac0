// The mlp example trained on a GPU the way users run it (`hpctrial run`, one rank, NCCL as the
// device communicator, CUDA tensors in the checkpoint), and the engine example in float16 with
// loss scaling: stopped and resumed, each ends bitwise equal to an uninterrupted run. Skips without a GPU, or with a LibTorch built without
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

// Skips the test without a GPU.
#define SKIP_WITHOUT_GPU()                                                                                          \
  do {                                                                                                              \
    int count = 0;                                                                                                  \
    const cudaError_t rc = cudaGetDeviceCount(&count);                                                              \
    if (rc != cudaSuccess || count == 0) {                                                                          \
      GTEST_SKIP() << "no GPU visible: cudaGetDeviceCount says " << (rc != cudaSuccess ? cudaGetErrorString(rc) : "0 devices"); \
    }                                                                                                               \
  } while (false)

// `example` (an experiment.yaml under examples/) with `program` on one GPU, through `hpctrial
// run`: stopped at `stop_at` and resumed, bitwise equal to an uninterrupted run that ends at
// `end`; the last validation line of the uninterrupted run.
std::string stop_resume_on_gpu(const std::string& example, const std::string& program, int stop_at, int end,
                               const std::vector<std::string>& settings) {
  TempDir dir;
  mlp_example::SyntheticSpec spec;
  const std::string train = (dir.path() / "train.h5").string(), validation = (dir.path() / "validation.h5").string();
  mlp_example::write_synthetic_dataset(train, spec);
  spec.samples = 2048;
  spec.seed = 2;
  mlp_example::write_synthetic_dataset(validation, spec);
  const auto hpctrial_run = [&](const std::string& experiment, const std::vector<std::string>& more) {
    std::vector<std::string> argv = {HPCTRIAL_CLI, "run", HPCTRIAL_SOURCE_DIR "/examples/" + example,
                                     "--experiment", experiment,
                                     "--set", "entrypoint=" + program,
                                     "--set", "data.train=" + train, "--set", "data.validation=" + validation,
                                     "--set", "resources.slots_per_trial=1", "--set", "resources.gpus_per_slot=1"};
    for (const auto& setting : settings) argv.insert(argv.end(), {"--set", setting});
    argv.insert(argv.end(), more.begin(), more.end());
    return run(argv);
  };
  const std::string a = (dir.path() / "a").string(), b = (dir.path() / "b").string();
  const auto straight = hpctrial_run(a, {});
  if (!straight.ok() && straight.err.find("LibTorch without CUDA") != std::string::npos) {
    return "skip: this LibTorch has no CUDA (a GPU is visible): " + straight.err.substr(0, 300);
  }
  EXPECT_TRUE(straight.ok()) << straight.describe() << "\n" << straight.err;
  EXPECT_THAT(straight.err, HasSubstr("trains on cuda:0"));

  const auto first = hpctrial_run(b, {"--set", "searcher.max_length.batches=" + std::to_string(stop_at)});
  EXPECT_TRUE(first.ok()) << first.describe() << "\n" << first.err;
  const auto second = hpctrial_run(b, {});
  EXPECT_TRUE(second.ok()) << second.describe() << "\n" << second.err;
  EXPECT_THAT(second.err, HasSubstr("after " + std::to_string(stop_at) + " batches")) << "the second run did not resume";

  const std::string last = "/trial-0/checkpoints/ckpt-" + std::to_string(end) + ".h5";
  testing_support::expect_same_weights(a + last, b + last);
  std::ifstream metrics(a + "/trial-0/metrics.jsonl");
  std::string line, last_validation;
  while (std::getline(metrics, line)) {
    if (line.find("\"kind\":\"validation\"") != std::string::npos) last_validation = line;
  }
  return last_validation;
}

TEST(GpuTraining, StoppedAndResumedOnTheGpuEqualsAnUninterruptedRunBitwise) {
  SKIP_WITHOUT_GPU();
  const std::string validation = stop_resume_on_gpu("mlp/experiment.yaml", HPCTRIAL_MLP, 200, 400, {});
  if (validation.rfind("skip: ", 0) == 0) GTEST_SKIP() << validation;
  // It learned: the last validation's accuracy, as the CPU run reaches.
  EXPECT_THAT(validation, testing::ContainsRegex("\"accuracy\":0\\.9[0-9]*"));
}

// The engine example in float16 with dynamic loss scaling: it learns as in float32, and the
// scale is resumed with the weights (the checkpoints' scaler/0 is compared too).
TEST(GpuTraining, EngineInFloat16ResumesBitwiseAndLearns) {
  SKIP_WITHOUT_GPU();
  const std::string validation =
      stop_resume_on_gpu("engine/experiment.yaml", HPCTRIAL_ENGINE, 150, 300,
                         {"engine.bf16.enabled=false", "engine.fp16.enabled=true", "engine.fp16.loss_scale_window=50"});
  if (validation.rfind("skip: ", 0) == 0) GTEST_SKIP() << validation;
  EXPECT_THAT(validation, testing::ContainsRegex("\"accuracy\":0\\.9[0-9]*"));
}

}  // namespace
}  // namespace hpctrial
