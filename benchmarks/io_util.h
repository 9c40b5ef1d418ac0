// What the benchmarks share: medians, reading from the device rather than the cache, and the
// number of OpenBLAS threads.
#pragma once

#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

namespace hpctrial::bench {

// "1,2,4" as numbers: a benchmark's --world-sizes.
inline std::vector<int> parse_int_list(const std::string& text) {
  std::vector<int> out;
  std::stringstream list(text);
  for (std::string item; std::getline(list, item, ',');) out.push_back(std::stoi(item));
  return out;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Drops the file's pages from the page cache, so that the next read comes from the device.
inline void drop_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// OpenBLAS keeps a thread pool of its own, which torch::set_num_threads does not size: a
// benchmark sets it the way hpctrial sets it for a rank (resources.cpus_per_slot).
inline void set_openblas_threads(int threads) {
  using SetThreads = void (*)(int);
  if (auto set = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) set(threads);
}

}  // namespace hpctrial::bench
