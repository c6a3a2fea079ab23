// AMX tiles in plain C++, with tests/kernels/cpu_attn_wide16.h as the vector: the
// "Vec header" of tests/kernels/cpu_attn_amx_emulated.cpp, which builds the kernel
// with VATTN_AMX_BF16 in place of the scalar unit, so that the AMX unit's
// tile code (packing, tile shapes, padding, the bf16 rounding of Q and P)
// runs against the harness's reference on any CPU.
//
// The emulated instructions follow Intel's definitions (SDM, AMX chapter):
// ldtilecfg reads palette 1 (64 bytes: palette, start row, 14 reserved zero
// bytes, colsb[16] as 16-bit, rows[16]) and zeroes every tile; tileloadd /
// tilestored move `rows` rows of `colsb` bytes, `stride` bytes apart;
// tdpbf16ps C += A B over dword pairs, two round-to-nearest FMAs per pair,
// denormal inputs read as zero and denormal results flushed. Shapes the
// hardware rejects (#UD: rows/colsb mismatches, more than 16 rows or 64
// bytes, no configuration) abort here with a message instead.
#pragma once

#include "cpu_attn_wide16.h"

struct EmulatedTiles {
  unsigned char config[64];
  bool configured = false;
  unsigned char data[8][16][64];
};
thread_local EmulatedTiles emulated_tiles;

[[noreturn]] inline void tile_fault(const char* what) {
  fprintf(stderr, "AMX emulation: %s\n", what);
  abort();
}

inline int tile_rows(int t) { return emulated_tiles.config[48 + t]; }

inline int tile_colsb(int t) {
  uint16_t c;
  memcpy(&c, emulated_tiles.config + 16 + 2 * t, 2);
  return c;
}

inline void check_tile(int t) {
  if (!emulated_tiles.configured) tile_fault("tile instruction without a configuration (ldtilecfg)");
  if (t < 0 || t > 7) tile_fault("tile index out of 0..7");
  if (tile_rows(t) == 0 || tile_colsb(t) == 0) tile_fault("tile used but not configured (rows or colsb 0)");
}

inline void emulated_loadconfig(const void* config) {
  memcpy(emulated_tiles.config, config, 64);
  const unsigned char* c = emulated_tiles.config;
  if (c[0] != 1) tile_fault("palette must be 1");
  for (int i = 2; i < 16; ++i)
    if (c[i] != 0) tile_fault("reserved configuration bytes must be 0");
  for (int t = 0; t < 16; ++t)
    if (tile_rows(t) > 16 || tile_colsb(t) > 64 || tile_colsb(t) % 4 != 0)
      tile_fault("a tile has more than 16 rows or 64 bytes, or colsb not a multiple of 4");
  memset(emulated_tiles.data, 0, sizeof emulated_tiles.data);
  emulated_tiles.configured = true;
}

inline void emulated_release() {
  memset(emulated_tiles.data, 0, sizeof emulated_tiles.data);
  emulated_tiles.configured = false;
}

inline void emulated_zero(int t) {
  check_tile(t);
  memset(emulated_tiles.data[t], 0, sizeof emulated_tiles.data[t]);
}

inline void emulated_loadd(int t, const void* base, int64_t stride) {
  check_tile(t);
  memset(emulated_tiles.data[t], 0, sizeof emulated_tiles.data[t]);
  for (int r = 0; r < tile_rows(t); ++r)
    memcpy(emulated_tiles.data[t][r], static_cast<const char*>(base) + r * stride, tile_colsb(t));
}

inline void emulated_stored(int t, void* base, int64_t stride) {
  check_tile(t);
  for (int r = 0; r < tile_rows(t); ++r)
    memcpy(static_cast<char*>(base) + r * stride, emulated_tiles.data[t][r], tile_colsb(t));
}

inline float bf16_input(const unsigned char* p) {  // denormals read as zero
  uint16_t b;
  memcpy(&b, p, 2);
  const uint32_t u = static_cast<uint32_t>((b & 0x7f80u) == 0 ? b & 0x8000u : b) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline void emulated_dpbf16ps(int c, int a, int b) {
  check_tile(c);
  check_tile(a);
  check_tile(b);
  const int m_rows = tile_rows(c), n_cols = tile_colsb(c) / 4, k_pairs = tile_colsb(a) / 4;
  if (tile_rows(a) != m_rows || tile_rows(b) != k_pairs || tile_colsb(b) != tile_colsb(c))
    tile_fault("tdpbf16ps shapes disagree (A rows = C rows, B rows = A colsb / 4, B colsb = C colsb)");
  // the inputs read once (a product of 16 x 16 tiles reads each element 16 times), the same fmaf sequence
  EmulatedTiles& tiles = emulated_tiles;
  float bt[16][16][2];  // [n][k]: column n of B as pairs
  for (int k = 0; k < k_pairs; ++k)
    for (int n = 0; n < n_cols; ++n)
      for (int i = 0; i < 2; ++i) bt[n][k][i] = bf16_input(tiles.data[b][k] + 4 * n + 2 * i);
  for (int m = 0; m < m_rows; ++m) {
    float at[16][2];
    for (int k = 0; k < k_pairs; ++k)
      for (int i = 0; i < 2; ++i) at[k][i] = bf16_input(tiles.data[a][m] + 4 * k + 2 * i);
    for (int n = 0; n < n_cols; ++n) {
      float acc;
      memcpy(&acc, tiles.data[c][m] + 4 * n, 4);
      for (int k = 0; k < k_pairs; ++k) {
        acc = fmaf(at[k][0], bt[n][k][0], acc);
        acc = fmaf(at[k][1], bt[n][k][1], acc);
      }
      if (fabsf(acc) < 1.17549435e-38f) acc = copysignf(0.0f, acc);  // results flushed to zero
      memcpy(tiles.data[c][m] + 4 * n, &acc, 4);
    }
  }
  vattn_amx_emulated_products += m_rows * n_cols;
}

#define _tile_loadconfig(config) emulated_loadconfig(config)
#define _tile_release() emulated_release()
#define _tile_zero(t) emulated_zero(t)
#define _tile_loadd(t, base, stride) emulated_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emulated_stored(t, base, stride)
#define _tile_dpbf16ps(c, a, b) emulated_dpbf16ps(c, a, b)
