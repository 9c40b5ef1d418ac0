// checkpoint_io: hpctrial's checkpoint save and load against the physical limit and against
// torch::save / torch::load, in one run on one filesystem.
//
//   checkpoint_io [--quick] [--dir DIR] [--sizes 256,1024] [--rounds 3] [--threads 1]
//
// --quick: 64 MiB, one round, two checkpoints in the stall runs - the test suite's smoke run.
// Sizes are multiples of 64 MiB.
// --threads: LibTorch's and OpenBLAS's threads for training (default 1, what a rank with
// resources.cpus_per_slot: 1 uses; the cores left over are where the writer runs).
// For each size (MiB of float32 state in 16 MiB tensors):
//   in-loop     what an async checkpoint costs a real training loop, all told: a model of that
//               size (SGD, batch 4) trained by hpctrial with a checkpoint every 20 batches. The
//               cost of a checkpoint is how much longer its cycle of 10 batches took than 10 of
//               the run's quiet batches (the median of those outside every cycle): the training thread's
//               copy of buffers and progress, its wait for the writer's copy of the parameters
//               before the next optimizer step, and the writer's competition for cores, memory
//               and the device while training goes on. The steady cost (the 2nd to 6th
//               checkpoints) is the figure; the first, which also allocates the buffers the
//               writer reuses, is printed below it, with the CPU time a virtual machine's host
//               took in a cycle beyond quiet batches (steal, from /proc/stat).
//   stall       of that, the time the training thread is blocked (copying, then waiting).
//   raw write   the same measure for a run that checkpoints nothing but, where the checkpoints
//               would be, starts a thread that writes as many bytes from a buffer filled before
//               training (O_DIRECT, 16 MiB writes, fsync, as fast as the device takes them): what
//               writing that many bytes at all costs training on this machine and filesystem,
//               without a copy, a CRC or HDF5 (on a virtual machine, mostly the host's CPU for
//               the virtual disk, taken from the guest's cores).
//   save        write_checkpoint: HDF5 layout, raw bytes with O_DIRECT, fsync, rename, dir fsync
//   load        read_checkpoint with every dataset's CRC-32C checked (page cache dropped first)
//   dd write    dd if=/dev/zero bs=16M oflag=direct conv=fsync: sequential write, the limit
//   dd read     dd bs=16M iflag=direct: sequential read, the limit
//   torch save  torch::save of the same tensors, then fsync (the same durability)
//   torch load  torch::load (page cache dropped first)
// With CHECKPOINT_IO_DEBUG set in the environment, the stall run also prints every batch's time.
// Rates are MiB/s, medians of the rounds. Goals: save and load >= 0.9 of dd; save >= 3x
// torch::save; in-loop cost <= 0.05 of the synchronous save.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <hpctrial/trainer.h>

#include "hpctrial/checkpoint/format.h"
#include "big_trial.h"
#include "io_util.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/comm/communicator.h"
#include "state/state_io.h"

namespace {

using hpctrial::bench::drop_cache;
using hpctrial::bench::median;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

double seconds_of(const std::function<void()>& body) {
  const auto start = Clock::now();
  body();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void fsync_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

void run_or_die(const std::vector<std::string>& argv) {
  const auto r = hpctrial::core::run_process(argv);
  if (!r.ok()) {
    std::fprintf(stderr, "%s\n%s\n", r.describe().c_str(), r.err.c_str());
    std::exit(1);
  }
}

// CPU time the host has taken from this virtual machine's cores, all cores together (the
// steal column of /proc/stat; 0 on real hardware).
double steal_seconds() {
  std::ifstream stat("/proc/stat");
  std::string cpu;
  double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  stat >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
  return stat ? steal / static_cast<double>(::sysconf(_SC_CLK_TCK)) : 0.0;
}

struct BatchStart {
  Clock::time_point at;
  double steal_s;
};

// A checkpoint after batches 20, 40, ..., 120 (--quick: 20, 40); a cycle is the 10 intervals from
// the one it is taken in (long enough for the writer to finish: a sync save takes 6-8 batches'
// time at 256 MiB and 1 GiB), and the 10 intervals after a cycle, and those before the first
// checkpoint, are quiet.
constexpr int kEvery = 20, kCycle = 10;
int g_checkpoints = 6;  // the first, whose cycle allocates, and the steady ones after it
int batches() { return g_checkpoints * kEvery + kCycle; }

// Writes `mib` MiB from one buffer, filled once, to a file of its own on a thread, each time it
// is started: only the bytes of a checkpoint, without its copy, CRC or layout.
class BackgroundWriter {
 public:
  BackgroundWriter(std::string path, int mib) : path_(std::move(path)), bytes_(static_cast<std::size_t>(mib) << 20) {
    buffer_.reset(static_cast<char*>(std::aligned_alloc(4096, bytes_)));
    if (!buffer_) throw std::bad_alloc();
    std::memset(buffer_.get(), 1, bytes_);
  }
  ~BackgroundWriter() {
    if (thread_.joinable()) thread_.join();
    std::remove(path_.c_str());
  }
  BackgroundWriter(const BackgroundWriter&) = delete;
  BackgroundWriter& operator=(const BackgroundWriter&) = delete;
  void start() {
    if (thread_.joinable()) thread_.join();
    thread_ = std::thread([this] {
      const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0600);
      if (fd < 0) {
        std::fprintf(stderr, "checkpoint_io: cannot open %s for O_DIRECT writes: %s (pass --dir on a writable "
                     "filesystem that supports O_DIRECT)\n", path_.c_str(), std::strerror(errno));
        std::exit(1);
      }
      constexpr std::size_t kPiece = std::size_t{16} << 20;
      for (std::size_t done = 0; done < bytes_;) {
        const ssize_t n = ::write(fd, buffer_.get() + done, std::min(kPiece, bytes_ - done));
        if (n <= 0) {
          std::fprintf(stderr, "checkpoint_io: writing %s: %s (is its filesystem full?)\n", path_.c_str(),
                       std::strerror(errno));
          std::exit(1);
        }
        done += static_cast<std::size_t>(n);
      }
      ::fsync(fd);
      ::close(fd);
    });
  }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::string path_;
  std::size_t bytes_;
  std::unique_ptr<char, Free> buffer_;
  std::thread thread_;
};

struct Stall {
  double blocked_s;  // the training thread blocked: copying buffers and progress, then waiting for the writer's copy
  double in_loop_s;  // a checkpoint's cycle of batches beyond the same batches without checkpoints
  double steal_s;    // the host's steal in that cycle beyond the same batches without checkpoints
  double first_s;    // the first checkpoint's cycle, which also allocates the writer's buffers
};

struct Intervals {
  std::vector<double> seconds;  // seconds[i]: from the start of batch i to the start of batch i + 1
  std::vector<double> steal_s;  // the host's steal in the same interval
};

// The intervals between batch starts of one stall run, and its phase timings. With `raw`, the
// run checkpoints nothing and starts `raw` where the checkpoints would be.
Intervals stall_run(const std::string& dir, int mib, nlohmann::json* timings, BackgroundWriter* raw = nullptr) {
  const std::string period = raw != nullptr ? "100000" : std::to_string(kEvery);
  const std::string yaml = "name: stall\nentrypoint: ./x\nsearcher: {name: single, metric: validation_loss, "
                           "max_length: {batches: " + std::to_string(batches()) + "}}\nhyperparameters: "
                           "{global_batch_size: 4}\nmin_checkpoint_period: {batches: " + period + "}\n";
  hpctrial::core::Diagnostics diagnostics;
  const auto root = hpctrial::core::parse_config_text(yaml, "stall.yaml", diagnostics);
  const auto config = hpctrial::core::parse_experiment_config(root, diagnostics);
  if (!diagnostics.empty()) throw hpctrial::ConfigError(diagnostics.to_string());
  std::vector<BatchStart> starts;
  hpctrial::comm::LocalCommunicator comm;
  hpctrial::trainer::LoopOptions options;
  options.trial_dir = dir + "/stall-run";
  options.progress_interval_s = 0;
  fs::remove_all(options.trial_dir);  // a used one would resume its finished trial
  const auto result = hpctrial::trainer::run_training(config, [&](hpctrial::TrialContext& context) {
    // Records when each batch starts; with `raw`, starts it where hpctrial would checkpoint.
    return std::unique_ptr<hpctrial::Trial>(std::make_unique<hpctrial_bench::BigTrial>(
        context, mib / 64, [&starts](std::int64_t) { starts.push_back({Clock::now(), steal_seconds()}); },
        [raw](std::int64_t batch_idx) {
          if (raw != nullptr && (batch_idx + 1) % kEvery == 0 && batch_idx + 1 <= g_checkpoints * kEvery) raw->start();
        }));
  }, comm, options);
  fs::remove_all(options.trial_dir);
  if (starts.size() != static_cast<std::size_t>(batches())) {
    std::fprintf(stderr, "checkpoint_io: the stall run trained %zu batches, not %d\n", starts.size(), batches());
    std::exit(1);
  }
  Intervals interval;
  for (std::size_t i = 0; i + 1 < starts.size(); ++i) {
    interval.seconds.push_back(std::chrono::duration<double>(starts[i + 1].at - starts[i].at).count());
    interval.steal_s.push_back(starts[i + 1].steal_s - starts[i].steal_s);
  }
  if (std::getenv("CHECKPOINT_IO_DEBUG") != nullptr) {
    std::fprintf(stderr, "intervals: ");
    for (std::size_t i = 0; i < interval.seconds.size(); ++i) {
      std::fprintf(stderr, "%.1f (%.0f) ", interval.seconds[i] * 1e3, interval.steal_s[i] * 1e3);
    }
    std::fprintf(stderr, "(ms per batch, and the host's steal in it)\n");
  }
  *timings = result.timings;
  return interval;
}

// What each async checkpoint cost training, per checkpoint. The base is the same run's quiet
// intervals, next in time to the checkpoints (separate runs of the same model differ by more
// than a checkpoint costs: memory placement, the host's load).
Stall cost_of_cycles(const Intervals& run) {
  std::vector<double> quiet;
  double quiet_steal = 0;
  for (int i = 1; i + 1 < batches(); ++i) {  // the first interval warms up
    const int since = (i + 1) % kEvery;      // intervals since the last checkpoint's was taken
    if ((i < kEvery - 1 || since >= kCycle) && i < g_checkpoints * kEvery - 1) {
      quiet.push_back(run.seconds[static_cast<std::size_t>(i)]);
      quiet_steal += run.steal_s[static_cast<std::size_t>(i)];
    }
  }
  quiet_steal /= static_cast<double>(quiet.size());
  const double base = median(quiet);
  // A checkpoint after batch k is taken in interval k - 1 (capture, then the writer starts); its
  // cycle is k - 1 ... k + kCycle - 2. The first also allocates the buffers the writer copies into, which
  // later ones reuse: the steady cost is the mean of the cycles of the second to the last.
  const auto cycle = [&](const std::vector<double>& values, int k) {
    double sum = 0;
    for (int i = k - 1; i < k - 1 + kCycle; ++i) sum += values[static_cast<std::size_t>(i)];
    return sum;
  };
  double steady = 0, steal = 0;
  for (int c = 2; c <= g_checkpoints; ++c) {
    steady += cycle(run.seconds, c * kEvery) / (g_checkpoints - 1);
    steal += cycle(run.steal_s, c * kEvery) / (g_checkpoints - 1);
  }
  steady -= kCycle * base;
  steal -= kCycle * quiet_steal;
  const double first = cycle(run.seconds, kEvery) - kCycle * base;
  return {0, steady, steal, first};
}

Stall training_stall(const std::string& dir, int mib) {
  nlohmann::json t;
  Stall stall = cost_of_cycles(stall_run(dir, mib, &t));
  const double copies = t.at("checkpoint").at("count").get<double>();
  const double blocked = t.at("checkpoint").at("total_s").get<double>() +
                         (t.contains("checkpoint_copy_wait") ? t.at("checkpoint_copy_wait").at("total_s").get<double>() : 0.0);
  stall.blocked_s = blocked / copies;
  return stall;
}

// The in-loop cost of writing the bytes alone (see "raw write" above).
double raw_write_cost(const std::string& dir, int mib) {
  BackgroundWriter writer(dir + "/raw-write.bin", mib);
  nlohmann::json t;
  const auto run = stall_run(dir, mib, &t, &writer);
  return cost_of_cycles(run).in_loop_s;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = (fs::current_path() / "checkpoint-io-scratch").string();
  std::vector<int> sizes = {256, 1024};
  int rounds = 3;
  int threads = 1;
  for (int i = 1; i < argc; i += 2) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      sizes = {64};
      rounds = 1;
      g_checkpoints = 2;
      --i;
      continue;
    }
    const std::string value = i + 1 < argc ? argv[i + 1] : "";
    if (value.empty()) {
      std::fprintf(stderr, "checkpoint_io: %s needs a value\n", arg.c_str());
      return 2;
    }
    if (arg == "--dir") {
      dir = value;
    } else if (arg == "--rounds") {
      rounds = std::stoi(value);
    } else if (arg == "--threads") {
      threads = std::stoi(value);
    } else if (arg == "--sizes") {
      sizes.clear();
      std::stringstream list(value);
      for (std::string item; std::getline(list, item, ',');) sizes.push_back(std::stoi(item));
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--dir DIR] [--sizes 256,1024] [--rounds N] [--threads N]\n", argv[0]);
      return 2;
    }
  }
  for (int mib : sizes) {
    if (mib < 64 || mib % 64 != 0) {
      std::fprintf(stderr, "checkpoint_io: --sizes takes multiples of 64 MiB (the stall run's layers are 64 MiB)\n");
      return 2;
    }
  }
  torch::set_num_threads(threads);
  hpctrial::bench::set_openblas_threads(threads);
  fs::create_directories(dir);
  std::printf("checkpoint I/O in %s, median of %d rounds, training on %d thread(s) (MiB/s; in-loop, stall and save "
              "in ms)\n", dir.c_str(), rounds, threads);
  std::printf("%-6s %9s %9s %9s %9s %9s %9s %11s %11s %8s %8s %8s %9s %9s\n", "MiB", "in-loop", "stall", "save ms",
              "save", "load", "dd write", "torch save", "torch load", "save/dd", "load/dd", "vs torch", "loop/save",
              "stall/save");
  double worst_save_dd = 1e9, worst_load_dd = 1e9, worst_vs_torch = 1e9, worst_stall = 0, worst_in_loop = -1e9;
  double worst_raw = -1e9;
  for (int mib : sizes) {
    const int count = mib / 16;
    std::vector<torch::Tensor> tensors;
    for (int i = 0; i < count; ++i) tensors.push_back(torch::rand({4 * 1024 * 1024}));
    const std::string ours = dir + "/ckpt-1.h5", raw = dir + "/raw.bin", theirs = dir + "/torch.pt";
    std::vector<double> stall, in_loop, steal, first, raw_costs, save, load, dd_write, dd_read, torch_save, torch_load;
    for (int round = 0; round < rounds; ++round) {
      hpctrial::checkpoint::Contents contents;
      for (int i = 0; i < count; ++i) {
        hpctrial::trainer::detail::add_tensor(contents, "model/0/t" + std::to_string(i), tensors[static_cast<std::size_t>(i)]);
      }
      const Stall measured = training_stall(dir, mib);
      stall.push_back(measured.blocked_s);
      in_loop.push_back(measured.in_loop_s);
      steal.push_back(measured.steal_s);
      first.push_back(measured.first_s);
      raw_costs.push_back(raw_write_cost(dir, mib));
      save.push_back(seconds_of([&] { hpctrial::checkpoint::write_checkpoint(ours, contents); }));
      drop_cache(ours);
      load.push_back(seconds_of([&] { hpctrial::checkpoint::read_checkpoint(ours); }));
      dd_write.push_back(seconds_of([&] {
        run_or_die({"dd", "if=/dev/zero", "of=" + raw, "bs=16M", "count=" + std::to_string(count), "oflag=direct",
                    "conv=fsync", "status=none"});
      }));
      drop_cache(raw);
      dd_read.push_back(seconds_of([&] {
        run_or_die({"dd", "if=" + raw, "of=/dev/null", "bs=16M", "iflag=direct", "status=none"});
      }));
      torch_save.push_back(seconds_of([&] {
        torch::save(tensors, theirs);
        fsync_file(theirs);
      }));
      drop_cache(theirs);
      torch_load.push_back(seconds_of([&] {
        std::vector<torch::Tensor> back;
        torch::load(back, theirs);
      }));
    }
    const double m = mib;
    const double s_stall = median(stall), s_in_loop = median(in_loop), s_save = median(save), s_load = median(load);
    const double r_save = m / s_save, r_load = m / s_load, r_ddw = m / median(dd_write), r_ddr = m / median(dd_read);
    const double r_ts = m / median(torch_save), r_tl = m / median(torch_load);
    std::printf("%-6d %9.1f %9.1f %9.1f %9.0f %9.0f %9.0f %11.0f %11.0f %8.2f %8.2f %8.2f %9.3f %9.3f\n", mib,
                s_in_loop * 1e3, s_stall * 1e3, s_save * 1e3, r_save, r_load, r_ddw, r_ts, r_tl, r_save / r_ddw,
                r_load / r_ddr, r_save / r_ts, s_in_loop / s_save, s_stall / s_save);
    std::printf("%-6s %9.1f %9s %9s %9s %9s %9.0f  (first checkpoint's in-loop cost, buffers allocated; dd read); "
                "host steal in a cycle beyond quiet batches: %.0f ms\n", "", median(first) * 1e3, "", "",
                "", "", r_ddr, median(steal) * 1e3);
    std::printf("%-6s %9.1f  (raw write: the in-loop cost of writing the same bytes alone; raw/save %.3f, "
                "in-loop/raw %.2f)\n", "", median(raw_costs) * 1e3, median(raw_costs) / s_save, s_in_loop / median(raw_costs));
    std::fflush(stdout);
    for (const auto& f : {ours, raw, theirs}) fs::remove(f);
    worst_save_dd = std::min(worst_save_dd, r_save / r_ddw);
    worst_load_dd = std::min(worst_load_dd, r_load / r_ddr);
    worst_vs_torch = std::min(worst_vs_torch, r_save / r_ts);
    worst_stall = std::max(worst_stall, s_stall / s_save);
    worst_in_loop = std::max(worst_in_loop, s_in_loop / s_save);
    worst_raw = std::max(worst_raw, median(raw_costs) / s_save);
  }
  fs::remove_all(dir);
  std::printf("worst ratios: save/dd %.2f, load/dd %.2f (goals >= 0.9), save vs torch::save %.2f (goal >= 3), "
              "in-loop/save %.3f (goal <= 0.05), of which stall/save %.3f; raw write/save %.3f\n", worst_save_dd,
              worst_load_dd, worst_vs_torch, worst_in_loop, worst_stall, worst_raw);
  for (double r : {worst_save_dd, worst_load_dd, worst_vs_torch}) {
    if (!std::isfinite(r) || r <= 0) {
      std::fprintf(stderr, "checkpoint_io: a side measured no rate\n");
      return 1;
    }
  }
  return 0;
}
