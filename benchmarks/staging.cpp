// staging: data.stage's copy to node-local storage against `cp -r` of the same files, in one run
// on one machine.
//
//   staging [--quick] [--dir DIR] [--to DIR] [--mib 1024] [--files 64] [--rounds 3]
//
// --quick: 32 MiB in 8 files, one round - the test suite's smoke run.
// The source is --dir (a shared filesystem at a site), the copies go to --to (node-local storage;
// default: a folder in --dir). Before every timed copy the source's and the last copy's pages are
// dropped from the page cache, so that each copy reads from the device.
//   cp -r      the peer: a plain copy, nothing checked (GNU cp, copy_file_range where it can),
//              then sync: on the device, as staging's copies are before it reads them back
//   stage      data.stage's first run on a node: each file read once from the source with its
//              CRC-32C, written through to the device (fdatasync), read back from the device
//              and compared; the manifest written last
//   reuse      a later run of the trial on the node: the manifest read, and every copied file
//              read again to check its checksum (from the device: the cache is dropped first)
// Goal: cp / stage >= 0.5 (staging reads the copy back from the device, which cp does not);
// reuse / stage is printed beside it.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/staging.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/core/logging.h"
#include "io_util.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Options {
  bool quick = false;
  std::string dir;
  std::string to;
  int mib = 1024;
  int files = 64;
  int rounds = 3;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&] {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "staging: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::string(argv[++i]);
    };
    if (a == "--quick") {
      o.quick = true;
      o.mib = 32;
      o.files = 8;
      o.rounds = 1;
    } else if (a == "--dir") {
      o.dir = value();
    } else if (a == "--to") {
      o.to = value();
    } else if (a == "--mib") {
      o.mib = std::stoi(value());
    } else if (a == "--files") {
      o.files = std::stoi(value());
    } else if (a == "--rounds") {
      o.rounds = std::stoi(value());
    } else {
      std::fprintf(stderr, "usage: staging [--quick] [--dir DIR] [--to DIR] [--mib N] [--files N] [--rounds N]\n");
      std::exit(2);
    }
  }
  if (o.dir.empty()) o.dir = (fs::temp_directory_path() / "hpctrial-bench-staging").string();
  if (o.to.empty()) o.to = (fs::path(o.dir) / "local").string();
  return o;
}

void drop_tree(const fs::path& root) {
  if (!fs::exists(root)) return;
  for (const auto& entry : fs::recursive_directory_iterator(root)) {
    if (entry.is_regular_file()) hpctrial::bench::drop_cache(entry.path().string());
  }
}

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

}  // namespace

int main(int argc, char** argv) {
  using namespace hpctrial;
  const Options o = parse(argc, argv);
  const fs::path source = fs::path(o.dir) / "dataset";
  const fs::path to = o.to;
  fs::remove_all(source);
  fs::remove_all(to);
  fs::create_directories(source);
  fs::create_directories(to);
  // Files of pseudo-random bytes (incompressible), written once.
  const std::size_t bytes_per_file = (static_cast<std::size_t>(o.mib) << 20) / static_cast<std::size_t>(o.files);
  std::vector<char> block(bytes_per_file);
  std::uint64_t state = 88172645463325252ull;
  for (int f = 0; f < o.files; ++f) {
    for (std::size_t i = 0; i + 8 <= block.size(); i += 8) {
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;
      std::memcpy(block.data() + i, &state, 8);
    }
    std::ofstream(source / ("part-" + std::to_string(f) + ".bin"), std::ios::binary).write(block.data(), block.size());
  }
  const double mb = static_cast<double>(bytes_per_file) * o.files / 1e6;

  core::ExperimentConfig config;
  config.data.set("train", core::ConfigNode::scalar(source.string()));
  config.stage.to = core::DataStage::To::kPath;
  config.stage.path = to.string();
  comm::LocalCommunicator world;
  std::vector<double> cp_s, stage_s, reuse_s;
  for (int round = 0; round < o.rounds; ++round) {
    drop_tree(source);
    const fs::path plain = to / "cp";
    auto start = Clock::now();
    const std::string command = "cp -r '" + source.string() + "' '" + plain.string() + "' && sync -f '" + plain.string() + "'";
    if (std::system(command.c_str()) != 0) {
      std::fprintf(stderr, "staging: %s failed\n", command.c_str());
      return 1;
    }
    cp_s.push_back(seconds_since(start));
    fs::remove_all(plain);

    drop_tree(source);
    core::ExperimentConfig staged = config;
    start = Clock::now();
    const std::string folder = trainer::detail::stage_data(staged, world, true, "bench", "node", 0);
    stage_s.push_back(seconds_since(start));

    drop_tree(folder);
    core::ExperimentConfig again = config;
    start = Clock::now();
    trainer::detail::stage_data(again, world, true, "bench", "node", 0);
    reuse_s.push_back(seconds_since(start));
    trainer::detail::remove_staged_data(folder, world, true);
  }
  const double cp = bench::median(cp_s), stage = bench::median(stage_s), reuse = bench::median(reuse_s);
  std::printf("staging %.1f MB in %d files from %s to %s, median of %d round(s)\n", mb, o.files, source.c_str(),
              to.c_str(), o.rounds);
  std::printf("%-8s %9s %9s\n", "", "s", "MB/s");
  std::printf("%-8s %9.3f %9.1f\n", "cp -r", cp, mb / cp);
  std::printf("%-8s %9.3f %9.1f\n", "stage", stage, mb / stage);
  std::printf("%-8s %9.3f %9.1f\n", "reuse", reuse, mb / reuse);
  std::printf("cp / stage: %.3f (goal >= 0.5)\n", cp / stage);
  std::printf("reuse / stage: %.3f\n", reuse / stage);
  fs::remove_all(source);
  fs::remove_all(to);
  return 0;
}
