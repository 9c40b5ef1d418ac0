// A rank that fails inside its Podman container, on the chief and on the last rank: killed
// outright, or throwing. `hpctrial run` as an ordinary user (rootless Podman), with the trial
// program at a path only the image has. The failure is recorded as it is without a container (a
// SIGKILL as a signal, not as the runtime's exit code 137), the other rank is ended, and no
// container is left behind.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>

#include "../support/as_user.h"
#include "../support/read_file.h"
#include "../support/temp_dir.h"

namespace hpctrial {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using testing::HasSubstr;
using testing_support::as_user;
using testing_support::read_file;

const char* const kImage = "localhost/hpctrial-test-faulty:latest";
const char* const kProgramInImage = "/opt/hpctrial-image/faulty_trial";

class ContainerFault : public testing::TestWithParam<std::tuple<int, std::string>> {
 protected:
  static void SetUpTestSuite() {
    unavailable_ = testing_support::container_tests_unavailable();
    if (!unavailable_.empty()) return;
    const auto image = testing_support::prepare_image(kImage, {std::string(HPCTRIAL_FAULTY_TRIAL) + "=" + kProgramInImage});
    if (!image.ok()) image_error_ = image.describe() + "\n" + image.out + image.err;
  }
  void SetUp() override {
    if (!unavailable_.empty()) GTEST_SKIP() << unavailable_;
    ASSERT_TRUE(image_error_.empty()) << "the test image could not be built: " << image_error_;
    const passwd* pw = ::getpwnam(testing_support::container_user().c_str());
    ASSERT_NE(pw, nullptr);
    fs::create_directories(user_dir());
    ASSERT_EQ(::chown(user_dir().c_str(), pw->pw_uid, pw->pw_gid), 0);
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
  }
  std::string user_dir() const { return (dir_.path() / "user").string(); }
  std::string config() const {
    const std::string path = user_dir() + "/exp.yaml";
    std::ofstream(path) << "name: container-fault\nentrypoint: " << kProgramInImage << "\n"
        "searcher: {name: single, metric: validation_loss, max_length: {batches: 400}}\n"
        "hyperparameters: {global_batch_size: 16, fail_rank: -1, fail_batch: 0, fail_mode: none, batch_ms: 5}\n"
        "resources: {slots_per_trial: 2}\n"
        "max_restarts: 0\n"
        "environment: {image: " << kImage << ", container_runtime: podman}\n";
    ::chmod(path.c_str(), 0644);
    return path;
  }
  testing_support::TempDir dir_;
  static inline std::string unavailable_;
  static inline std::string image_error_;
};

TEST_P(ContainerFault, IsRecordedAsWithoutAContainerAndLeavesNoContainer) {
  const auto [rank, action] = GetParam();
  ASSERT_FALSE(fs::exists(kProgramInImage)) << "the program must be the image's alone";
  const std::string experiment = user_dir() + "/exp";
  const auto r = as_user({HPCTRIAL_CLI, "run", config(), "--experiment", experiment}, 180s,
                         {"HPCTRIAL_FAULT=rank" + std::to_string(rank) + ":step40:" + action});
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_NE(r.exit_code, 75) << r.err;
  const std::string said = "trial 0 failed: rank " + std::to_string(rank) + " on ";
  EXPECT_THAT(r.err, HasSubstr(said)) << r.err;
  if (action == "sigkill") {
    EXPECT_THAT(r.err, HasSubstr("was killed by signal 9 (Killed) in its batch phase after step 40")) << r.err;
  } else {
    EXPECT_THAT(r.err, HasSubstr("failed and aborted the job with code 1 in its batch phase after step 40: injected "
                                 "fault rank" + std::to_string(rank) + ":step40:throw")) << r.err;
  }
  const std::string failures = read_file(experiment + "/trial-0/failures.jsonl");
  EXPECT_THAT(failures, HasSubstr("\"rank\":" + std::to_string(rank))) << failures;
  EXPECT_EQ(testing_support::containers_of(experiment), "") << "no container outlives its attempt\n" << r.err;
}

INSTANTIATE_TEST_SUITE_P(ChiefAndLastRank, ContainerFault,
                         testing::Combine(testing::Values(0, 1), testing::Values("sigkill", "throw")));

}  // namespace
}  // namespace hpctrial
