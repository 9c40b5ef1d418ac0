// Checkpoints written by several writers: each writes its pieces of the datasets at their planned
// offsets, the chief finishes the file with the combined checksums, and it reads like any other.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <numeric>

#include "../../support/temp_dir.h"
#include "hpctrial/checkpoint/format.h"
#include "hpctrial/checkpoint/shared_write.h"
#include "hpctrial/core/error.h"

namespace hpctrial::checkpoint {
namespace {

using testing::HasSubstr;
using testing_support::TempDir;

std::shared_ptr<Buffer> floats(std::size_t count, float first) {
  auto buffer = std::make_shared<Buffer>(count * sizeof(float));
  auto* p = static_cast<float*>(buffer->data());
  std::iota(p, p + count, first);
  return buffer;
}

struct Written {
  FilePlan plan;
  std::shared_ptr<Buffer> weight, state;
  std::string progress = R"({"batches": 7})";
  std::vector<std::uint32_t> crcs;
};

// Writer 0 (the chief) writes the weight and the text; writers 0, 1 and 2 write the optimizer
// state in three pieces that do not fall on 4 KiB boundaries, one from memory that is not aligned
// either. `skip` names a piece (0-2) left unwritten.
Written write_in_pieces(const std::string& path, int skip = -1) {
  Written w;
  w.weight = floats(3000, 0.5f);
  w.state = floats(5000, -100.0f);
  w.plan = plan_checkpoint(path,
                           {{"model/0/w", DType::kFloat32, {1000, 3}},
                            {"optimizer/0/state/0/exp_avg", DType::kFloat32, {5000}},
                            {"progress", DType::kUInt8, {static_cast<std::int64_t>(w.progress.size())}},
                            {"empty", DType::kFloat32, {0}}},
                           {{"batches", "7"}});
  const std::size_t cuts[] = {0, 1234, 3001, 5000};
  const auto* state = static_cast<const char*>(w.state->data());
  std::uint32_t state_crc = 0;
  for (int piece = 0; piece < 3; ++piece) {
    PieceWriter out(w.plan.temp);
    const std::size_t begin = cuts[piece] * 4, size = (cuts[piece + 1] - cuts[piece]) * 4;
    std::vector<char> unaligned(size + 1);
    std::memcpy(unaligned.data() + 1, state + begin, size);
    const char* from = piece == 1 ? unaligned.data() + 1 : state + begin;
    if (piece != skip) out.write(w.plan.offsets[1] + begin, from, size);
    if (piece == 0) {
      out.write(w.plan.offsets[0], w.weight->data(), w.weight->size());
      out.write(w.plan.offsets[2], w.progress.data(), w.progress.size());
    }
    out.sync();
    // Each writer's checksum of its piece, combined by the chief in dataset order.
    state_crc = piece == 0 ? crc32c(state, size) : crc32c_combine(state_crc, crc32c(state + begin, size), size);
  }
  w.crcs = {crc32c(w.weight->data(), w.weight->size()), state_crc, crc32c(w.progress.data(), w.progress.size()), 0};
  return w;
}

TEST(SharedWrite, PiecesFromSeveralWritersMakeOneOrdinaryCheckpoint) {
  TempDir dir;
  const std::string path = (dir.path() / "ckpt-7.h5").string();
  Written w = write_in_pieces(path);
  EXPECT_FALSE(std::filesystem::exists(path)) << "published before it was finished";
  EXPECT_TRUE(std::filesystem::exists(w.plan.temp));
  finish_checkpoint(w.plan, w.crcs);
  EXPECT_FALSE(std::filesystem::exists(w.plan.temp));
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);

  const Contents read = read_checkpoint(path);
  ASSERT_EQ(read.datasets.size(), 4u);
  const Dataset& weight = read.at("model/0/w", path);
  EXPECT_EQ(weight.shape, (std::vector<std::int64_t>{1000, 3}));
  EXPECT_EQ(std::memcmp(weight.data->data(), w.weight->data(), w.weight->size()), 0);
  const Dataset& state = read.at("optimizer/0/state/0/exp_avg", path);
  ASSERT_EQ(state.nbytes(), w.state->size());
  EXPECT_EQ(std::memcmp(state.data->data(), w.state->data(), w.state->size()), 0);
  EXPECT_EQ(read.at("progress", path).text(), w.progress);
  EXPECT_EQ(read.at("empty", path).nbytes(), 0u);
  EXPECT_EQ(read.attributes.at("batches"), "7");
  EXPECT_EQ(read_summary(path).attributes.at("batches"), "7");
}

// A writer that died before writing its piece: a chief that finished the file anyway would
// publish a checkpoint that no reader takes for a good one.
TEST(SharedWrite, AMissingPieceFailsItsChecksum) {
  TempDir dir;
  const std::string path = (dir.path() / "ckpt-7.h5").string();
  Written w = write_in_pieces(path, /*skip=*/2);
  finish_checkpoint(w.plan, w.crcs);
  try {
    read_checkpoint(path);
    FAIL() << "read a checkpoint with a missing piece";
  } catch (const CheckpointError& e) {
    EXPECT_THAT(e.what(), HasSubstr("optimizer/0/state/0/exp_avg"));
  }
}

TEST(SharedWrite, AnAbandonedPlanLeavesNothing) {
  TempDir dir;
  const std::string path = (dir.path() / "ckpt-7.h5").string();
  Written w = write_in_pieces(path);
  abandon_checkpoint(w.plan);
  EXPECT_FALSE(std::filesystem::exists(w.plan.temp));
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(SharedWrite, WrongChecksumCountIsAnInternalError) {
  TempDir dir;
  Written w = write_in_pieces((dir.path() / "ckpt-7.h5").string());
  EXPECT_THROW(finish_checkpoint(w.plan, {1, 2}), InternalError);
  abandon_checkpoint(w.plan);
}

}  // namespace
}  // namespace hpctrial::checkpoint
