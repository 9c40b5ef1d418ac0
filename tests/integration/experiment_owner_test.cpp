// The experiment's config and identity have one owner: a second command with another config
// (a run, a search's worker, a run of one trial of a grid) is refused before it writes anything,
// and the running trials, their configs and their restarts stay as they were; a lost or damaged
// experiment.json is refused, never taken for a new experiment, and `hpctrial experiment repair`
// rebuilds it from the checkpoints, after which the experiment resumes.
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <thread>

#include "../support/read_file.h"
#include "launcher_fixture.h"

namespace hpctrial {
namespace experiment_owner_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using testing::Not;
using testing_launcher::Launcher;
using testing_support::BackgroundProcess;
using testing_support::processes_running;
using testing_support::read_file;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

std::string text_of(const fs::path& path) {
  std::error_code ec;
  return fs::exists(path, ec) ? read_file(path) : std::string("(none)");
}

class ExperimentOwner : public Launcher {
 protected:
  // Every file of the experiment directory that says how it runs or ran, by path.
  std::map<std::string, std::string> configs() const {
    std::map<std::string, std::string> out;
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(experiment(), ec); it != fs::recursive_directory_iterator();
         it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name == "experiment.yaml" || name == "effective-config.yaml") out[it->path().string()] = read_file(it->path());
    }
    return out;
  }
  std::unique_ptr<BackgroundProcess> cli(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {HPCTRIAL_CLI};
    argv.insert(argv.end(), args.begin(), args.end());
    auto p = std::make_unique<BackgroundProcess>(argv, env(),
                                                 (dir_.path() / ("cli-" + std::to_string(++runs_) + ".txt")).string());
    EXPECT_TRUE(p->wait(60s).has_value()) << p->output();
    return p;
  }
  std::string store() const { return (dir_.path() / "store").string(); }
  // A search of async_halving over a range nobody trains with, `trials` trials of at most 200
  // batches, in 2 rungs.
  std::string search_config(const std::string& file, int divisor, int global_batch, int hidden_max, int batch_ms,
                            int trials = 4) {
    return dir_.write(file, "name: searched\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
                            "searcher: {name: async_halving, metric: validation_loss, max_length: {batches: 200}, "
                            "max_trials: " + std::to_string(trials) + ", num_rungs: 2, divisor: " +
                            std::to_string(divisor) + "}\n"
                            "hyperparameters: {global_batch_size: " + std::to_string(global_batch) +
                            ", fail_rank: -1, fail_batch: 0, fail_mode: none, batch_ms: " + std::to_string(batch_ms) +
                            ", hidden: {type: int, minval: 8, maxval: " + std::to_string(hidden_max) + "}}\n"
                            "min_validation_period: {batches: 10}\n"
                            "resources: {slots_per_trial: 2}\nreproducibility: {experiment_seed: 7}\n");
  }
  // A grid of two trials (batch_ms 0 and 1).
  std::string grid_config(const std::string& file, int global_batch, const std::string& extra = "") {
    return dir_.write(file, "name: grid\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
                            "searcher: {name: grid, metric: validation_loss, max_length: {batches: 100000}}\n"
                            "hyperparameters: {global_batch_size: " + std::to_string(global_batch) +
                            ", fail_rank: -1, fail_batch: 0, fail_mode: none, "
                            "batch_ms: {type: categorical, vals: [5, 6]}}\n"
                            "resources: {slots_per_trial: 2}\nreproducibility: {experiment_seed: 7}\n" + extra);
  }
};

// A search's worker runs; a second worker whose search differs (divisor and batch size), and one
// whose only change is a hyperparameter's range, are refused before they write: experiment.yaml
// and every trial's config stay as they were. Run again with its own config, the search goes on
// and ends, its trials promoted from their checkpoints.
TEST_F(ExperimentOwner, AnotherSearchWorkerIsRefusedBeforeItWrites) {
  const std::string x = search_config("x.yaml", 2, 16, 16, 20);
  auto first = start(x);
  wait_for_step(5);
  const auto before = configs();
  ASSERT_FALSE(before.empty());
  for (const auto& [file, differs] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {search_config("y.yaml", 3, 32, 16, 20), {"searcher.divisor: 2 -> 3", "global_batch_size: 16 -> 32"}},
           {search_config("z.yaml", 2, 16, 32, 20), {"maxval: 16 -> 32"}}}) {
    auto second = run(file);
    EXPECT_EQ(second->exit_code(), 2) << second->output();
    for (const auto& d : differs) EXPECT_THAT(second->output(), HasSubstr(d)) << file;
    EXPECT_THAT(second->output(), HasSubstr("is the config of experiment searched"));
    EXPECT_EQ(configs(), before) << file << " changed the running experiment's configs";
  }
  first->signal(SIGINT);
  ASSERT_TRUE(first->wait(120s).has_value());
  EXPECT_EQ(first->exit_code(), 75) << first->output();
  auto again = run(search_config("x0.yaml", 2, 16, 16, 0), "", {}, 300s);
  // batch_ms is part of what the experiment trains: the same value as when it was made.
  EXPECT_EQ(again->exit_code(), 2) << again->output();
  EXPECT_THAT(again->output(), HasSubstr("hyperparameters.batch_ms: 20 -> 0"));
  again = run(x, "", {}, 300s);
  EXPECT_EQ(again->exit_code(), 0) << again->output();
  EXPECT_THAT(again->output(), Not(HasSubstr("other hyperparameters")));
  EXPECT_THAT(again->output(), HasSubstr("has nothing left for this worker"));
  expect_no_rank_left();
}

// Trial 0 of a grid runs from X. `--trial 1` of a config whose batch size differs is refused
// before it writes; `--trial 1` with other run settings (one rank, a shorter length) runs, and
// records them for the experiment. Trial 0's ranks, killed once after that (the chief, then
// another rank), restart with the config trial 0's launcher started with: two ranks, as before.
TEST_F(ExperimentOwner, AnotherTrialsRunLeavesARunningTrialsRestartsAlone) {
  for (const int killed : {0, 1}) {
    SCOPED_TRACE("killed rank " + std::to_string(killed));
    fs::remove_all(experiment());
    const std::string x = grid_config("x.yaml", 16, "max_restarts: 1\n");
    auto first = start(x, "", {"--trial", "0"});
    wait_for_step(20);
    const std::string trial_config = read_file(trial() + "/launcher-config.yaml");
    const auto before = configs();

    auto refused = run(grid_config("y.yaml", 32, "max_restarts: 1\n"), "", {"--trial", "1"});
    EXPECT_EQ(refused->exit_code(), 2) << refused->output();
    EXPECT_THAT(refused->output(), HasSubstr("hyperparameters.global_batch_size: 16 -> 32"));
    EXPECT_EQ(configs(), before);
    EXPECT_FALSE(fs::exists(experiment() + "/trial-1/launcher-state.json"));

    auto other = run(x, "", {"--trial", "1", "--np", "1", "--set", "resources.slots_per_trial=1", "--set",
                             "searcher.max_length.batches=20"});
    ASSERT_EQ(other->exit_code(), 0) << other->output();
    EXPECT_THAT(other->output(), HasSubstr("resources.slots_per_trial is 1 for this run (it was 2)"));
    EXPECT_THAT(read_file(experiment() + "/experiment.yaml"), HasSubstr("slots_per_trial: 1"));
    EXPECT_EQ(read_file(trial() + "/launcher-config.yaml"), trial_config);

    // The rank dies; the restart's ranks read the trial's own config.
    const std::string mine = "HPCTRIAL_EXPERIMENT_DIR=" + experiment();
    std::vector<pid_t> ranks;
    const auto until = std::chrono::steady_clock::now() + 30s;
    for (; std::chrono::steady_clock::now() < until; std::this_thread::sleep_for(50ms)) {
      ranks.clear();
      for (pid_t pid : processes_running(HPCTRIAL_FAULTY_TRIAL, mine)) {
        if (read_file("/proc/" + std::to_string(pid) + "/environ").find("OMPI_COMM_WORLD_RANK=" +
                                                                          std::to_string(killed)) != std::string::npos) {
          ranks.push_back(pid);
        }
      }
      if (!ranks.empty()) break;
    }
    ASSERT_FALSE(ranks.empty()) << "no rank " << killed << " of trial 0 found";
    const long long step = heartbeat(0);
    for (pid_t pid : ranks) ::kill(pid, SIGKILL);
    const auto restarted = std::chrono::steady_clock::now() + 60s;
    while (failures().empty() && std::chrono::steady_clock::now() < restarted) std::this_thread::sleep_for(50ms);
    ASSERT_EQ(failures().size(), 1u) << first->output();
    wait_for_step(step + 5);
    first->signal(SIGINT);
    ASSERT_TRUE(first->wait(120s).has_value());
    EXPECT_EQ(first->exit_code(), 75) << first->output();
    EXPECT_THAT(first->output(), HasSubstr("starting 2 rank(s) of trial 0 in " + trial() + " (start 2)"));
    EXPECT_THAT(read_file(trial() + "/effective-config.yaml"), HasSubstr("slots_per_trial: 2"));
    std::ifstream runs(trial() + "/runs.jsonl");
    int count = 0;
    for (std::string line; std::getline(runs, line); ++count) {
      EXPECT_EQ(nlohmann::json::parse(line).value("ranks", 0), 2) << line;
    }
    EXPECT_EQ(count, 2);
    expect_no_rank_left();
  }
}

// 30 batches into a shared store; then experiment.json lost, emptied, replaced by a list or by
// an object without an id: each refused, naming the file and the repair, with nothing trained
// or written (no metrics, no checkpoint anywhere in the store); `hpctrial experiment repair`
// rebuilds the identity from the checkpoints, and the next run resumes from batch 30.
TEST_F(ExperimentOwner, ALostOrDamagedIdentityIsRefusedAndRepairedFromTheCheckpoints) {
  const auto exp = [&](std::int64_t batches) {
    return config("checkpoint_storage: {host_path: " + store() + "}\nmin_checkpoint_period: {batches: 10}\n", batches);
  };
  ASSERT_EQ(run(exp(30))->exit_code(), 0);
  const std::string record = experiment() + "/experiment.json";
  const auto original = nlohmann::json::parse(read_file(record));
  const std::string id = original.at("experiment_id");
  const fs::path folder = fs::path(store()) / original.at("host_folder").get<std::string>();
  ASSERT_TRUE(fs::exists(folder / "trial-0" / "ckpt-30.h5"));
  const std::string metrics = read_file(trial() + "/metrics.jsonl");
  const auto store_files = [&] {
    std::set<std::string> out;
    for (const auto& e : fs::recursive_directory_iterator(store())) out.insert(e.path().string());
    return out;
  };
  const auto stored = store_files();

  for (const std::string damage : {"(removed)", "", "[]", "{\"jobs\": []}"}) {
    SCOPED_TRACE("experiment.json: " + damage);
    if (damage == "(removed)") {
      fs::remove(record);
    } else {
      std::ofstream(record) << damage;
    }
    auto p = run(exp(60));
    EXPECT_EQ(p->exit_code(), 1) << p->output();
    EXPECT_THAT(p->output(), HasSubstr(record));
    EXPECT_THAT(p->output(), HasSubstr("hpctrial experiment repair " + experiment()));
    EXPECT_THAT(p->output(), Not(HasSubstr("resumed from")));
    EXPECT_EQ(read_file(trial() + "/metrics.jsonl"), metrics) << "a refused run trained";
    EXPECT_EQ(store_files(), stored) << "a refused run wrote into the store";
    EXPECT_FALSE(fs::exists(fs::path(store()) / "trial-0")) << "the shared layout was used";
    // The views refuse alike, rather than show an experiment without its checkpoints.
    auto describe = cli({"describe", experiment()});
    EXPECT_NE(describe->exit_code(), 0) << describe->output();
    EXPECT_THAT(describe->output(), HasSubstr(record));

    auto repaired = cli({"experiment", "repair", experiment()});
    ASSERT_EQ(repaired->exit_code(), 0) << repaired->output();
    EXPECT_THAT(repaired->output(), HasSubstr("records experiment launched (" + id + ")"));
    const auto rebuilt = nlohmann::json::parse(read_file(record));
    EXPECT_EQ(rebuilt.at("experiment_id"), id);
    EXPECT_EQ(rebuilt.at("host_folder"), original.at("host_folder"));
  }
  auto resumed = run(exp(60));
  ASSERT_EQ(resumed->exit_code(), 0) << resumed->output();
  EXPECT_THAT(resumed->output(), HasSubstr("resumed from " + (folder / "trial-0" / "ckpt-30.h5").string()));
  EXPECT_TRUE(fs::exists(folder / "trial-0" / "ckpt-60.h5"));
  auto nothing = cli({"experiment", "repair", experiment()});
  EXPECT_EQ(nothing->exit_code(), 0) << nothing->output();
}

// A search of two trials run to its end, then its log cut short (only the first event of the
// trial that did not reach the top rung left), restored from an older copy (up to the top trial's
// first rung, which it does not hold), or replaced by a folder nothing can read: the worker
// refuses, naming the log and the trial's record or metrics, and appends nothing; the trials'
// metrics stay as they were.
TEST_F(ExperimentOwner, ASearchLogThatDisagreesWithItsTrialsIsRefused) {
  const std::string x = search_config("x.yaml", 2, 16, 16, 0, 2);
  auto done = run(x, "", {}, 300s);
  ASSERT_EQ(done->exit_code(), 0) << done->output();
  const std::string log = experiment() + "/search-events.jsonl";
  std::vector<std::string> lines;
  {
    std::ifstream in(log);
    for (std::string line; std::getline(in, line);) lines.push_back(line + "\n");
  }
  const auto event = [](const std::string& line) { return nlohmann::json::parse(line); };
  int top = -1;
  for (const auto& line : lines) {
    const auto e = event(line);
    if (e.at("event") == "rung" && e.at("rung") == 1) top = e.at("trial");
  }
  ASSERT_GE(top, 0) << "no trial reached the top rung";
  // The trial's training and validation records (a run's timings aside).
  const auto trained = [&] {
    std::ifstream in(experiment() + "/trial-" + std::to_string(top) + "/metrics.jsonl");
    std::string out;
    for (std::string line; std::getline(in, line);) {
      if (line.find("\"kind\":\"timings\"") == std::string::npos) out += line + "\n";
    }
    return out;
  };
  const std::string top_metrics = trained();
  const auto write_log = [&](std::size_t count) {
    std::ofstream out(log, std::ios::trunc);
    for (std::size_t i = 0; i < count; ++i) out << lines[i];
  };

  // Cut short after trial 0's creation: trial 1 is not in it.
  std::size_t first_start = 0;
  while (event(lines[first_start]).value("event", "") != "started") ++first_start;
  write_log(first_start + 1);
  const std::string cut = read_file(log);
  auto p = run(x);
  EXPECT_EQ(p->exit_code(), 1) << p->output();
  EXPECT_THAT(p->output(), HasSubstr("/trial-1/search-trial.json says the search made trial 1 at "));
  EXPECT_THAT(p->output(), HasSubstr("but the search log " + log + " does not know that trial"));
  EXPECT_EQ(read_file(log), cut) << "the worker appended to a log that disagrees with its trials";

  // An older copy: every line before the top trial's first rung; a trial it did not create yet
  // was never made (its directory moved away).
  std::size_t before_rung = 0;
  std::set<int> created;
  for (; before_rung < lines.size(); ++before_rung) {
    const auto e = event(lines[before_rung]);
    if (e.at("event") == "rung" && e.at("trial") == top) break;
    if (e.at("event") == "created") created.insert(e.at("trial").get<int>());
  }
  for (int trial = 0; trial < 2; ++trial) {
    if (created.count(trial) == 0) fs::rename(experiment() + "/trial-" + std::to_string(trial), dir_.path() / "away");
  }
  write_log(before_rung);
  const std::string older = read_file(log);
  p = run(x);
  EXPECT_EQ(p->exit_code(), 1) << p->output();
  EXPECT_THAT(p->output(), HasSubstr("the last validation of trial " + std::to_string(top) + " is at batch 200, but "
                                     "rung 0 of the search log " + log + " ends at batch 100"));
  EXPECT_THAT(read_file(log).substr(0, older.size()), older);
  EXPECT_THAT(read_file(log), Not(HasSubstr("\"event\":\"rung\",\"metric\""))) << "a stale metric was recorded";
  EXPECT_EQ(trained(), top_metrics) << "the trial trained again";

  // A log nothing can read.
  fs::remove(log);
  fs::create_directory(log);
  p = run(x);
  EXPECT_EQ(p->exit_code(), 1) << p->output();
  EXPECT_THAT(p->output(), HasSubstr("the search log " + log + " cannot be read"));
  EXPECT_TRUE(fs::is_empty(log));
  expect_no_rank_left();
}

}  // namespace experiment_owner_test
}  // namespace hpctrial
