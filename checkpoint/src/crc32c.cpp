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

// Multiplication in GF(2) by a 32x32 matrix given as its columns (zlib's crc32_combine method).
std::uint32_t times(const std::uint32_t* matrix, std::uint32_t vector) {
  std::uint32_t sum = 0;
  for (int i = 0; vector != 0; ++i, vector >>= 1) {
    if (vector & 1) sum ^= matrix[i];
  }
  return sum;
}

void square(std::uint32_t* out, const std::uint32_t* matrix) {
  for (int i = 0; i < 32; ++i) out[i] = times(matrix, matrix[i]);
}

}  // namespace

std::uint32_t crc32c_combine(std::uint32_t first, std::uint32_t second, std::uint64_t second_size) {
  if (second_size == 0) return first;
  // The operator that appends one zero bit to the CRC register, squared to append 2, 4, 8 ... bits.
  std::uint32_t odd[32], even[32];
  odd[0] = 0x82f63b78u;
  for (int i = 1; i < 32; ++i) odd[i] = 1u << (i - 1);
  square(even, odd);  // 2 zero bits
  square(odd, even);  // 4 zero bits
  // Appending second_size zero bytes to `first`, one power of two at a time.
  do {
    square(even, odd);
    if (second_size & 1) first = times(even, first);
    second_size >>= 1;
    if (second_size == 0) break;
    square(odd, even);
    if (second_size & 1) first = times(odd, first);
    second_size >>= 1;
  } while (second_size != 0);
  return first ^ second;
}

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
