// sharded_checkpoint: a ZeRO checkpoint written by every rank (each its own parts of the
// optimizer state) against the same state gathered and written by the chief, and against dd with
// O_DIRECT, the device's sequential limit, in one run on one filesystem.
//
//   mpirun -np N sharded_checkpoint [--quick] [--dir DIR] [--mib 256] [--rounds 3]
//
// --quick: 64 MiB, one round - the test suite's smoke run. The state is Adam's two moments of a
// model of MiB/8 MiB of float32 parameters at ZeRO stage 2, each rank holding 1/N of it.
//   sharded save   write_sharded_checkpoint: every rank writes its pieces, the chief the rest
//   gathered save  save_whole (an all-gather of every state field) and the chief's write_checkpoint
//   load           read_checkpoint on the chief, every CRC checked (page cache dropped first)
//   dd write/read  dd bs=16M oflag=direct conv=fsync / iflag=direct of the same bytes
// Rates are MiB/s of optimizer state, medians of the rounds. Goals: sharded save and load >= 0.8
// of dd.
#include <fcntl.h>
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "hpctrial/checkpoint/format.h"
#include "io_util.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/mpi_environment.h"
#include "hpctrial/core/subprocess.h"
#include "state/sharded_checkpoint.h"
#include "parallel/zero.h"

namespace {

using hpctrial::bench::drop_cache;
using hpctrial::bench::median;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;
using namespace hpctrial;

bool run_quietly(const std::vector<std::string>& argv) {
  const auto r = core::run_process(argv);
  if (!r.ok()) std::fprintf(stderr, "%s\n%s\n", r.describe().c_str(), r.err.c_str());
  return r.ok();
}

// Seconds of `body` on the slowest rank: it starts together and ends when the last rank ends.
double collective_seconds(comm::Communicator& comm, const std::function<void()>& body) {
  comm.barrier();
  const auto start = Clock::now();
  body();
  comm.barrier();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  comm::MpiEnvironment mpi(&argc, &argv);
  comm::MpiCommunicator comm(mpi.world());
  const bool chief = comm.rank() == 0;
  std::string dir = (fs::temp_directory_path() / "hpctrial-sharded-checkpoint").string();
  int mib = 256, rounds = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      mib = 64;
      rounds = 1;
    } else if (i + 1 < argc && arg == "--dir") {
      dir = argv[++i];
    } else if (i + 1 < argc && arg == "--mib") {
      mib = std::stoi(argv[++i]);
    } else if (i + 1 < argc && arg == "--rounds") {
      rounds = std::stoi(argv[++i]);
    } else {
      if (chief) std::fprintf(stderr, "usage: %s [--quick] [--dir DIR] [--mib 256] [--rounds N]\n", argv[0]);
      return 2;
    }
  }
  if (mib < 16 || mib % 16 != 0) {
    if (chief) std::fprintf(stderr, "sharded_checkpoint: --mib takes multiples of 16\n");
    return 2;
  }
  torch::set_num_threads(1);
  if (chief) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  comm.barrier();

  // Adam's two moments over MiB/8 MiB of parameters in 16 tensors: MiB of state in all.
  const std::int64_t elements = std::int64_t{mib} * 1024 * 1024 / 8 / 16;
  std::vector<torch::Tensor> parameters;
  torch::manual_seed(1);
  for (int i = 0; i < 16; ++i) parameters.push_back(torch::randn({elements}).requires_grad_());
  torch::optim::Adam adam(parameters, torch::optim::AdamOptions(1e-3));
  trainer::detail::ZeroOptions options;
  options.stage = 2;
  options.bucket_elements = elements * 4;  // four buckets
  trainer::detail::ShardedOptimizer zero(adam, comm, options);
  for (auto& p : parameters) p.mutable_grad() = torch::ones_like(p);
  zero.step();  // the moments now exist, 1/N on each rank

  std::unique_ptr<checkpoint::CheckpointStore> store;
  if (chief) store = std::make_unique<checkpoint::CheckpointStore>(dir, checkpoint::StoreOptions{});
  std::vector<double> sharded, gathered, load, dd_write, dd_read;
  const std::string raw = dir + "/raw.bin";
  for (int round = 0; round < rounds; ++round) {
    std::string path;
    sharded.push_back(collective_seconds(comm, [&] {
      trainer::detail::ShardedSave mine;
      zero.save_shards(mine, "optimizer/0");
      checkpoint::Contents contents = mine.whole;
      contents.attributes[checkpoint::kBatchesAttribute] = std::to_string(2 * round + 1);
      path = trainer::detail::write_sharded_checkpoint(comm, store.get(), contents, mine,
                                                       store ? store->write_options() : checkpoint::WriteOptions{});
    }));
    if (chief) {
      drop_cache(path);
      const auto start = Clock::now();
      checkpoint::read_checkpoint(path);
      load.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
    gathered.push_back(collective_seconds(comm, [&] {
      checkpoint::Contents whole;
      zero.save_whole(whole, "optimizer/0");
      whole.attributes[checkpoint::kBatchesAttribute] = std::to_string(2 * round + 2);
      if (chief) store->publish(whole);
    }));
    if (chief) {
      const auto start = Clock::now();
      if (!run_quietly({"dd", "if=/dev/zero", "of=" + raw, "bs=16M", "count=" + std::to_string(mib / 16), "oflag=direct",
                        "conv=fsync", "status=none"})) {
        std::_Exit(1);  // the other ranks are taken down by mpirun
      }
      dd_write.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      drop_cache(raw);
      const auto read_start = Clock::now();
      if (!run_quietly({"dd", "if=" + raw, "of=/dev/null", "bs=16M", "iflag=direct", "status=none"})) std::_Exit(1);
      dd_read.push_back(std::chrono::duration<double>(Clock::now() - read_start).count());
    }
  }
  comm.barrier();
  if (!chief) return 0;
  const double m = mib;
  const double r_sharded = m / median(sharded), r_gathered = m / median(gathered), r_load = m / median(load);
  const double r_ddw = m / median(dd_write), r_ddr = m / median(dd_read);
  std::printf("sharded checkpoint of %d MiB of Adam state on %d ranks in %s, median of %d rounds (MiB/s)\n", mib,
              comm.size(), dir.c_str(), rounds);
  std::printf("%-14s %-14s %-8s %-9s %-8s\n", "sharded save", "gathered save", "load", "dd write", "dd read");
  std::printf("%-14.0f %-14.0f %-8.0f %-9.0f %-8.0f\n", r_sharded, r_gathered, r_load, r_ddw, r_ddr);
  std::printf("sharded save / dd write: %.2f (goal >= 0.8)\n", r_sharded / r_ddw);
  std::printf("load / dd read: %.2f (goal >= 0.8)\n", r_load / r_ddr);
  std::printf("sharded save / gathered save: %.2f\n", r_sharded / r_gathered);
  fs::remove_all(dir);
  for (double r : {r_sharded, r_gathered, r_load, r_ddw, r_ddr}) {
    if (!std::isfinite(r) || r <= 0) {
      std::fprintf(stderr, "sharded_checkpoint: a side measured no rate\n");
      return 1;
    }
  }
  return 0;
}
