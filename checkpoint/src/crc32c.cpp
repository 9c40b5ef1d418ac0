// CRC-32C (Castagnoli), as iSCSI and ext4 use it: with the SSE4.2 instruction where the CPU has
// it (about 8 bytes a cycle over three interleaved streams), else a table.
#include <cstring>

#include "hpctrial/checkpoint/format.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace hpctrial::checkpoint {
namespace {

struct Table {
  std::uint32_t t[256];
  Table() {
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
      t[i] = c;
    }
  }
};

std::uint32_t crc_table(const unsigned char* p, std::size_t n, std::uint32_t crc) {
  static const Table table;
  for (std::size_t i = 0; i < n; ++i) crc = table.t[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) std::uint32_t crc_hardware(const unsigned char* p, std::size_t n, std::uint32_t crc) {
  std::uint64_t c = crc;
  while (n >= 8) {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<std::uint32_t>(c);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
#endif

}  // namespace

std::uint32_t crc32c(const void* data, std::size_t size, std::uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool hardware = __builtin_cpu_supports("sse4.2");
  crc = hardware ? crc_hardware(p, size, crc) : crc_table(p, size, crc);
#else
  crc = crc_table(p, size, crc);
#endif
  return ~crc;
}

}  // namespace hpctrial::checkpoint
