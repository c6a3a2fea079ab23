// A plain read of the K and V bytes a decode reads, for benchmarks/decode_bandwidth.py: the read
// bandwidth a decode over the same cache could reach on one thread. Every byte is loaded once, with
// the vector width of the flags this file is compiled with (setup.py's flags of the kernel unit of
// that ISA), and folded by XOR as 32-bit words into independent accumulators: no conversion, no
// floating point, so the loop waits on the loads alone (and the result, the XOR of every word read,
// shows a byte missed or read twice). kv_read loads the rows in address order; kv_read_by_head in the
// order a decode item of the host kernel loads them (tile by tile, each tile's K head by head and then
// its V), with or without requests ahead as the kernel's decode loops make them: how much of the gap
// between the decode and the plain read is the order of the loads rather than the arithmetic.
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "../csrc/cpu_attn/cpu_attn.h"  // key_tile: the decode's tiles, for kv_read_by_head's order
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

// The XOR of every word the accumulators and the tail hold.
inline uint32_t fold(const VecU* acc, uint32_t tail) {
  for (int a = 0; a < kAccs; ++a)
    for (int i = 0; i < kVecBytes / 4; ++i) tail ^= acc[a][i];
  return tail;
}

// Asks for the lines of [p, p + bytes) into L1 (to_l2: into L2, where the kernel's decode requests go
// on cores with an L1 data cache under 48 KiB).
inline void request(const char* p, int64_t bytes, bool to_l2) {
  const char* line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63});
  for (; line < p + bytes; line += 64) {
    if (to_l2)
      __builtin_prefetch(line, 0, 1);
    else
      __builtin_prefetch(line, 0, 3);
  }
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
  return fold(acc, tail);
}

// Tokens per tile of a decode item whose K rows take token_bytes a token, with at most max_bytes of K a
// tile: the kernel's own rule (key_tile, csrc/cpu_attn/cpu_attn.h).
int64_t kv_decode_tile_tokens(int64_t token_bytes, int64_t max_bytes) {
  return vattn::cpu_attn::key_tile(1, token_bytes, max_bytes);
}

// Reads the same rows as kv_read, per head: for each request r < requests, head h < heads of each token
// t < tokens[r] is the head_bytes bytes at t * token_stride_bytes + h * head_stride_bytes from k[r] (and
// v[r]). The order is a host-kernel decode item's over all of a request's heads: tiles of tile_tokens
// tokens; in each, every head's K rows (head 0's tokens in order, then head 1's, ...), then every head's
// V rows. ahead: 0, no requests (the hardware prefetchers alone); 1, half a tile ahead as the kernel's
// 16-bit decode asks (while reading a K row, the V row of the same token and head; while reading a V
// row, the K row of the next tile's token in the same place; the first tile's K rows up front);
// 2, a whole tile ahead as its fp32 decode asks (K rows ask for the next tile's K, V rows for its V; the
// first tile's K and V up front). A request's last tile asks for the next request's first tile in its
// place, as the kernel's last tile asks for its thread's next item. to_l2: the requests go to L2 (the up-
// front ones to L1, as the kernel's). Returns the XOR of every 32-bit word read (head rows of a whole
// number of words), as kv_read does.
int64_t kv_read_by_head(const char* const* k, const char* const* v, const int64_t* tokens, int64_t requests,
                        int64_t token_stride_bytes, int64_t heads, int64_t head_stride_bytes, int64_t head_bytes,
                        int64_t tile_tokens, int ahead, int to_l2) {
  VecU acc[kAccs] = {};
  uint32_t tail = 0;
  const auto row = [&](const char* base, int64_t t, int64_t h) {
    return base + t * token_stride_bytes + h * head_stride_bytes;
  };
  if (ahead != 0 && requests > 0)  // the first request's first tile, up front
    for (int64_t t = 0; t < tokens[0] && t < tile_tokens; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        request(row(k[0], t, h), head_bytes, false);
        if (ahead == 2) request(row(v[0], t, h), head_bytes, false);
      }
  for (int64_t r = 0; r < requests; ++r)
    for (int64_t t0 = 0; t0 < tokens[r]; t0 += tile_tokens) {
      const int64_t n = tokens[r] - t0 < tile_tokens ? tokens[r] - t0 : tile_tokens;
      // where the next tile's rows lie: this request's next tile, or the next request's first
      const bool last = t0 + n >= tokens[r];
      const int64_t next_r = last ? r + 1 : r, next_t0 = last ? 0 : t0 + n;
      const int64_t n_next =
          next_r >= requests ? 0 : (tokens[next_r] - next_t0 < tile_tokens ? tokens[next_r] - next_t0 : tile_tokens);
      for (int side = 0; side < 2; ++side) {  // K, then V
        const char* base = side == 0 ? k[r] : v[r];
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t t = t0; t < t0 + n; ++t) {
            if (ahead == 1 && side == 0)
              request(row(v[r], t, h), head_bytes, to_l2);
            else if (ahead != 0 && t - t0 < n_next)
              request(row(ahead == 1 || side == 0 ? k[next_r] : v[next_r], next_t0 + t - t0, h), head_bytes, to_l2);
            read_range(row(base, t, h), head_bytes, acc, &tail);
          }
      }
    }
  return fold(acc, tail);
}

}  // extern "C"
