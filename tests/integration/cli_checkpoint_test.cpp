// hpctrial checkpoint list|inspect|verify, as a user runs them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "../support/temp_dir.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial {
namespace cli_checkpoint_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using testing::Not;
using testing_support::TempDir;

core::RunResult hpctrial_cli(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {HPCTRIAL_CLI};
  argv.insert(argv.end(), args.begin(), args.end());
  return core::run_process(argv);
}

checkpoint::Contents state(std::int64_t batches, double metric) {
  checkpoint::Contents c;
  std::vector<float> w(2000, 1.5f);
  c.add("model/0/fc.weight", checkpoint::DType::kFloat32, {40, 50}, w.data());
  c.attributes[checkpoint::kBatchesAttribute] = std::to_string(batches);
  c.attributes[checkpoint::kMetricAttribute] = std::to_string(metric);
  return c;
}

TEST(CliCheckpoint, ListInspectAndVerify) {
  TempDir dir;
  checkpoint::StoreOptions options;
  options.keep_latest = 5;
  checkpoint::CheckpointStore store(dir.path().string(), options);
  store.publish(state(100, 0.5));
  store.publish(state(200, 0.25));

  const auto listed = hpctrial_cli({"checkpoint", "list", dir.path().string()});
  ASSERT_EQ(listed.exit_code, 0) << listed.err;
  EXPECT_THAT(listed.out, HasSubstr("ckpt-200.h5"));
  EXPECT_THAT(listed.out, HasSubstr("0.25"));
  EXPECT_LT(listed.out.find("ckpt-200.h5"), listed.out.find("ckpt-100.h5")) << "newest first";
  EXPECT_THAT(listed.out, testing::ContainsRegex("ckpt-200\\.h5 .* yes +0\\.25 +\\*"));

  const auto inspected = hpctrial_cli({"checkpoint", "inspect", store.path_for(200)});
  ASSERT_EQ(inspected.exit_code, 0) << inspected.err;
  EXPECT_THAT(inspected.out, HasSubstr("batches: 200"));
  EXPECT_THAT(inspected.out, testing::ContainsRegex("model/0/fc.weight +float32 +\\[40,50\\] +8000 bytes"));

  auto verified = hpctrial_cli({"checkpoint", "verify", dir.path().string()});
  EXPECT_EQ(verified.exit_code, 0) << verified.out;
  EXPECT_THAT(verified.out, HasSubstr("ok   " + store.path_for(100)));
  std::filesystem::resize_file(store.path_for(100), 2000);
  verified = hpctrial_cli({"checkpoint", "verify", dir.path().string()});
  EXPECT_EQ(verified.exit_code, 1);
  EXPECT_THAT(verified.out, HasSubstr("BAD  " + store.path_for(100) + ": "));
  EXPECT_THAT(verified.out, HasSubstr("ok   " + store.path_for(200)));

  const auto missing = hpctrial_cli({"checkpoint", "list", (dir.path() / "nope").string()});
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_THAT(missing.err, HasSubstr("nope is not a directory"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "nope")) << "list must not create directories";
  const auto wrong = hpctrial_cli({"checkpoint", "frobnicate"});
  EXPECT_EQ(wrong.exit_code, 2);
  EXPECT_THAT(wrong.err, HasSubstr("unknown action 'frobnicate'; use list, inspect or verify"));
}

}  // namespace cli_checkpoint_test
}  // namespace hpctrial
