// Blocks of many rows (prefill) with the rows across the vector lanes: part of
// kernel_impl.h, included there after Vec and the dot-product helpers.
//
// A block's scores are kept transposed, st[t][r] (key t, row r), with rows
// padded to whole vectors. Q is transposed once per item (qt[x][r]), so that
//
//   st[t][r0 .. r0+W) = sum_x k[t][x] * qt[x][r0 .. r0+W)
//
// is one FMA of a broadcast key element and a vector of rows: no horizontal
// sums, which with a head_dim of 64 (4 FMAs a dot product at AVX-512's width)
// cost more than the products. The online softmax then runs down the columns,
// W rows at a time (the running max, sum and rescale factor of W rows are one
// vector each), and P V broadcasts st[t][r] as the row-major path broadcasts
// p[r][t]. vLLM-CPU's vector kernel gets the same shape of product by storing K
// transposed in its paged blocks; vattn's cache keeps K as token rows, and
// here Q (once per item, not K per tile) is what is transposed.
#pragma once

constexpr float kMaxFinite = 3.40282347e38f;

// Register blocks of the transposed product: MT keys x NR vectors of rows.
// 32 vector registers take 4 x 4 (16 accumulators, 4 row vectors, a broadcast),
// 16 registers 4 x 2.
constexpr int kLaneKeys = 4;
constexpr int kLaneVecs = Vec::kRegisters >= 32 ? 4 : 2;

// colmax (null: not kept): each vector of rows' running max over the keys, raised by this block's scores
template <int MT, int NR>
inline void qkt_block(const float* qt, int64_t ldqt, const float* k, int64_t ldk, int d, float* st, int64_t ldst,
                      float* colmax) {
  R acc[MT][NR];
  for (int t = 0; t < MT; ++t)
    for (int c = 0; c < NR; ++c) acc[t][c] = Vec::zero();
  for (int x = 0; x < d; ++x) {
    R qv[NR];
    for (int c = 0; c < NR; ++c) qv[c] = Vec::load(qt + x * ldqt + c * W);
    for (int t = 0; t < MT; ++t) {
      const R kb = Vec::set1(k[t * ldk + x]);
      for (int c = 0; c < NR; ++c) acc[t][c] = Vec::fma(kb, qv[c], acc[t][c]);
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int c = 0; c < NR; ++c) Vec::store(st + t * ldst + c * W, acc[t][c]);
  if (colmax)
    for (int c = 0; c < NR; ++c) {
      R mx = Vec::load(colmax + c * W);
      for (int t = 0; t < MT; ++t) mx = Vec::max(mx, acc[t][c]);
      Vec::store(colmax + c * W, mx);
    }
}

template <int NR>
inline void qkt_keys(const float* qt, int64_t ldqt, const float* k, int64_t ldk, int64_t n, int d, float* st,
                     int64_t ldst, float* colmax) {
  int64_t t = 0;
  for (; t + kLaneKeys <= n; t += kLaneKeys)
    qkt_block<kLaneKeys, NR>(qt, ldqt, k + t * ldk, ldk, d, st + t * ldst, ldst, colmax);
  switch (n - t) {
    case 3: qkt_block<3, NR>(qt, ldqt, k + t * ldk, ldk, d, st + t * ldst, ldst, colmax); break;
    case 2: qkt_block<2, NR>(qt, ldqt, k + t * ldk, ldk, d, st + t * ldst, ldst, colmax); break;
    case 1: qkt_block<1, NR>(qt, ldqt, k + t * ldk, ldk, d, st + t * ldst, ldst, colmax); break;
    default: break;
  }
}

// st[t][r] = k[t] . q[r] for t < n and r < vecs * W (qt: [d][ldqt], rows padded with zeros); colmax (or
// null): vecs * W floats that receive each row's max score over the n keys
inline void qk_lanes(const float* qt, int64_t ldqt, int vecs, const float* k, int64_t ldk, int64_t n, int d,
                     float* st, int64_t ldst, float* colmax = nullptr) {
  if (colmax)
    for (int c = 0; c < vecs; ++c) Vec::store(colmax + c * W, Vec::set1(kNegInf));
  auto at = [&](int vec) { return colmax ? colmax + vec * W : nullptr; };
  int c = 0;
  for (; c + kLaneVecs <= vecs; c += kLaneVecs)
    qkt_keys<kLaneVecs>(qt + c * W, ldqt, k, ldk, n, d, st + c * W, ldst, at(c));
  switch (vecs - c) {
    case 3: qkt_keys<3>(qt + c * W, ldqt, k, ldk, n, d, st + c * W, ldst, at(c)); break;
    case 2: qkt_keys<2>(qt + c * W, ldqt, k, ldk, n, d, st + c * W, ldst, at(c)); break;
    case 1: qkt_keys<1>(qt + c * W, ldqt, k, ldk, n, d, st + c * W, ldst, at(c)); break;
    default: break;
  }
}

#if defined(__AVX512F__)
// dst[c * ldd + r] = src[r * lds + c] for a 16 x 16 block of 32-bit elements (moved as bits)
inline void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto lo = [](__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
  auto hi = [](__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
  for (int g = 0; g < 4; ++g) {  // r[4g + c], 128-bit lane j: column 4j + c of rows 4g .. 4g + 3
    r[4 * g] = lo(t[4 * g], t[4 * g + 2]);
    r[4 * g + 1] = hi(t[4 * g], t[4 * g + 2]);
    r[4 * g + 2] = lo(t[4 * g + 1], t[4 * g + 3]);
    r[4 * g + 3] = hi(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // t[c]: columns c and 8 + c, t[4 + c]: 4 + c and 12 + c (rows 0-7, 8-15 in t[8..])
    t[c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
    t[4 + c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
    t[8 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
  }
  for (int c = 0; c < 4; ++c) {
    _mm512_storeu_ps(dst + c * ldd, _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88));
    _mm512_storeu_ps(dst + (8 + c) * ldd, _mm512_shuffle_f32x4(t[c], t[8 + c], 0xdd));
    _mm512_storeu_ps(dst + (4 + c) * ldd, _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88));
    _mm512_storeu_ps(dst + (12 + c) * ldd, _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xdd));
  }
}
#endif

// qt[x][r] = q[r][x] for r < rows and x < cols (q rows ld apart), 0 from rows up to ldqt: 32-bit
// elements, moved as bits (float, or pairs of bf16)
template <class E>
inline void transpose_rows(const E* q, int64_t ld, int rows, int cols, E* qt, int64_t ldqt) {
  static_assert(sizeof(E) == 4, "32-bit elements");
  int r0 = 0;
#if defined(__AVX512F__)  // whole 16 x 16 blocks with shuffles, about 6 times faster than element by element
  if (cols % 16 == 0)
    for (; r0 + 16 <= rows; r0 += 16)
      for (int x = 0; x < cols; x += 16)
        transpose16(reinterpret_cast<const float*>(q + r0 * ld + x), ld, reinterpret_cast<float*>(qt + x * ldqt + r0),
                    ldqt);
#endif
  for (int x = 0; x < cols; ++x) {
    E* col = qt + x * ldqt;
    for (int r = r0; r < rows; ++r) col[r] = q[static_cast<int64_t>(r) * ld + x];
    for (int64_t r = rows; r < ldqt; ++r) col[r] = E{};
  }
}

// st = softcap * tanh(st / softcap), before the mask (tanh would turn its -inf finite)
inline void softcap_lanes(float* st, int64_t ldst, int64_t n, int vecs, float softcap) {
  const R cap = Vec::set1(softcap), inv = Vec::set1(1.0f / softcap);
  for (int64_t t = 0; t < n; ++t)
    for (int c = 0; c < vecs; ++c) {
      float* at = st + t * ldst + c * W;
      Vec::store(at, Vec::mul(cap, Vec::tanh(Vec::mul(Vec::load(at), inv))));
    }
}

// Whether some of the keys k0 .. k0 + n - 1 are hidden from some of the rows (mask_lanes)
inline bool tile_masked(int64_t n, int64_t k0, int rows, int G, int64_t first_pos, int64_t window) {
  const int64_t last_pos = first_pos + (rows - 1) / G;
  const bool past_first = k0 + n - 1 > first_pos;                  // a key beyond the first row's position
  const bool before_window = window > 0 && k0 <= last_pos - window;  // a key out of the last row's window
  return past_first || before_window;
}

// Hides the keys k0 .. k0 + n - 1 from the rows that may not see them: row r is
// query first_pos + r / G, which sees keys (pos - window, pos] (window 0: [0, pos]).
inline void mask_lanes(float* st, int64_t ldst, int64_t n, int64_t k0, int rows, int G, int64_t first_pos,
                       int64_t window) {
  if (!tile_masked(n, k0, rows, G, first_pos, window)) return;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t key = k0 + t;
    // rows [lo, hi) see the key: pos >= key and (window: pos < key + window)
    const int64_t lo = imin(rows, imax(0, (key - first_pos) * G));
    const int64_t hi = window > 0 ? imin(rows, imax(0, (key + window - first_pos) * G)) : rows;
    float* col = st + t * ldst;
    if (hi <= lo) {
      for (int r = 0; r < rows; ++r) col[r] = kNegInf;
      continue;
    }
    for (int64_t r = 0; r < lo; ++r) col[r] = kNegInf;
    for (int64_t r = hi; r < rows; ++r) col[r] = kNegInf;
  }
}

// The online softmax over one tile, W rows at a time: st[t][r] for t < n (capped and
// masked already) becomes P relative to the new running max; m, l and alpha (vecs * W
// rows each) are updated as softmax_tile updates a row's. A row that has seen
// no key keeps m = -inf, l = 0 (its P is 0: the shift is clamped to a finite
// value); a NaN score makes the row's sum NaN, and m NaN from then on. tile_max
// true: alpha holds each row's max over the tile already (qk_lanes' colmax, of a
// tile that nothing masked or capped after), so the scores are read once.
inline void softmax_lanes(float* st, int64_t ldst, int64_t n, int vecs, float* m, float* l, float* alpha,
                          bool tile_max = false) {
  const R lowest = Vec::set1(-kMaxFinite);
  for (int c = 0; c < vecs; ++c) {
    float* col = st + c * W;
    R mx = Vec::set1(kNegInf);
    if (tile_max)
      mx = Vec::load(alpha + c * W);
    else
      for (int64_t t = 0; t < n; ++t) mx = Vec::max(mx, Vec::load(col + t * ldst));
    const R m_old = Vec::load(m + c * W);
    const R m_new = Vec::max(mx, m_old);      // NaN where m_old is NaN
    const R shift = Vec::max(lowest, m_new);  // -inf (nothing seen yet) -> a finite shift, so P = e^-inf = 0
    R sum = Vec::zero();
    for (int64_t t = 0; t < n; ++t) {
      const R e = Vec::exp(Vec::sub(Vec::load(col + t * ldst), shift));
      Vec::store(col + t * ldst, e);
      sum = Vec::add(sum, e);
    }
    const R a = Vec::exp(Vec::sub(m_old, shift));  // 0 where m_old is -inf
    Vec::store(alpha + c * W, a);
    Vec::store(l + c * W, Vec::fma(Vec::load(l + c * W), a, sum));
    Vec::store(m + c * W, Vec::add(m_new, Vec::sub(sum, sum)));  // sum - sum: 0, or NaN for a NaN sum
  }
}
