// environment.image with rootless Podman on the real local Slurm cluster: the mlp example, in an
// image built offline from this machine's files (tests/containers/make_image.sh) with the
// program at a path only the image has, is submitted by an ordinary user with `hpctrial submit`,
// paused, activated, and ends with the weights of the same run outside any container. The
// launcher, mpirun and the scheduler's commands run on the host; each rank in a container.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "../support/as_user.h"
#include "../support/read_file.h"
#include "../support/same_weights.h"
#include "../support/slurm_jobs.h"
#include "../support/temp_dir.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using testing::HasSubstr;
using testing_support::job_field;
using testing_support::read_file;
using testing_support::TempDir;

const char* const kImage = "localhost/hpctrial-test-mlp:latest";
const char* const kProgramInImage = "/opt/hpctrial-image/mlp";

using testing_support::as_user;
using testing_support::container_user;

class SlurmContainer : public testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = testing_support::container_tests_unavailable(); !why.empty()) GTEST_SKIP() << why;
    if (!testing_support::run_for({"sinfo", "-h"}, 30s).ok()) {
      GTEST_SKIP() << "no local Slurm cluster answers (scripts/local-slurm.sh)";
    }
    // The user (made where missing), Podman set up for it, and the image built as it.
    const auto image = testing_support::prepare_image(kImage, {std::string(HPCTRIAL_MLP) + "=" + kProgramInImage});
    ASSERT_TRUE(image.ok()) << "the test image could not be built: " << image.describe() << "\n" << image.out << image.err;
    const passwd* pw = ::getpwnam(container_user().c_str());
    ASSERT_NE(pw, nullptr) << container_user();
    fs::create_directories(user_dir());
    ASSERT_EQ(::chown(user_dir().c_str(), pw->pw_uid, pw->pw_gid), 0);
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
    const auto made = as_user({HPCTRIAL_MLP_MAKE_DATASET, user_dir() + "/data"});
    ASSERT_TRUE(made.ok()) << made.describe() << made.err;
  }
  void TearDown() override {
    if (!job_.empty()) testing_support::run_for({"scancel", job_}, 30s);
  }
  std::string user_dir() const { return (dir_.path() / "user").string(); }
  std::string experiment() const { return user_dir() + "/exp"; }
  long long heartbeat() const {
    std::ifstream in(experiment() + "/trial-0/launch/heartbeat/rank-0");
    std::string word;
    long long step = -1;
    if (in >> word >> step) return step;
    return -1;
  }
  // The mlp example's experiment; `in_image`: its program is the image's, run in a container.
  std::string config(const std::string& name, int batches, bool in_image) {
    const std::string path = user_dir() + "/" + name;
    std::ofstream(path) << "name: slurm-container\n"
        "entrypoint: " << (in_image ? kProgramInImage : HPCTRIAL_MLP) << "\n"
        "hyperparameters: {global_batch_size: 64, learning_rate: 0.05, hidden: 64, classes: 10}\n"
        "searcher: {name: single, metric: validation_loss, smaller_is_better: true, max_length: {batches: "
        << batches << "}}\n"
        "min_validation_period: {batches: 2000}\n"
        "min_checkpoint_period: {batches: 1000}\n"
        "resources: {slots_per_trial: 2, slots_per_node: 2}\n"
        "reproducibility: {experiment_seed: 1234}\n"
        "data: {train: data/train.h5, validation: data/validation.h5, x_dataset: x, y_dataset: y}\n"
        "scheduler: {type: slurm, time_limit: 30m}\n"
        << (in_image ? std::string("environment: {image: ") + kImage + ", container_runtime: podman}\n" : "");
    ::chmod(path.c_str(), 0644);
    return path;
  }
  TempDir dir_;
  std::string job_;
};

TEST_F(SlurmContainer, APodmanImageRunIsPausedActivatedAndEndsAsTheRunOutsideIt) {
  constexpr int kBatches = 12000;
  ASSERT_FALSE(fs::exists(kProgramInImage)) << "the program must be the image's alone";
  const auto submitted = as_user({HPCTRIAL_CLI, "submit", config("exp.yaml", kBatches, true), "--experiment",
                                  experiment()});
  ASSERT_TRUE(submitted.ok()) << submitted.describe() << submitted.out << submitted.err;
  job_ = testing_support::submitted_job(submitted.out);
  ASSERT_FALSE(job_.empty()) << submitted.out;
  const std::string log_path = experiment() + "/slurm-" + job_ + ".err";
  ASSERT_TRUE(testing_support::wait_for_state(job_, "RUNNING", 60s)) << job_field(job_, "JobState");
  const auto until = std::chrono::steady_clock::now() + 120s;
  while (heartbeat() < 1500 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(100ms);
  ASSERT_GE(heartbeat(), 1500) << read_file(log_path) << read_file(experiment() + "/trial-0/logs/rank-0.log");

  const auto pause = as_user({HPCTRIAL_CLI, "pause", job_});
  ASSERT_TRUE(pause.ok()) << pause.describe() << pause.err;
  ASSERT_TRUE(testing_support::wait_for_state(job_, "PENDING", 60s)) << job_field(job_, "JobState");
  EXPECT_THAT(read_file(log_path), HasSubstr("trial 0 stopped (pause) after a durable checkpoint"));
  EXPECT_FALSE(fs::exists(experiment() + "/trial-0/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5"))
      << "paused before the end";
  EXPECT_EQ(testing_support::containers_of(experiment()), "") << "no container outlives its rank";

  // While the job is held: the same experiment, outside any container, on this machine.
  const std::string straight = user_dir() + "/straight";
  const auto plain = as_user({HPCTRIAL_CLI, "run", config("plain.yaml", kBatches, false), "--set",
                              "scheduler.type=local", "--experiment", straight}, 300s);
  ASSERT_TRUE(plain.ok()) << plain.describe() << plain.err;

  const auto activate = as_user({HPCTRIAL_CLI, "activate", experiment()});
  ASSERT_TRUE(activate.ok()) << activate.describe() << activate.err;
  ASSERT_TRUE(testing_support::wait_for_state(job_, "COMPLETED", 180s))
      << "state " << job_field(job_, "JobState") << "\n" << read_file(log_path);
  EXPECT_THAT(read_file(log_path), HasSubstr("resumed from "));
  EXPECT_EQ(testing_support::containers_of(experiment()), "");
  testing_support::expect_same_weights(straight + "/trial-0/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5",
                                       experiment() + "/trial-0/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5");
  // describe says, run by run, what started the ranks and what they ran in.
  const auto describe = as_user({HPCTRIAL_CLI, "describe", experiment()});
  EXPECT_THAT(describe.out, testing::ContainsRegex(std::string("run 2: .* by mpirun, each rank in podman image ") +
                                                   kImage + "\n"))
      << describe.out;
}

}  // namespace
}  // namespace hpctrial
