// The whole content of a file, byte for byte, as a string ("" when it is missing or unreadable).
#pragma once

#include <fstream>
#include <iterator>
#include <string>

namespace hpctrial::testing_support {

// "" for a file that is not there (yet): tests poll with it and compare against it.
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace hpctrial::testing_support
