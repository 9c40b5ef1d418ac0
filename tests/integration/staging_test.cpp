// data.stage with real mpirun: the trial's input copied once per node to node-local storage,
// verified, reused by the next run of the trial where its checksums still hold, copied afresh
// where they do not, removed once the trial is complete; a path that is not there is an error
// naming the node, the key and the path, before anything trains.
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "launcher_fixture.h"

namespace hpctrial::testing_launcher {
namespace {

namespace fs = std::filesystem;
using testing::HasSubstr;
using testing::Not;

int count_of(const std::string& text, const std::regex& pattern) {
  return static_cast<int>(std::distance(std::sregex_iterator(text.begin(), text.end(), pattern), std::sregex_iterator()));
}

class Staging : public Launcher {
 protected:
  void SetUp() override {
    fs::create_directories(data() / "set" / "sub");
    std::ofstream(data() / "table.txt") << "the source's first line\nmore\n";
    std::ofstream(data() / "set" / "a.bin") << std::string(3 << 20, 'a');  // more than one read
    std::ofstream(data() / "set" / "sub" / "b.bin") << "bbbb";
    fs::create_directories(local());
  }
  fs::path data() const { return dir_.path() / "data"; }
  fs::path local() const { return dir_.path() / "local"; }
  // The staged folder of this node (the only one: every rank runs here).
  fs::path folder() const {
    for (const auto& entry : fs::directory_iterator(local())) return entry.path();
    return {};
  }
  std::string staged_config(const std::string& stage, std::int64_t batches, int batch_ms) {
    return config("data: {table: " + (data() / "table.txt").string() + ", set: " + (data() / "set").string() +
                      "/, words: not a path, elsewhere: /no/such/file, stage: " + stage + "}\n",
                  batches, 2, batch_ms);
  }
};

TEST_F(Staging, DataIsCopiedOncePerNodeVerifiedReusedAfterAStopAndRemovedAtTheEnd) {
  const std::string stage = "{to: " + local().string() + "}";
  auto first = start(staged_config(stage, 4000, 1));
  wait_for_step(20);
  first->signal(SIGUSR2);
  ASSERT_TRUE(first->wait(60s).has_value());
  ASSERT_EQ(first->exit_code(), 75) << first->output();
  const std::string out = first->output();
  const fs::path staged = folder();
  EXPECT_EQ(staged.filename().string().rfind("hpctrial-stage-", 0), 0u) << staged;
  EXPECT_THAT(staged.filename().string(), HasSubstr("-trial-0-"));
  EXPECT_EQ(count_of(out, std::regex("data\\.stage: node [^:]+: data\\.table copied to " + staged.string() +
                                     "/table/table\\.txt \\(0\\.0 MB in 1 file, [0-9.]+ s, checksums verified\\)")), 1)
      << "once per node, by one rank:\n" << out;
  EXPECT_EQ(count_of(out, std::regex("data\\.set copied to " + staged.string() + "/set/set \\(3\\.1 MB in 2 files")), 1)
      << out;
  EXPECT_THAT(out, Not(HasSubstr("data.words"))) << "a value that is no absolute path is not staged";
  EXPECT_THAT(out, Not(HasSubstr("data.elsewhere"))) << "nor one that is not there";
  for (const char* rank : {"rank 0", "rank 1"}) {
    EXPECT_THAT(out, HasSubstr(std::string(rank) + " reads " + (staged / "table" / "table.txt").string() +
                               ": the source's first line"));
  }
  struct stat st {};
  ASSERT_EQ(::stat((staged / "set" / "set" / "sub" / "b.bin").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0400u) << "copies are read-only";
  EXPECT_TRUE(fs::exists(staged / "table.json"));

  // The next run: the table as it was, the folder's copy damaged since.
  fs::permissions(staged / "set" / "set" / "sub" / "b.bin", fs::perms::owner_write, fs::perm_options::add);
  std::ofstream(staged / "set" / "set" / "sub" / "b.bin") << "XXXX";
  auto second = run(staged_config(stage, 4000, 1));
  const std::string again = second->output();
  ASSERT_EQ(second->exit_code(), 0) << again;
  EXPECT_THAT(again, HasSubstr("data.table reused " + (staged / "table" / "table.txt").string() +
                               " (0.0 MB in 1 file, checksums verified)"));
  EXPECT_THAT(again, HasSubstr("the staged " + (staged / "set" / "set" / "sub" / "b.bin").string() +
                               " differs from its manifest; the data is copied again"));
  EXPECT_THAT(again, HasSubstr("data.set copied to " + (staged / "set" / "set").string()));
  EXPECT_THAT(again, HasSubstr("rank 1 reads " + (staged / "table" / "table.txt").string()));
  EXPECT_FALSE(fs::exists(staged)) << "a complete trial leaves no copies";
  EXPECT_TRUE(fs::exists(data() / "set" / "sub" / "b.bin")) << "the source stays";
  expect_no_rank_left();
}

TEST_F(Staging, AListedPathThatIsNotThereEndsTheRunNamingTheNodeTheKeyAndThePath) {
  auto p = run(staged_config("{to: " + local().string() + ", keys: [table, elsewhere]}", 100, 0));
  EXPECT_EQ(p->exit_code(), 2) << p->output();
  EXPECT_THAT(p->output(), testing::ContainsRegex("node [^:]+: data\\.elsewhere names /no/such/file, which does not "
                                                  "exist; fix the path or leave the key out of data\\.stage\\.keys"));
  EXPECT_THAT(p->output(), Not(HasSubstr("reads "))) << "no trial was built";
  EXPECT_FALSE(fs::exists(trial() + "/checkpoints/ckpt-100.h5"));
  expect_no_rank_left();

  // A key that would name a folder outside the staging folder. (The failed run keeps what it
  // copied, for the next.)
  const auto entries = [&] { return std::distance(fs::recursive_directory_iterator(local()), {}); };
  const auto before = entries();
  p = run(config("data: {\"../up\": " + (data() / "table.txt").string() + ", stage: {to: " + local().string() +
                 "}}\n", 100, 2, 0));
  EXPECT_EQ(p->exit_code(), 2) << p->output();
  EXPECT_THAT(p->output(), HasSubstr("data.../up is staged, and its key cannot name a folder; rename the key so that "
                                     "it holds no '/' and is not '.' or '..'"));
  EXPECT_EQ(entries(), before) << "nothing staged";
  EXPECT_FALSE(fs::exists(dir_.path() / "up"));
}

}  // namespace
}  // namespace hpctrial::testing_launcher
