// The memory level's slot files: copies written by turns, a copy cut short never held, damage
// found when a copy is loaded, NaN and inf kept bit for bit.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <csignal>
#include <cstring>
#include <fstream>
#include <limits>
#include <vector>

#include "../../support/temp_dir.h"
#include "hpctrial/checkpoint/memory_slots.h"
#include "hpctrial/core/error.h"

namespace hpctrial::checkpoint {
namespace {

using testing::HasSubstr;
using testing_support::TempDir;

std::vector<float> values(float first) {
  return {first, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity(), -0.0f, 3.5f};
}

// A copy of `batches`: one float tensor of values(first) and a text, committed unless told not to.
void put(MemorySlots& slots, std::int64_t batches, float first, bool commit = true) {
  const std::vector<float> v = values(first);
  const std::string text = "{\"step\":" + std::to_string(batches) + "}";
  MemorySlots::Copy copy = slots.begin(
      batches, {{"model/w", DType::kFloat32, {2, 3}, v.size() * sizeof(float)}, {"meta/state", DType::kUInt8,
                                                                                {static_cast<std::int64_t>(text.size())}, text.size()}},
      {{"batches", std::to_string(batches)}});
  copy.set_crc32c(0, copy_crc32c(copy.data(0), v.data(), v.size() * sizeof(float)));
  copy.set_crc32c(1, copy_crc32c(copy.data(1), text.data(), text.size()));
  if (commit) copy.commit();
}

TEST(MemorySlots, KeepTheTwoNewestCopiesBitForBit) {
  TempDir dir;
  MemorySlots slots(dir.path().string());
  EXPECT_TRUE(slots.held().empty());
  put(slots, 10, 1.0f);
  put(slots, 20, 2.0f);
  put(slots, 30, 3.0f);  // replaces 10, the older
  EXPECT_EQ(slots.held(), (std::vector<std::int64_t>{30, 20}));
  for (std::int64_t batches : {20, 30}) {
    const auto loaded = slots.load(batches);
    EXPECT_EQ(loaded.batches, batches);
    EXPECT_THAT(loaded.path, testing::MatchesRegex(".*/slot-[01]"));
    EXPECT_EQ(loaded.contents.attributes.at("batches"), std::to_string(batches));
    const Dataset& w = loaded.contents.at("model/w", loaded.path);
    EXPECT_EQ(w.shape, (std::vector<std::int64_t>{2, 3}));
    const std::vector<float> want = values(static_cast<float>(batches / 10));
    EXPECT_EQ(std::memcmp(w.data->data(), want.data(), want.size() * sizeof(float)), 0) << "NaN, inf and -0 bit for bit";
    EXPECT_EQ(loaded.contents.at("meta/state", loaded.path).text(), "{\"step\":" + std::to_string(batches) + "}");
  }
  for (int s = 0; s < MemorySlots::kSlots; ++s) {
    struct stat st {};
    ASSERT_EQ(::stat(slots.path(s).c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
  }
  // Another process (a restarted rank) reads the same copies.
  MemorySlots again(dir.path().string());
  EXPECT_EQ(again.held(), (std::vector<std::int64_t>{30, 20}));
  EXPECT_NO_THROW(again.load(30));
}

TEST(MemorySlots, ACopyCutShortIsNeverHeldAndKeepsTheOneBefore) {
  TempDir dir;
  MemorySlots slots(dir.path().string());
  put(slots, 10, 1.0f);
  put(slots, 20, 2.0f);
  put(slots, 30, 3.0f, /*commit=*/false);  // its slot held 10: that copy is gone, 20 stays
  EXPECT_EQ(slots.held(), (std::vector<std::int64_t>{20}));
  EXPECT_THROW(slots.load(30), CheckpointError);
  // A process killed in the middle of a copy: the same.
  const pid_t child = ::fork();
  if (child == 0) {
    MemorySlots mine(dir.path().string());
    std::vector<float> big(1 << 20, 1.0f);
    MemorySlots::Copy copy = mine.begin(40, {{"model/w", DType::kFloat32, {1 << 20}, big.size() * sizeof(float)}}, {});
    std::memcpy(copy.data(0), big.data(), big.size() / 2);
    ::raise(SIGKILL);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(slots.held(), (std::vector<std::int64_t>{20}));
  EXPECT_NO_THROW(slots.load(20));
}

TEST(MemorySlots, DamageIsFoundWhenACopyIsLoaded) {
  TempDir dir;
  MemorySlots slots(dir.path().string());
  put(slots, 10, 1.0f);
  const std::string file = slots.path(0);
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4096 + 4);  // inside model/w's bytes
    f.put('\x7f');
  }
  EXPECT_EQ(slots.held(), (std::vector<std::int64_t>{10})) << "the header and manifest are intact";
  try {
    slots.load(10);
    FAIL() << "a damaged copy loaded";
  } catch (const CheckpointError& e) {
    EXPECT_THAT(e.what(), HasSubstr(file));
    EXPECT_THAT(e.what(), HasSubstr("'model/w' does not match its CRC-32C"));
  }
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(24);  // the header's batch count
    f.put('\x01');
  }
  EXPECT_TRUE(slots.held().empty()) << "a header that fails its CRC holds nothing";
}

// A copy as a partner receives it: the image's header, then the rest, written by the same rules;
// one cut short, or whose manifest is not its header's, is never held.
TEST(MemorySlots, ACopyArrivesWholeFromElsewhereOrNotAtAll) {
  TempDir here, there;
  MemorySlots own(here.path().string()), kept(there.path().string());
  put(own, 10, 1.0f);
  put(own, 20, 2.0f);
  EXPECT_FALSE(own.image(30).has_value());
  const auto image = own.image(20);
  ASSERT_TRUE(image.has_value());
  ASSERT_GT(image->size, MemorySlots::kHeaderBytes);
  auto incoming = kept.accept(image->data);
  ASSERT_TRUE(incoming.has_value());
  EXPECT_EQ(incoming->batches(), 20);
  EXPECT_EQ(incoming->rest_size(), image->size - MemorySlots::kHeaderBytes);
  std::memcpy(incoming->rest(), image->data + MemorySlots::kHeaderBytes, incoming->rest_size() / 2);
  EXPECT_TRUE(kept.held().empty()) << "held before its header is written";
  std::memcpy(incoming->rest(), image->data + MemorySlots::kHeaderBytes, incoming->rest_size());
  incoming->commit();
  EXPECT_EQ(kept.held(), (std::vector<std::int64_t>{20}));
  const auto loaded = kept.load(20);
  const std::vector<float> want = values(2.0f);
  EXPECT_EQ(std::memcmp(loaded.contents.at("model/w", loaded.path).data->data(), want.data(), want.size() * sizeof(float)), 0);

  // No copy at the sender: a header of zeros, and nothing follows.
  const std::vector<char> zeros(MemorySlots::kHeaderBytes, '\0');
  EXPECT_FALSE(kept.accept(zeros.data()).has_value());
  EXPECT_EQ(kept.held(), (std::vector<std::int64_t>{20}));

  // A manifest that arrived damaged: refused, naming the slot file, and its slot holds nothing.
  const auto ten = own.image(10);
  ASSERT_TRUE(ten.has_value());
  auto damaged = kept.accept(ten->data);
  ASSERT_TRUE(damaged.has_value());
  std::memcpy(damaged->rest(), ten->data + MemorySlots::kHeaderBytes, damaged->rest_size());
  damaged->rest()[damaged->rest_size() - 2] ^= 0x20;
  try {
    damaged->commit();
    FAIL() << "a damaged copy was committed";
  } catch (const CheckpointError& e) {
    EXPECT_THAT(e.what(), HasSubstr(there.path().string() + "/slot-"));
    EXPECT_THAT(e.what(), HasSubstr("batch 10 that arrived does not match"));
  }
  EXPECT_EQ(kept.held(), (std::vector<std::int64_t>{20}));
}

}  // namespace
}  // namespace hpctrial::checkpoint
