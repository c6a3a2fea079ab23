// A plain read of the K and V bytes a decode reads, for benchmarks/decode_bandwidth.py: the read
// bandwidth a decode over the same cache could reach on one thread. Every byte is loaded once, with
// the vector width of the flags this file is compiled with (setup.py's flags of the kernel unit of
// that ISA), and folded by XOR as 32-bit words into independent accumulators: no conversion, no
// floating point, so the loop waits on the loads alone (and the result, the XOR of every word read,
// shows a byte missed or read twice).
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "probe_vector.h"

namespace {

typedef uint32_t VecU __attribute__((vector_size(kVecBytes)));
constexpr int kAccs = 4;  // independent accumulators, so that consecutive loads do not wait on each other

inline VecU load(const char* p) {
  VecU v;
  std::memcpy(&v, p, kVecBytes);  // one unaligned vector load
  return v;
}

// XORs the `bytes` bytes at p (any length) into acc, as 32-bit words from p on (the last, partial word's
// bytes into tail, each at its place in the word).
inline void read_range(const char* p, int64_t bytes, VecU* acc, uint32_t* tail) {
  int64_t x = 0;
  for (; x + kAccs * kVecBytes <= bytes; x += kAccs * kVecBytes)
    for (int a = 0; a < kAccs; ++a) acc[a] ^= load(p + x + a * kVecBytes);
  for (; x + kVecBytes <= bytes; x += kVecBytes) acc[0] ^= load(p + x);
  for (; x < bytes; ++x) *tail ^= static_cast<uint32_t>(static_cast<unsigned char>(p[x])) << (8 * (x % 4));
}

}  // namespace

extern "C" {

// Bytes per vector load of this build: 64 (AVX-512), 32 (AVX2) or 16 (SSE2).
int kv_read_vector_bytes() { return kVecBytes; }

// Reads, for each request r < requests, tokens [0, tokens[r]) of its K rows (from k[r]) and then of
// its V rows (from v[r]): each token's first row_bytes bytes, tokens token_stride_bytes apart (a run
// of whole tokens, one range, where they are contiguous). Returns the XOR of every 32-bit word read
// (rows of a whole number of words), so that no load is dropped.
int64_t kv_read(const char* const* k, const char* const* v, const int64_t* tokens, int64_t requests,
                int64_t token_stride_bytes, int64_t row_bytes) {
  VecU acc[kAccs] = {};
  uint32_t tail = 0;
  for (int64_t r = 0; r < requests; ++r)
    for (const char* base : {k[r], v[r]}) {
      if (token_stride_bytes == row_bytes) {
        read_range(base, tokens[r] * row_bytes, acc, &tail);
        continue;
      }
      for (int64_t t = 0; t < tokens[r]; ++t) read_range(base + t * token_stride_bytes, row_bytes, acc, &tail);
    }
  uint32_t folded = tail;
  for (int a = 0; a < kAccs; ++a)
    for (int i = 0; i < kVecBytes / 4; ++i) folded ^= acc[a][i];
  return folded;
}

}  // extern "C"
