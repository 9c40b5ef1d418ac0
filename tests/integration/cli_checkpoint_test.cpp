// hpctrial checkpoint list|inspect|verify|export, as a user runs them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
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

// --json: the same facts as the text, in one JSON document each, and a usage error for an option
// of another action.
TEST(CliCheckpoint, JsonFormsSayWhatTheTextSays) {
  TempDir dir;
  checkpoint::StoreOptions options;
  options.keep_latest = 5;
  checkpoint::CheckpointStore store(dir.path().string(), options);
  store.publish(state(100, 0.5));
  store.publish(state(200, std::nan("")));

  const auto listed = hpctrial_cli({"checkpoint", "list", dir.path().string(), "--json"});
  ASSERT_EQ(listed.exit_code, 0) << listed.err;
  const auto list = nlohmann::json::parse(listed.out);
  ASSERT_EQ(list.size(), 2u) << listed.out;
  EXPECT_EQ(list[0]["file"], "ckpt-200.h5");
  EXPECT_EQ(list[0]["batches"], 200);
  EXPECT_EQ(list[0]["metric"], "NaN") << "a NaN metric round-trips as JSON can hold it";
  EXPECT_EQ(list[0]["latest"], true);
  EXPECT_EQ(list[0]["valid"], true);
  EXPECT_EQ(list[1]["metric"], 0.5);
  EXPECT_EQ(list[1]["latest"], false);
  EXPECT_EQ(list[1]["bytes"], std::filesystem::file_size(store.path_for(100)));
  EXPECT_THAT(list[1]["time"].get<std::string>(), testing::MatchesRegex("[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:]{8}Z"));

  const auto inspected = hpctrial_cli({"checkpoint", "inspect", store.path_for(200), "--json"});
  ASSERT_EQ(inspected.exit_code, 0) << inspected.err;
  const auto inspect = nlohmann::json::parse(inspected.out);
  EXPECT_EQ(inspect["attributes"]["batches"], "200");
  ASSERT_EQ(inspect["datasets"].size(), 1u);
  EXPECT_EQ(inspect["datasets"][0]["name"], "model/0/fc.weight");
  EXPECT_EQ(inspect["datasets"][0]["shape"], nlohmann::json::array({40, 50}));
  EXPECT_EQ(inspect["datasets"][0]["bytes"], 8000);
  EXPECT_EQ(inspect["bytes"], 8000);

  std::filesystem::resize_file(store.path_for(100), 2000);
  const auto verified = hpctrial_cli({"checkpoint", "verify", dir.path().string(), "--json"});
  EXPECT_EQ(verified.exit_code, 1);
  const auto verify = nlohmann::json::parse(verified.out);
  EXPECT_EQ(verify["bad"], 1);
  ASSERT_EQ(verify["files"].size(), 2u);
  EXPECT_EQ(verify["files"][0]["file"], store.path_for(100));
  EXPECT_EQ(verify["files"][0]["ok"], false);
  EXPECT_THAT(verify["files"][0]["problem"].get<std::string>(), HasSubstr(store.path_for(100)));
  EXPECT_EQ(verify["files"][1]["ok"], true);
  EXPECT_TRUE(verify["files"][1]["problem"].is_null());

  const auto wrong = hpctrial_cli({"checkpoint", "list", dir.path().string(), "--part", "1"});
  EXPECT_EQ(wrong.exit_code, 2);
  EXPECT_THAT(wrong.err, HasSubstr("--model and --part belong to 'checkpoint export'"));
  const auto help = hpctrial_cli({"checkpoint", "list", "--help"});
  EXPECT_EQ(help.exit_code, 0) << help.err;
  EXPECT_THAT(help.out, HasSubstr("--json"));
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

// The Python metrics reader: every trial's records of a kind, NaN and infinities read back as
// floats, a last line cut short by a killed job skipped, and a damaged line named.
TEST(PythonMetricsReader, ReadsEveryTrialsRecordsAsHpctrialWroteThem) {
  TempDir dir;
  dir.write("exp/trial-0/metrics.jsonl",
            R"({"batches":10,"epoch":0,"kind":"training","metrics":{"loss":0.5},"records":160,"time":"2026-11-30T00:00:00.000Z"})"
            "\n"
            R"({"batches":10,"epoch":0,"kind":"validation","metrics":{"validation_loss":"NaN"},"records":160,"time":"2026-11-30T00:00:01.000Z"})"
            "\n");
  dir.write("exp/trial-1/metrics.jsonl",
            R"({"batches":20,"epoch":1,"kind":"validation","metrics":{"validation_loss":"-Infinity"},"records":320,"time":"2026-11-30T00:00:02.000Z"})"
            "\n{\"batches\":3");
  const std::string reader = HPCTRIAL_SOURCE_DIR "/scripts/hpctrial_metrics.py";
  auto r = core::run_process({"/usr/bin/python3", reader, (dir.path() / "exp").string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "trial,kind,batches,epoch,records,time,validation_loss\n"
                   "0,validation,10,0,160,2026-11-30T00:00:01.000Z,nan\n"
                   "1,validation,20,1,320,2026-11-30T00:00:02.000Z,-inf\n");
  r = core::run_process({"/usr/bin/python3", "-c",
                         "import sys; sys.path.insert(0, '" HPCTRIAL_SOURCE_DIR "/scripts'); import math, hpctrial_metrics as m; "
                         "t = m.experiment_metrics(sys.argv[1]); "
                         "print(sorted(t), len(t[0]), t[0][0]['metrics']['loss'], math.isnan(t[0][1]['metrics']['validation_loss']))",
                         (dir.path() / "exp").string()});
  EXPECT_EQ(r.out, "[0, 1] 2 0.5 True\n") << r.err;
  dir.write("exp/trial-1/metrics.jsonl", "{not json\n{\"kind\":\"training\",\"metrics\":{}}\n");
  r = core::run_process({"/usr/bin/python3", reader, (dir.path() / "exp").string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr((dir.path() / "exp/trial-1/metrics.jsonl").string() + ":1: not a JSON record"));
}

}  // namespace cli_checkpoint_test
}  // namespace hpctrial
