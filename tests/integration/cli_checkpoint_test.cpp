// hpctrial checkpoint list|inspect|verify|export, as a user runs them.
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
  EXPECT_THAT(wrong.err, HasSubstr("unknown action 'frobnicate'; use list, inspect, verify or export"));
}

// A file of two parts: a pipeline's stages (their layers named by their index in the whole
// model), or a model a trial split itself.
std::string parts_file(const std::string& dir, bool pipeline) {
  checkpoint::Contents c;
  const std::vector<float> w(6, 0.5f), b(2, -1.0f);
  c.add("model_parallel/0/model/0/layer0.weight", checkpoint::DType::kFloat32, {2, 3}, w.data());
  c.add("model_parallel/0/model/0/layer0.bias", checkpoint::DType::kFloat32, {2}, b.data());
  c.add("model_parallel/1/model/0/layer" + std::string(pipeline ? "2" : "0") + ".weight", checkpoint::DType::kFloat32,
        {2, 3}, w.data());
  c.add_text("meta/model_parallel", pipeline ? R"({"parts": 2, "pipeline": true})" : R"({"parts": 2})");
  const std::string path = dir + (pipeline ? "/pipeline.h5" : "/split.h5");
  checkpoint::write_checkpoint(path, c);
  return path;
}

core::RunResult python_reader(const std::string& file, const std::vector<std::string>& more) {
  std::vector<std::string> argv{"/usr/bin/python3", HPCTRIAL_SOURCE_DIR "/scripts/hpctrial_checkpoint.py", file};
  argv.insert(argv.end(), more.begin(), more.end());
  return core::run_process(argv);
}

// A pipeline's stages export joined; a model split by its trial one part at a time, and refused
// whole with what to do, by the command and by the Python reader alike.
TEST(CliCheckpoint, ExportJoinsAPipelineAndTakesASplitModelPartByPart) {
  TempDir dir;
  const std::string out = (dir.path() / "model.pt").string();
  const std::string pipeline = parts_file(dir.path().string(), true);
  auto r = hpctrial_cli({"checkpoint", "export", pipeline, out});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("wrote " + out + ": 3 tensors"));
  r = python_reader(pipeline, {"--out", (dir.path() / "state.pt").string()});
  EXPECT_EQ(r.exit_code, 0) << r.err;

  const std::string split = parts_file(dir.path().string(), false);
  r = hpctrial_cli({"checkpoint", "export", split, out});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr(split + " holds a model the trial split into 2 parts"));
  EXPECT_THAT(r.err, HasSubstr("--part 0 to 1"));
  r = python_reader(split, {"--out", (dir.path() / "state.pt").string()});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("split into 2 parts"));
  r = hpctrial_cli({"checkpoint", "export", split, out, "--part", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("1 tensors"));
  r = hpctrial_cli({"checkpoint", "export", split, out, "--part", "2"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("part 2 is none of them"));
  r = hpctrial_cli({"checkpoint", "export", (dir.path() / "none.h5").string(), out});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("none.h5 does not exist"));
}

}  // namespace cli_checkpoint_test
}  // namespace hpctrial
