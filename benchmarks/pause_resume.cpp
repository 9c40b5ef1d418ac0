// pause_resume: how long `hpctrial pause` and `hpctrial activate` take on a real Slurm, next to
// the checkpoint write alone, for each size of trial state.
//
//   pause_resume [--quick] [--dir DIR] [--sizes 100,1024] [--rounds 3] [--ranks 2]
//
// --quick: 4 MiB, one round, one rank - the test suite's smoke run. One rank, because on a
// 2-core machine two ranks bound to both cores can starve every process outside the job (the
// `hpctrial pause` being measured, scontrol, slurmctld) for over a minute: see docs/user-guide.md.
// Needs a running Slurm cluster that SLURM_CONF (or the default configuration) names, such as
// the test tier's: `scripts/local-slurm.sh start`, then
// `SLURM_CONF=/tmp/hpctrial-slurm/slurm.conf build/benchmarks/pause_resume`. DIR (default
// ./pause-resume-scratch) must be on a filesystem the job's node sees: the experiment and the
// write-alone checkpoints go there.
//
// For each size (MiB of float32 trial state, benchmarks/pause_resume_trial.cpp), one experiment
// is submitted with `hpctrial submit`; once it trains, it is paused and activated `rounds` times:
//   write     checkpoint::write_checkpoint of the same state in the same directory (HDF5, O_DIRECT,
//             fsync, rename): the checkpoint write alone, median of `rounds` writes
//   pause     from starting `hpctrial pause JOB` to the job PENDING and held, with `latest` naming
//             the new checkpoint (verified afterwards: every dataset's CRC, the state's size)
//   activate  from starting `hpctrial activate JOB` to the end of the first resumed step (the
//             trial prints its wall-clock time); Slurm's scheduling of the released job counts.
//             Slurm makes a requeued job eligible to start only some seconds after its requeue
//             (EligibleTime: cred_expire + 1 s, 11 s on the test cluster): activate is run
//             once that has passed, as a user resuming later would; the hold-off is printed apart
//   the split of activate: until Slurm starts the job, and from then to the first step (the
//   launcher, mpirun, the ranks' start and the checkpoint read)
// Figures are medians over the rounds. Goal: pause <= write + 5 s.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/layout.h"
#include "hpctrial/core/subprocess.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

long long unix_ms_now() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "pause_resume: %s\n", message.c_str());
  std::exit(1);
}

hpctrial::core::RunResult run(const std::vector<std::string>& argv) {
  hpctrial::core::RunOptions options;
  options.timeout = 120s;
  return hpctrial::core::run_process(argv, options);
}

std::string run_or_die(const std::vector<std::string>& argv) {
  const auto r = run(argv);
  if (!r.ok()) die(r.describe() + "\n" + r.out + r.err);
  return r.out;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// One field of `scontrol -o show job JOB` ("" when the job or the field is not there).
std::string job_field(const std::string& job, const std::string& field) {
  const auto r = run({"scontrol", "-o", "show", "job", job});
  const std::size_t at = r.out.find(" " + field + "=");
  if (at == std::string::npos) return "";
  const std::size_t start = at + field.size() + 2;
  return r.out.substr(start, r.out.find(' ', start) - start);
}

template <typename Condition>
bool poll(Condition condition, std::chrono::seconds limit, std::chrono::milliseconds every = 50ms) {
  const auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(every);
  }
  return false;
}

// The wall-clock times (unix ms) at which the runs' first steps ended, in the job's output.
std::vector<long long> first_steps(const std::string& out_file) {
  static const std::regex line(R"(first step of this run: batch \d+ ended at (\d+))");
  const std::string text = read_file(out_file);
  std::vector<long long> times;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), line); it != std::sregex_iterator(); ++it) {
    times.push_back(std::stoll((*it)[1]));
  }
  return times;
}

struct Figures {
  std::vector<double> write, pause, activate, queued, started, hold_off;
};

// Slurm's local time stamp (2026-11-22T17:05:07), or 0.
std::time_t parse_slurm_time(const std::string& text) {
  std::tm tm{};
  if (::strptime(text.c_str(), "%Y-%m-%dT%H:%M:%S", &tm) == nullptr) return 0;
  tm.tm_isdst = -1;
  return std::mktime(&tm);
}

// write_checkpoint of `mib` MiB of float32 in 4 MiB datasets, as the trial's model holds it.
double write_alone(const std::string& dir, int mib) {
  hpctrial::checkpoint::Contents contents;
  const std::size_t chunk = std::size_t{4} << 20;
  for (int i = 0; i < mib / 4; ++i) {
    auto bytes = std::make_shared<hpctrial::checkpoint::Buffer>(chunk);
    auto* p = static_cast<std::uint8_t*>(bytes->data());
    for (std::size_t b = 0; b < chunk; ++b) p[b] = static_cast<std::uint8_t>(b * 7 + static_cast<std::size_t>(i));
    contents.add("model/chunk" + std::to_string(i), hpctrial::checkpoint::DType::kFloat32,
                 {static_cast<std::int64_t>(chunk / 4)}, bytes);
  }
  const std::string path = dir + "/ckpt-1.h5";
  const auto start = Clock::now();
  hpctrial::checkpoint::write_checkpoint(path, contents);
  const double seconds = since(start);
  fs::remove(path);
  return seconds;
}

Figures measure(const std::string& dir, int mib, int rounds, int ranks) {
  Figures f;
  for (int round = 0; round < rounds; ++round) f.write.push_back(write_alone(dir, mib));

  const std::string experiment = dir + "/exp-" + std::to_string(mib);
  fs::remove_all(experiment);
  const std::string config = dir + "/pause-resume-" + std::to_string(mib) + ".yaml";
  std::ofstream(config) << "name: pause-resume-" << mib << "\nentrypoint: " << HPCTRIAL_PAUSE_RESUME_TRIAL << "\n"
                        << "searcher: {name: single, metric: validation_loss, max_length: {batches: 100000000}}\n"
                        << "hyperparameters: {global_batch_size: " << 8 * ranks << ", state_mib: " << mib << "}\n"
                        << "resources: {slots_per_trial: " << ranks << ", slots_per_node: " << ranks << "}\n"
                        << "min_checkpoint_period: {batches: 100000000}\n"
                        << "scheduler: {type: slurm, time_limit: 2h, preemption_grace: 5m}\n";
  const std::string out = run_or_die({HPCTRIAL_CLI, "submit", config, "--experiment", experiment});
  std::smatch m;
  if (!std::regex_search(out, m, std::regex(R"(submitted slurm job (\d+))"))) die("no job id in: " + out);
  const std::string job = m[1];
  const std::string out_file = experiment + "/slurm-" + job + ".out";
  const hpctrial::checkpoint::CheckpointStore store(experiment + "/trial-0/checkpoints", {});

  for (int round = 0; round < rounds; ++round) {
    const std::size_t runs = static_cast<std::size_t>(round) + 1;
    if (!poll([&] { return first_steps(out_file).size() >= runs; }, 600s, 200ms)) {
      die("run " + std::to_string(runs) + " of job " + job + " never trained; see " + experiment);
    }
    std::this_thread::sleep_for(2s);  // mid-training, some steps in
    const auto before = store.latest_file();

    const auto pause_start = Clock::now();
    run_or_die({HPCTRIAL_CLI, "pause", job});
    const bool held = poll([&] {
      return job_field(job, "JobState") == "PENDING" && job_field(job, "Reason") == "job_requeued_in_held_state" &&
             store.latest_file() != before;
    }, 600s);
    if (!held) die("job " + job + " was not held with a new checkpoint; state " + job_field(job, "JobState"));
    f.pause.push_back(since(pause_start));
    // Durable and whole: every dataset's CRC, and the state all there.
    const auto latest = store.latest_file();
    const auto contents = hpctrial::checkpoint::read_checkpoint(store.dir() + "/" + *latest);
    std::size_t bytes = 0;
    for (const auto& d : contents.datasets) bytes += d.nbytes();
    if (bytes < static_cast<std::size_t>(mib) << 20) die(*latest + " holds " + std::to_string(bytes) + " bytes");

    // Slurm makes a requeued job eligible only some seconds after the requeue (11 s here);
    // a user resumes later than that, so activate waits for it and the wait is printed apart.
    const std::time_t eligible = parse_slurm_time(job_field(job, "EligibleTime"));
    const std::time_t requeued = parse_slurm_time(job_field(job, "SubmitTime"));
    if (eligible > 0 && requeued > 0) f.hold_off.push_back(static_cast<double>(eligible - requeued));
    while (eligible > 0 && std::time(nullptr) <= eligible) std::this_thread::sleep_for(100ms);

    const long long activate_ms = unix_ms_now();
    const auto activate_start = Clock::now();
    run_or_die({HPCTRIAL_CLI, "activate", job});
    std::optional<double> running;
    if (!poll([&] {
          if (!running && job_field(job, "JobState") == "RUNNING") running = since(activate_start);
          return first_steps(out_file).size() >= runs + 1;
        }, 600s)) {
      die("job " + job + " did not resume; see " + experiment);
    }
    const double first = static_cast<double>(first_steps(out_file).back() - activate_ms) / 1e3;
    f.activate.push_back(first);
    f.queued.push_back(running.value_or(first));
    f.started.push_back(first - running.value_or(first));
  }
  run_or_die({HPCTRIAL_CLI, "kill", job});
  // Ended, not just cancelled: Slurm reports CANCELLED (COMPLETING) while the SIGTERMed ranks
  // still write and rename their last checkpoint, so the experiment is removed only once the
  // job's state is final and the trial's launcher, which outlives its ranks, let go of its lock.
  const std::string lock_path = hpctrial::core::TrialLayout{experiment + "/trial-0"}.launcher_lock();
  const bool ended = poll([&] {
    const auto s = job_field(job, "JobState");  // empty once Slurm forgot the job
    if (s == "RUNNING" || s == "PENDING" || s == "COMPLETING" || s == "SIGNALING") return false;
    hpctrial::core::UniqueFd fd(::open(lock_path.c_str(), O_RDWR | O_CLOEXEC));
    return fd.get() < 0 || hpctrial::core::lock_file_exclusive(fd.get(), lock_path, hpctrial::core::LockWait::kTry);
  }, 120s, 200ms);
  if (!ended) die("job " + job + " did not end within 120 s of `hpctrial kill`; see " + experiment);
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = (fs::current_path() / "pause-resume-scratch").string();
  std::vector<int> sizes = {100, 1024};
  int rounds = 3, ranks = 2;
  for (int i = 1; i < argc; i += 2) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      sizes = {4};
      rounds = 1;
      ranks = 1;
      --i;
      continue;
    }
    if (i + 1 >= argc) die(arg + " needs a value");
    const std::string value = argv[i + 1];
    if (arg == "--dir") {
      dir = value;
    } else if (arg == "--rounds") {
      rounds = std::stoi(value);
    } else if (arg == "--ranks") {
      ranks = std::stoi(value);
    } else if (arg == "--sizes") {
      sizes.clear();
      std::stringstream list(value);
      for (std::string item; std::getline(list, item, ',');) sizes.push_back(std::stoi(item));
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--dir DIR] [--sizes 100,1024] [--rounds N] [--ranks N]\n", argv[0]);
      return 2;
    }
  }
  const auto ping = run({"scontrol", "ping"});
  if (!ping.ok() || ping.out.find("is UP") == std::string::npos) {
    die("no Slurm cluster answers (" + ping.describe() + "); start one with `scripts/local-slurm.sh start` and "
        "set SLURM_CONF");
  }
  if (::geteuid() == 0) {  // the local cluster runs jobs as their submitter; mpirun refuses root otherwise
    ::setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    ::setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  }
  fs::create_directories(dir);
  dir = fs::canonical(dir).string();
  std::printf("pause and activate on Slurm, %d ranks, experiments in %s; medians of %d rounds (seconds)\n", ranks,
              dir.c_str(), rounds);
  std::printf("%-6s %8s %8s %9s %11s %11s %14s\n", "MiB", "write", "pause", "activate", "(queued", "started)",
              "pause/(write+5)");
  double worst = 0;
  for (int mib : sizes) {
    if (mib < 4 || mib % 4 != 0) die("--sizes takes multiples of 4 MiB");
    const Figures f = measure(dir, mib, rounds, ranks);
    const double write = median(f.write), pause = median(f.pause);
    worst = std::max(worst, pause / (write + 5.0));
    std::printf("%-6d %8.2f %8.2f %9.2f %11.2f %11.2f %14.2f\n", mib, write, pause, median(f.activate),
                median(f.queued), median(f.started), pause / (write + 5.0));
    std::printf("%-6s Slurm made the requeued job eligible %.0f s after its requeue; activate was run after that\n",
                "", median(f.hold_off));
    std::fflush(stdout);
    fs::remove_all(dir + "/exp-" + std::to_string(mib));
  }
  std::printf("worst ratio pause / (write + 5 s): %.2f (goal <= 1)\n", worst);
  return worst > 0 ? 0 : 1;
}
