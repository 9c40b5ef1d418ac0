// SHA-256 (FIPS 180-4), for content-addressed copies: the code an experiment runs is known by the
// digest of its bytes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace hpctrial::core {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, std::size_t size);
  void update(std::string_view text) { update(text.data(), text.size()); }
  // The digest as 64 lowercase hex digits; the object is spent.
  std::string hex();

 private:
  void block(const unsigned char* p);
  std::uint32_t h_[8];
  unsigned char buffer_[64];
  std::size_t used_ = 0;
  std::uint64_t bytes_ = 0;
};

// The SHA-256 of a file's bytes, hex; IoError naming the path when it cannot be read.
std::string file_sha256(const std::string& path);

}  // namespace hpctrial::core
