// rank::NodeMemory: private folders of the user's own, an earlier run of the trial removed, another
// trial's run removed only when no rank holds it and it has not been used for a while, and what
// is left when the trial's run ends.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "hpctrial/core/error.h"
#include "hpctrial/rank/node_memory.h"
#include "../../support/temp_dir.h"

namespace hpctrial::rank {
namespace {

namespace fs = std::filesystem;
using testing::HasSubstr;
using testing_support::TempDir;
using namespace std::chrono_literals;

class NodeMemoryTest : public testing::Test {
 protected:
  NodeMemoryPlace place(const std::string& experiment, int trial, const std::string& session, int rank = 0) const {
    return {dir_.path().string(), experiment, trial, session, rank};
  }
  fs::path user_dir() const { return dir_.path() / ("hpctrial-" + std::to_string(::getuid())); }
  static mode_t mode_of(const fs::path& p) {
    struct stat st {};
    EXPECT_EQ(::stat(p.c_str(), &st), 0) << p;
    return st.st_mode & 0777;
  }
  static void age(const fs::path& session) {
    const auto hour_ago = fs::file_time_type::clock::now() - std::chrono::hours(1);
    for (const auto& e : fs::recursive_directory_iterator(session)) fs::last_write_time(e.path(), hour_ago);
  }
  TempDir dir_;
};

TEST_F(NodeMemoryTest, MakesPrivateFoldersNamedByExperimentTrialRunAndRank) {
  const NodeMemory memory(place("exp1", 3, "host-12-99", 1));
  EXPECT_EQ(memory.dir(), (user_dir() / "exp1/trial-3/host-12-99/rank-1").string());
  for (const fs::path& p : {user_dir(), user_dir() / "exp1", user_dir() / "exp1/trial-3", fs::path(memory.dir())}) {
    EXPECT_EQ(mode_of(p), 0700u) << p;
  }
  EXPECT_GT(NodeMemory::node_bytes(), 0u);
  EXPECT_GT(NodeMemory::free_bytes(memory.dir()), 0u);
}

TEST_F(NodeMemoryTest, AnEarlierRunOfTheTrialGoesAndAnotherTrialsOnlyWhenUnheldAndUnused) {
  {
    NodeMemory earlier(place("exp1", 0, "run-a"));
    std::ofstream(fs::path(earlier.dir()) / "ckpt-10.h5") << "x";
  }
  NodeMemory held(place("exp2", 0, "busy"));  // a rank of another trial holds it, however old
  age(user_dir() / "exp2/trial-0/busy");
  {
    NodeMemory ended(place("exp3", 1, "ended"));
    std::ofstream(fs::path(ended.dir()) / "ckpt-10.h5") << "x";
  }
  age(user_dir() / "exp3/trial-1/ended");
  { NodeMemory recent(place("exp4", 0, "between-attempts")); }  // unheld, but used a moment ago

  const NodeMemory now(place("exp1", 0, "run-b"));
  EXPECT_FALSE(fs::exists(user_dir() / "exp1/trial-0/run-a")) << "an earlier run of this trial";
  EXPECT_TRUE(fs::exists(user_dir() / "exp2/trial-0/busy")) << "held by a rank";
  EXPECT_FALSE(fs::exists(user_dir() / "exp3")) << "unheld and unused for an hour: gone, its empty folders too";
  EXPECT_TRUE(fs::exists(user_dir() / "exp4/trial-0/between-attempts"));
  EXPECT_TRUE(fs::exists(now.dir()));
}

TEST_F(NodeMemoryTest, TheSameRunKeepsItsCopiesAcrossAttemptsAndTheLastRankRemovesTheTrials) {
  {
    NodeMemory first(place("exp1", 0, "run-a", 0));
    std::ofstream(fs::path(first.dir()) / "ckpt-10.h5") << "x";
  }
  NodeMemory again(place("exp1", 0, "run-a", 0));  // the restart inside the job
  EXPECT_TRUE(fs::exists(fs::path(again.dir()) / "ckpt-10.h5"));
  NodeMemory other_rank(place("exp1", 0, "run-a", 1));
  again.remove();
  EXPECT_FALSE(fs::exists(again.dir()));
  EXPECT_TRUE(fs::exists(other_rank.dir())) << "rank 1's";
  other_rank.remove();
  EXPECT_FALSE(fs::exists(user_dir() / "exp1")) << "the last rank's removal takes the trial's folders";
  EXPECT_TRUE(fs::exists(user_dir()));
}

TEST_F(NodeMemoryTest, AFolderThatIsNotTheUsersOwnOrANameThatIsAPathIsRefused) {
  fs::create_directories(dir_.path() / "elsewhere");
  fs::create_directory_symlink(dir_.path() / "elsewhere", user_dir());
  try {
    NodeMemory memory(place("exp1", 0, "run"));
    ADD_FAILURE() << "a link was taken for the user's folder";
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr(user_dir().string() + " is not a directory of this user's"));
  }
  fs::remove(user_dir());
  EXPECT_THROW(NodeMemory(place("../exp1", 0, "run")), IoError);
  EXPECT_THROW(NodeMemory(place("exp1", 0, "a/b")), IoError);
  EXPECT_THROW(NodeMemory(NodeMemoryPlace{(dir_.path() / "missing").string(), "exp1", 0, "run", 0}), IoError);
}

}  // namespace
}  // namespace hpctrial::rank
