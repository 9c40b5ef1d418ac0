// CRC-32C (Castagnoli), as iSCSI and ext4 use it: with the SSE4.2 instruction where the CPU has
// it, else a table. The instruction takes 3 cycles and can start every cycle, so one stream of it
// runs at a third of its speed: blocks are split into three lanes checksummed at once, and the
// lanes' CRCs joined with a precomputed "append n zero bytes" operator (about 8 bytes a cycle).
#include <algorithm>
#include <cstring>

#include "hpctrial/checkpoint/format.h"

#if defined(__x86_64__)
#include <emmintrin.h>
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

// The operator that appends `bytes` zero bytes to a CRC register, as its 32 columns.
void zeros_operator(std::uint64_t bytes, std::uint32_t* out) {
  std::uint32_t odd[32], even[32];
  odd[0] = 0x82f63b78u;  // one zero bit
  for (int i = 1; i < 32; ++i) odd[i] = 1u << (i - 1);
  square(even, odd);  // 2 zero bits
  square(odd, even);  // 4 zero bits
  // Identity, then times the operator for 8, 16, 32 ... bits where `bytes` has a one.
  for (int i = 0; i < 32; ++i) out[i] = 1u << i;
  std::uint32_t* power = odd;
  std::uint32_t* next = even;
  while (bytes != 0) {
    square(next, power);  // twice as many zero bits
    std::swap(power, next);
    if (bytes & 1) {
      std::uint32_t product[32];
      for (int i = 0; i < 32; ++i) product[i] = times(power, out[i]);
      std::memcpy(out, product, sizeof product);
    }
    bytes >>= 1;
  }
}

// An operator as four byte tables: shift(crc) is four lookups.
struct Shift {
  std::uint32_t t[4][256];
  explicit Shift(std::uint64_t bytes) {
    std::uint32_t op[32];
    zeros_operator(bytes, op);
    for (int k = 0; k < 4; ++k) {
      for (std::uint32_t v = 0; v < 256; ++v) t[k][v] = times(op, v << (8 * k));
    }
  }
  std::uint32_t operator()(std::uint32_t crc) const {
    return t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^ t[3][crc >> 24];
  }
};

#if defined(__x86_64__)
constexpr std::size_t kLongLane = 4096, kShortLane = 256;

// Three lanes of `lane` bytes at p, p + lane, p + 2 lane, the first continuing `crc`.
__attribute__((target("sse4.2"))) std::uint32_t three_lanes(const unsigned char* p, std::size_t lane,
                                                             std::uint32_t crc, const Shift& shift) {
  std::uint64_t c0 = crc, c1 = 0, c2 = 0;
  for (const unsigned char* end = p + lane; p < end; p += 8) {
    std::uint64_t v0, v1, v2;
    std::memcpy(&v0, p, 8);
    std::memcpy(&v1, p + lane, 8);
    std::memcpy(&v2, p + 2 * lane, 8);
    c0 = _mm_crc32_u64(c0, v0);
    c1 = _mm_crc32_u64(c1, v1);
    c2 = _mm_crc32_u64(c2, v2);
  }
  const std::uint32_t joined = shift(static_cast<std::uint32_t>(c0)) ^ static_cast<std::uint32_t>(c1);
  return shift(joined) ^ static_cast<std::uint32_t>(c2);
}

__attribute__((target("sse4.2"))) std::uint32_t crc_hardware(const unsigned char* p, std::size_t n, std::uint32_t crc) {
  static const Shift long_shift(kLongLane), short_shift(kShortLane);
  for (; n >= 3 * kLongLane; p += 3 * kLongLane, n -= 3 * kLongLane) crc = three_lanes(p, kLongLane, crc, long_shift);
  for (; n >= 3 * kShortLane; p += 3 * kShortLane, n -= 3 * kShortLane) crc = three_lanes(p, kShortLane, crc, short_shift);
  std::uint64_t c = crc;
  for (; n >= 8; p += 8, n -= 8) {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
  }
  auto c32 = static_cast<std::uint32_t>(c);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
#endif

}  // namespace

std::uint32_t crc32c_combine(std::uint32_t first, std::uint32_t second, std::uint64_t second_size) {
  if (second_size == 0) return first;
  std::uint32_t op[32];
  zeros_operator(second_size, op);  // appending second_size zero bytes to `first`
  return times(op, first) ^ second;
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

std::uint32_t copy_crc32c(void* to, const void* from, std::size_t size, std::uint32_t crc) {
  if (size == 0) return crc;  // an empty tensor's data pointer may be null
  auto* out = static_cast<unsigned char*>(to);
  const auto* in = static_cast<const unsigned char*>(from);
  // Pieces small enough to stay in the cache between the copy and the checksum.
  constexpr std::size_t kPiece = std::size_t{64} << 10;
#if defined(__x86_64__)
  // Streaming stores write the destination without first reading it into the cache: the copy
  // moves two bytes over the memory bus for each byte, not three, and leaves the cache to
  // the training threads.
  const std::size_t head = std::min(size, (16 - reinterpret_cast<std::uintptr_t>(out) % 16) % 16);
  std::memcpy(out, in, head);
  crc = crc32c(in, head, crc);
  for (std::size_t at = head; at < size; at += kPiece) {
    const std::size_t n = std::min(kPiece, size - at);
    const std::size_t vectors = n / 16;
    auto* dst = reinterpret_cast<__m128i*>(out + at);
    const auto* src = reinterpret_cast<const __m128i*>(in + at);
    for (std::size_t i = 0; i < vectors; ++i) _mm_stream_si128(dst + i, _mm_loadu_si128(src + i));
    std::memcpy(out + at + vectors * 16, in + at + vectors * 16, n - vectors * 16);
    crc = crc32c(in + at, n, crc);  // the source piece, just read into the cache
  }
  _mm_sfence();  // the streamed stores are visible to other threads before the caller says so
#else
  for (std::size_t at = 0; at < size; at += kPiece) {
    const std::size_t n = std::min(kPiece, size - at);
    std::memcpy(out + at, in + at, n);
    crc = crc32c(in + at, n, crc);
  }
#endif
  return crc;
}

}  // namespace hpctrial::checkpoint
