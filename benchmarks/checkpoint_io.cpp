// checkpoint_io: hpctrial's checkpoint save and load against the physical limit and against
// torch::save / torch::load, in one run on one filesystem.
//
//   checkpoint_io [--dir DIR] [--sizes 256,1024] [--rounds 3]
//
// For each size (MiB of float32 state in 16 MiB tensors):
//   stall       the training thread's share of an async checkpoint: copying the tensors to host
//               buffers (what the loop does before handing them to the writer thread)
//   save        write_checkpoint: HDF5 layout, raw bytes with O_DIRECT, fsync, rename, dir fsync
//   load        read_checkpoint with every dataset's CRC-32C checked (page cache dropped first)
//   dd write    dd if=/dev/zero bs=16M oflag=direct conv=fsync: sequential write, the limit
//   dd read     dd bs=16M iflag=direct: sequential read, the limit
//   torch save  torch::save of the same tensors, then fsync (the same durability)
//   torch load  torch::load (page cache dropped first)
// Rates are MiB/s, medians of the rounds. Goals: save and load >= 0.9 of dd; save >= 3x
// torch::save; stall <= 0.05 of the synchronous save.
#include <fcntl.h>
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/core/subprocess.h"
#include "state_io.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

double seconds_of(const std::function<void()>& body) {
  const auto start = Clock::now();
  body();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Drops the file's pages from the page cache, so that the next read comes from the device.
void drop_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
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

}  // namespace

int main(int argc, char** argv) {
  std::string dir = (fs::current_path() / "checkpoint-io-scratch").string();
  std::vector<int> sizes = {256, 1024};
  int rounds = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string arg = argv[i], value = argv[i + 1];
    if (arg == "--dir") {
      dir = value;
    } else if (arg == "--rounds") {
      rounds = std::stoi(value);
    } else if (arg == "--sizes") {
      sizes.clear();
      std::stringstream list(value);
      for (std::string item; std::getline(list, item, ',');) sizes.push_back(std::stoi(item));
    } else {
      std::fprintf(stderr, "usage: %s [--dir DIR] [--sizes 256,1024] [--rounds N]\n", argv[0]);
      return 2;
    }
  }
  torch::set_num_threads(1);
  fs::create_directories(dir);
  std::printf("checkpoint I/O in %s, median of %d rounds (MiB/s; stall and save in ms)\n", dir.c_str(), rounds);
  std::printf("%-6s %9s %9s %9s %9s %9s %11s %11s %8s %8s %8s %9s\n", "MiB", "stall ms", "save ms", "save", "load",
              "dd write", "torch save", "torch load", "save/dd", "load/dd", "vs torch", "stall/save");
  for (int mib : sizes) {
    const int count = mib / 16;
    std::vector<torch::Tensor> tensors;
    for (int i = 0; i < count; ++i) tensors.push_back(torch::rand({4 * 1024 * 1024}));
    const std::string ours = dir + "/ckpt-1.h5", raw = dir + "/raw.bin", theirs = dir + "/torch.pt";
    std::vector<double> stall, save, load, dd_write, dd_read, torch_save, torch_load;
    for (int round = 0; round < rounds; ++round) {
      hpctrial::checkpoint::Contents contents;
      stall.push_back(seconds_of([&] {
        for (int i = 0; i < count; ++i) {
          hpctrial::trainer::detail::add_tensor(contents, "model/0/t" + std::to_string(i), tensors[static_cast<std::size_t>(i)]);
        }
      }));
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
    const double s_stall = median(stall), s_save = median(save), s_load = median(load);
    const double r_save = m / s_save, r_load = m / s_load, r_ddw = m / median(dd_write), r_ddr = m / median(dd_read);
    const double r_ts = m / median(torch_save), r_tl = m / median(torch_load);
    std::printf("%-6d %9.1f %9.1f %9.0f %9.0f %9.0f %11.0f %11.0f %8.2f %8.2f %8.2f %9.3f\n", mib, s_stall * 1e3,
                s_save * 1e3, r_save, r_load, r_ddw, r_ts, r_tl, r_save / r_ddw, r_load / r_ddr, r_save / r_ts,
                s_stall / s_save);
    std::printf("%-6s %9s %9s %9s %9s %9.0f  (dd read)\n", "", "", "", "", "", r_ddr);
    std::fflush(stdout);
    for (const auto& f : {ours, raw, theirs}) fs::remove(f);
  }
  fs::remove_all(dir);
  return 0;
}
