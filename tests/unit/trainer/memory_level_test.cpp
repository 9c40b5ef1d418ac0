// The memory level's copy that a checkpoint on the shared filesystem is written from
// (MemoryLevel::pinned_copy): its views hold the copy's bytes, no later copy is written into its
// slot until they and the function are gone, and a copy that failed or a level that closed is an
// error, never an empty checkpoint.
#include "state/memory_level.h"

#include <torch/torch.h>

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {
namespace memory_level_test {  // named: the target compiles its sources together (UNITY_BUILD)

using namespace std::chrono_literals;
namespace fs = std::filesystem;

class PinnedCopy : public testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::exists("/dev/shm") ? "/dev/shm" : fs::temp_directory_path().string()) +
                          "/hpctrial-pin-test-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
    levels_.memory_on = true;
    levels_.memory_dir = root_;
    levels_.memory_max_share = 0.9;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  std::unique_ptr<MemoryLevel> level() {
    return std::make_unique<MemoryLevel>(levels_, rank::NodeMemoryPlace{root_, "pin-test", 0, "session", 0}, 1);
  }
  // A copy of batch `batches`: a live tensor of 1 MiB holding `value`, and the batch count.
  Snapshot snapshot(std::int64_t batches, float value) {
    Snapshot s;
    s.contents.attributes[checkpoint::kBatchesAttribute] = std::to_string(batches);
    s.deferred.push_back({"model/0/weight", torch::full({1 << 18}, value)});
    return s;
  }
  // The copies held once the last submitted is committed (wait_for_copies returns once its tensors
  // are in; the level's thread commits it after that).
  static std::vector<std::int64_t> held_after(MemoryLevel& memory, std::int64_t last) {
    const auto until = std::chrono::steady_clock::now() + 30s;
    std::vector<std::int64_t> held = memory.held();
    while ((held.empty() || held.front() != last) && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(1ms);
      held = memory.held();
    }
    return held;
  }
  // Whether `done` holds within 30 s (the level's thread ends a copy after committing it).
  template <typename Predicate>
  static bool eventually(Predicate done) {
    const auto until = std::chrono::steady_clock::now() + 30s;
    while (!done() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
    return done();
  }
  static float first_value(const checkpoint::Contents& contents) {
    float v = 0;
    std::memcpy(&v, contents.at("model/0/weight", "copy").data->data(), sizeof v);
    return v;
  }

  std::string root_;
  core::CheckpointLevels levels_;
};

TEST_F(PinnedCopy, NoCopyReplacesTheOneACheckpointIsWrittenFromUntilItIsDone) {
  auto memory = level();
  memory->submit(snapshot(10, 1));
  auto pinned = memory->pinned_copy(10);
  memory->submit(snapshot(20, 2));  // into the other slot
  checkpoint::Contents contents = pinned();  // waits for batch 10's commit
  EXPECT_EQ(first_value(contents), 1);
  memory->wait_for_copies();
  EXPECT_EQ(held_after(*memory, 20), (std::vector<std::int64_t>{20, 10}));

  // Batch 30 would replace batch 10's copy: the level's thread waits, and the views keep reading
  // batch 10's bytes.
  memory->submit(snapshot(30, 3));
  auto copied = std::async(std::launch::async, [&] { memory->wait_for_copies(); });
  EXPECT_EQ(copied.wait_for(300ms), std::future_status::timeout);
  EXPECT_EQ(first_value(contents), 1);
  EXPECT_EQ(memory->held(), (std::vector<std::int64_t>{20, 10}));
  contents = checkpoint::Contents();
  EXPECT_EQ(copied.wait_for(300ms), std::future_status::timeout) << "the function still pins the copy";
  pinned = nullptr;
  copied.get();
  memory->submit(snapshot(40, 4));  // waits for batch 30's commit first
  memory->wait_for_copies();
  EXPECT_EQ(held_after(*memory, 40), (std::vector<std::int64_t>{40, 30}));
}

TEST_F(PinnedCopy, AFunctionNeverCalledUnpinsWhenItGoes) {
  auto memory = level();
  memory->submit(snapshot(10, 1));
  memory->pinned_copy(10);  // dropped at once
  memory->submit(snapshot(20, 2));
  memory->submit(snapshot(30, 3));
  memory->wait_for_copies();
  EXPECT_EQ(held_after(*memory, 30), (std::vector<std::int64_t>{30, 20}));
}

TEST_F(PinnedCopy, ACopyThatFailedOrALevelThatClosedIsAnError) {
  auto memory = level();
  Snapshot bad = snapshot(10, 1);
  bad.before_publish = [] { throw IoError("the tmpfs is full"); };
  memory->submit(std::move(bad));
  auto failed = memory->pinned_copy(10);
  try {
    failed();
    ADD_FAILURE() << "a failed copy gave contents";
  } catch (const CheckpointError& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("the copy in node memory of batch 10, which the checkpoint is written "
                                             "from, failed: the tmpfs is full"));
  }
  auto never = memory->pinned_copy(20);  // no copy of batch 20 is submitted
  memory.reset();
  EXPECT_THROW(never(), CheckpointError);
}

// The loop asks before each copy whether it would wait for a checkpoint's copy, and holds it back.
TEST_F(PinnedCopy, TheLoopIsToldWhenTheNextCopyWouldWaitForAPinnedOne) {
  auto memory = level();
  // Batch 10's copy is held before its commit until the question is asked: a copy this small
  // may otherwise be committed already, and the next one would then go to the empty slot.
  std::promise<void> asked;
  std::shared_future<void> answered = asked.get_future().share();
  Snapshot held = snapshot(10, 1);
  held.before_publish = [answered] { answered.wait(); };
  memory->submit(std::move(held));
  auto pinned = memory->pinned_copy(10);
  EXPECT_TRUE(memory->next_copy_would_wait(20)) << "a copy in flight, and a pin";
  asked.set_value();
  memory->wait_for_copies();
  checkpoint::Contents contents = pinned();  // batch 10 committed
  EXPECT_EQ(held_after(*memory, 10), (std::vector<std::int64_t>{10}));
  EXPECT_TRUE(eventually([&] { return !memory->next_copy_would_wait(20); })) << "the other slot holds nothing";
  memory->submit(snapshot(20, 2));
  memory->wait_for_copies();
  EXPECT_EQ(held_after(*memory, 20), (std::vector<std::int64_t>{20, 10}));
  EXPECT_TRUE(memory->next_copy_would_wait(30)) << "batch 30 would replace batch 10's copy";
  contents = checkpoint::Contents();
  pinned = nullptr;
  EXPECT_FALSE(memory->next_copy_would_wait(30));
}

// A level closed while a copy is still being laid out (training failed before its optimizer
// waited for the copy): the copy's pieces are still copied, and the level closes.
TEST_F(PinnedCopy, ALevelClosedWithACopyInFlightCloses) {
  for (int i = 0; i < 3; ++i) {
    auto memory = level();
    Snapshot big = snapshot(10, 1);
    big.deferred.push_back({"model/0/big", torch::full({16 << 20}, 5.0f)});  // 64 MiB
    memory->submit(std::move(big));
    memory.reset();
  }
}

}  // namespace memory_level_test
}  // namespace hpctrial::trainer::detail
