// environment.image with rootless Podman under the real OpenPBS: the fault-injection trial, in an
// image built offline with the program at a path only the image has, is submitted by the ordinary
// user, paused (its successor held), activated, and ends with the weights of the same run outside
// any container. PBS's commands (qsub of the successor, qrls) run on the host, as without one.
#include <fstream>
#include <regex>

#include "../support/as_user.h"
#include "../support/same_weights.h"
#include "pbs_fixture.h"

namespace hpctrial::pbs_tier {
namespace {

using testing::HasSubstr;

const char* const kImage = "localhost/hpctrial-test-faulty:latest";
const char* const kProgramInImage = "/opt/hpctrial-image/faulty_trial";

class PbsContainer : public PbsServer {
 protected:
  void SetUp() override {
    PbsServer::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    if (const std::string why = testing_support::container_tests_unavailable(); !why.empty()) GTEST_SKIP() << why;
    const auto image = testing_support::prepare_image(kImage, {std::string(HPCTRIAL_FAULTY_TRIAL) + "=" + kProgramInImage});
    ASSERT_TRUE(image.ok()) << "the test image could not be built: " << image.describe() << "\n" << image.out << image.err;
  }
};

TEST_F(PbsContainer, APodmanImageRunIsPausedActivatedAndEndsAsTheRunOutsideIt) {
  constexpr int kBatches = 1500;
  const std::string plain = config(kBatches, "4", "time_limit: 10m, preemption_grace: 30s");
  const std::string straight = straight_run(plain, kBatches);
  // The same experiment, its program the image's.
  std::string text = read_file(plain);
  text = std::regex_replace(text, std::regex("entrypoint: [^\n]*"), std::string("entrypoint: ") + kProgramInImage);
  text += std::string("environment: {image: ") + kImage + ", container_runtime: podman}\n";
  const std::string contained = dir_.write("container.yaml", text);
  ::chmod(contained.c_str(), 0644);
  const std::string first = submit(contained);
  ASSERT_FALSE(first.empty());
  wait_for_training(300);

  const auto pause = user({HPCTRIAL_CLI, "pause", experiment()});
  ASSERT_TRUE(pause.ok()) << pause.describe() << pause.out << pause.err;
  ASSERT_TRUE(wait_for_state(first, "F", 120s)) << "state " << state_of(first) << "\n" << job_output(first);
  EXPECT_EQ(exit_status(first), 75) << job_output(first);
  EXPECT_THAT(job_output(first), HasSubstr("trial 0 stopped (pause) after a durable checkpoint"));
  const auto ids = recorded_jobs();
  ASSERT_EQ(ids.size(), 2u) << job_output(first);
  const std::string second = ids.back();
  EXPECT_EQ(state_of(second), "H");
  EXPECT_EQ(testing_support::containers_of(experiment()), "") << "no container outlives its rank";

  const auto activate = user({HPCTRIAL_CLI, "activate", experiment()});
  ASSERT_TRUE(activate.ok()) << activate.describe() << activate.err;
  ASSERT_TRUE(wait_for_state(second, "F", 180s)) << state_of(second) << "\n" << job_output(second);
  EXPECT_EQ(exit_status(second), 0) << job_output(second);
  EXPECT_THAT(job_output(second), HasSubstr("resumed from "));
  EXPECT_EQ(testing_support::containers_of(experiment()), "");
  testing_support::expect_same_weights(straight, trial_dir() + "/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5");
}

}  // namespace
}  // namespace hpctrial::pbs_tier
