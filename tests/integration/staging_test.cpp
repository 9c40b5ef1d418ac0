// data.stage with real mpirun: the trial's input copied once per node to node-local storage,
// verified, reused by the next run of the trial where its checksums still hold, copied afresh
// where they do not, removed once the trial is complete; a path that is not there is an error
// naming the node, the key and the path, before anything trains.
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <tuple>

#include "../support/read_file.h"

#include "launcher_fixture.h"

namespace hpctrial::testing_launcher {
namespace {

namespace fs = std::filesystem;
using testing::HasSubstr;
using testing::Not;
using testing_support::read_file;

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
                                     "/data/table/table\\.txt \\(0\\.0 MB in 1 file, [0-9.]+ s, checksums verified\\)")), 1)
      << "once per node, by one rank:\n" << out;
  EXPECT_EQ(count_of(out, std::regex("data\\.set copied to " + staged.string() + "/data/set/set \\(3\\.1 MB in 2 files")), 1)
      << out;
  EXPECT_THAT(out, Not(HasSubstr("data.words"))) << "a value that is no absolute path is not staged";
  EXPECT_THAT(out, Not(HasSubstr("data.elsewhere"))) << "nor one that is not there";
  for (const char* rank : {"rank 0", "rank 1"}) {
    EXPECT_THAT(out, HasSubstr(std::string(rank) + " reads " + (staged / "data" / "table" / "table.txt").string() +
                               ": the source's first line"));
  }
  struct stat st {};
  ASSERT_EQ(::stat((staged / "data" / "set" / "set" / "sub" / "b.bin").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0400u) << "copies are read-only";
  EXPECT_TRUE(fs::exists(staged / "manifests" / "table.json"));

  // The next run: the table as it was, the folder's copy damaged since.
  fs::permissions(staged / "data" / "set" / "set" / "sub" / "b.bin", fs::perms::owner_write, fs::perm_options::add);
  std::ofstream(staged / "data" / "set" / "set" / "sub" / "b.bin") << "XXXX";
  auto second = run(staged_config(stage, 4000, 1));
  const std::string again = second->output();
  ASSERT_EQ(second->exit_code(), 0) << again;
  EXPECT_THAT(again, HasSubstr("data.table reused " + (staged / "data" / "table" / "table.txt").string() +
                               " (0.0 MB in 1 file, checksums verified)"));
  EXPECT_THAT(again, HasSubstr("the staged " + (staged / "data" / "set" / "set" / "sub" / "b.bin").string() +
                               " differs from its manifest; the data is copied again"));
  EXPECT_THAT(again, HasSubstr("data.set copied to " + (staged / "data" / "set" / "set").string()));
  EXPECT_THAT(again, HasSubstr("rank 1 reads " + (staged / "data" / "table" / "table.txt").string()));
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
                 "}}\n", 100, 2, 0),
          "", {"--experiment", (dir_.path() / "up-exp").string()});
  EXPECT_EQ(p->exit_code(), 2) << p->output();
  EXPECT_THAT(p->output(), HasSubstr("data.../up is staged, and its key cannot name a folder; rename the key so that "
                                     "it holds no '/' and is not '.' or '..'"));
  EXPECT_EQ(entries(), before) << "nothing staged";
  EXPECT_FALSE(fs::exists(dir_.path() / "up"));
}

// Two trial programs run alone (no launcher), in two trial directories, with configs both called
// "launched" that stage different tables: each is an experiment of its own (an identity in its
// trial directory), stages into a folder of its own and reads its own table. The second runs to
// its end while the first trains, and removing its copies leaves the first's as they were; so
// does the first's stop.
TEST_F(Staging, TwoRunsAloneOfSameNamedConfigsKeepEachOthersCopies) {
  std::ofstream(data() / "other.txt") << "the other table\n";
  const auto alone = [&](const std::string& table, const std::string& trial_dir, std::int64_t batches, int batch_ms) {
    const std::string exp = dir_.write(trial_dir + ".yaml",
        "name: launched\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
        "searcher: {name: single, metric: validation_loss, max_length: {batches: " + std::to_string(batches) + "}}\n"
        "hyperparameters: {global_batch_size: 16, fail_rank: -1, fail_batch: 0, fail_mode: none, batch_ms: " +
        std::to_string(batch_ms) + "}\nreproducibility: {experiment_seed: 7}\n"
        "data: {table: " + (data() / table).string() + ", stage: {to: " + local().string() + "}}\n");
    return std::make_unique<BackgroundProcess>(
        std::vector<std::string>{HPCTRIAL_FAULTY_TRIAL, "--config", exp, "--trial-dir", (dir_.path() / trial_dir).string(),
                                 "--progress-seconds", "0"},
        env(), (dir_.path() / (trial_dir + ".txt")).string());
  };
  const auto folders = [&] {
    std::set<std::string> out;
    for (const auto& entry : fs::directory_iterator(local())) out.insert(entry.path().string());
    return out;
  };
  auto first = alone("table.txt", "a", 100000, 2);
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (first->output().find("rank 0 reads") == std::string::npos && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_THAT(first->output(), HasSubstr("rank 0 reads")) << first->output();
  const auto first_folders = folders();
  ASSERT_EQ(first_folders.size(), 1u);
  const fs::path mine = *first_folders.begin();
  EXPECT_THAT(first->output(), HasSubstr("rank 0 reads " + (mine / "data" / "table" / "table.txt").string() +
                                         ": the source's first line"));
  const std::string id = nlohmann::json::parse(read_file(dir_.path() / "a" / "experiment.json")).at("experiment_id");
  EXPECT_THAT(mine.filename().string(), HasSubstr("hpctrial-stage-" + id + "-trial-0-"));

  auto second = alone("other.txt", "b", 20, 0);
  ASSERT_TRUE(second->wait(120s).has_value());
  ASSERT_EQ(second->exit_code(), 0) << second->output();
  EXPECT_THAT(second->output(), HasSubstr("rank 0 reads"));
  EXPECT_THAT(second->output(), HasSubstr(": the other table"));
  EXPECT_THAT(second->output(), Not(HasSubstr(mine.string()))) << "the second run used the first's folder";
  EXPECT_EQ(folders(), first_folders) << "the second run's end removed only its own copies";
  EXPECT_EQ(read_file(mine / "data" / "table" / "table.txt"), "the source's first line\nmore\n");

  first->signal(SIGUSR2);
  ASSERT_TRUE(first->wait(60s).has_value());
  EXPECT_EQ(first->exit_code(), 75) << first->output();
  EXPECT_EQ(folders(), first_folders) << "a stopped run keeps its copies for the next";

  // One after the other: a third, run to its end while the first is stopped.
  auto third = alone("other.txt", "c", 20, 0);
  ASSERT_TRUE(third->wait(120s).has_value());
  ASSERT_EQ(third->exit_code(), 0) << third->output();
  EXPECT_EQ(folders(), first_folders);
  EXPECT_EQ(read_file(mine / "data" / "table" / "table.txt"), "the source's first line\nmore\n");
}

// Keys whose names end like a manifest or a partial copy of another key's: each key's copy, its
// manifest and its partial copy have places of their own.
TEST_F(Staging, KeysNamedLikeAnotherKeysManifestOrPartialCopyStayApart) {
  std::ofstream(data() / "json.txt") << "the json key's table\n";
  std::ofstream(data() / "partial.txt") << "the partial key's table\n";
  const std::string exp = config("data: {table: " + (data() / "table.txt").string() + ", table.json: " +
                                     (data() / "json.txt").string() + ", table.partial: " +
                                     (data() / "partial.txt").string() + ", stage: {to: " + local().string() + "}}\n",
                                 4000, 2, 1);
  auto p = start(exp);
  wait_for_step(5);
  p->signal(SIGUSR2);
  ASSERT_TRUE(p->wait(60s).has_value());
  ASSERT_EQ(p->exit_code(), 75) << p->output();
  const fs::path staged = folder();
  EXPECT_EQ(read_file(staged / "data" / "table" / "table.txt"), "the source's first line\nmore\n");
  EXPECT_EQ(read_file(staged / "data" / "table.json" / "json.txt"), "the json key's table\n");
  EXPECT_EQ(read_file(staged / "data" / "table.partial" / "partial.txt"), "the partial key's table\n");
  for (const char* manifest : {"table.json", "table.json.json", "table.partial.json"}) {
    EXPECT_TRUE(fs::exists(staged / "manifests" / manifest)) << manifest;
  }
  EXPECT_TRUE(fs::is_empty(staged / "partial")) << "a partial copy was left";
  // The next run reuses all three.
  auto again = start(exp);
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (again->output().find("rank 1 reads") == std::string::npos && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(20ms);
  }
  again->signal(SIGUSR2);
  ASSERT_TRUE(again->wait(60s).has_value());
  for (const char* key : {"data.table reused", "data.table.json reused", "data.table.partial reused"}) {
    EXPECT_THAT(again->output(), HasSubstr(key));
  }
  expect_no_rank_left();
}

// The node's staging folder, there before the run as another user's or writable by others: the
// run is refused, naming the folder, before anything trains, and the folder is left as it was.
TEST_F(Staging, AFolderOfAnotherUserOrWritableByOthersIsRefused) {
  const std::string stage = "{to: " + local().string() + "}";
  auto first = start(staged_config(stage, 4000, 1));
  wait_for_step(5);
  first->signal(SIGUSR2);
  ASSERT_TRUE(first->wait(60s).has_value());
  ASSERT_EQ(first->exit_code(), 75) << first->output();
  const fs::path staged = folder();
  struct stat st {};
  ASSERT_EQ(::stat(staged.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u) << "the folder is private";
  const std::string metrics = read_file(trial() + "/metrics.jsonl");
  for (const auto& [mode, owner, said] : std::vector<std::tuple<mode_t, uid_t, std::string>>{
           {0777, ::geteuid(), "may be written by others (mode 0777)"},
           {0755, 65534, "belongs to user id 65534"}}) {
    ASSERT_EQ(::chmod(staged.c_str(), mode), 0);
    ASSERT_EQ(::chown(staged.c_str(), owner, static_cast<gid_t>(-1)), 0);
    auto p = run(staged_config(stage, 4000, 1));
    EXPECT_EQ(p->exit_code(), 2) << p->output();
    EXPECT_THAT(p->output(), HasSubstr("data.stage: " + staged.string() + " " + said));
    EXPECT_THAT(p->output(), Not(HasSubstr("reads "))) << "no trial was built";
    EXPECT_EQ(read_file(trial() + "/metrics.jsonl"), metrics) << "nothing trained";
    ASSERT_EQ(::stat(staged.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, mode) << "the folder was changed";
    EXPECT_EQ(st.st_uid, owner);
    expect_no_rank_left();
  }
}

}  // namespace
}  // namespace hpctrial::testing_launcher
