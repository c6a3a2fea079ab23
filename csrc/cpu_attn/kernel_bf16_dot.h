// Q K^T of bf16 queries over a bf16 cache by VDPBF16PS (AVX512_BF16): part of
// kernel_impl.h in the AVX-512 unit (its avx512_bf16 table) and the AMX unit,
// whose build flags (AVX-512F) do not include the instruction, so these
// functions carry the target themselves; attention.cpp picks those tables
// only where the CPU reports avx512bf16.
//
// One VDPBF16PS multiplies 32 bf16 pairs into 16 fp32 lanes: a bf16 product
// is exact in fp32 and each lane adds its two products to the accumulator in
// fp32, as two FMAs would. So the queries go in unscaled, as they are in q,
// and the scale multiplies the sums: the scores are those of the fp32 path up
// to the order of the additions. The instruction reads denormal inputs as
// zero and flushes denormal results (a product below 1e-38 next to scores of
// order 1). It halves the multiply-adds of Q K^T against widening K to fp32,
// and K is read as it is in the cache. P V stays in fp32: P in bf16 would
// round the weights to 8 bits.
#pragma once

#define VATTN_BF16_DOT_TARGET __attribute__((target("avx512bf16,avx512bw")))

template <int MR, int NT, bool kToL2>
VATTN_BF16_DOT_TARGET inline void qk_dot_block(const bf16* q, int64_t ldq, const bf16* k, int64_t ldk, int d,
                                               float scale, float* s, int64_t lds, int64_t pf_bytes, int64_t pf_n) {
  R acc[MR * NT];
  for (int i = 0; i < MR * NT; ++i) acc[i] = Vec::zero();
  for (int x = 0; x < d; x += 32) {  // 32 bf16 = one 64-byte line of each key row
    for (int t = 0; t < NT && t < pf_n; ++t) prefetch_line<kToL2>(bytes_on(k + t * ldk + x, pf_bytes));
    __m512i kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = _mm512_loadu_si512(k + t * ldk + x);
    for (int r = 0; r < MR; ++r) {
      __m512i qv = _mm512_loadu_si512(q + r * ldq + x);
      asm("" : "+v"(qv));  // as Vec::keep: one load of each query vector, not one per product
      for (int t = 0; t < NT; ++t)
        acc[r * NT + t] = _mm512_dpbf16_ps(acc[r * NT + t], reinterpret_cast<__m512bh>(qv),
                                           reinterpret_cast<__m512bh>(kv[t]));
    }
  }
  float sums[MR * NT];
  Vec::hsum_n(acc, MR * NT, sums);
  for (int r = 0; r < MR; ++r)
    for (int t = 0; t < NT; ++t) s[r * lds + t] = sums[r * NT + t] * scale;
}

// out[j] = scale x (sum of accumulator j / 2's lanes 8 (j % 2) .. 8 (j % 2) + 7) for j < 32: the 32
// sums of 16 accumulators that each hold two keys' partial sums in their 256-bit halves. (Always
// inlined, every index written out, as Vec::hsum_n: a loop here left the accumulators in a stack array.)
VATTN_BF16_DOT_TARGET __attribute__((always_inline)) inline void pair_sums(const R* a, float scale, float* out) {
  // 16 -> 8: each 128-bit lane of c[j] holds four partials of sum 4 j + lane
  const R c0 = Vec::pair_quarters(a[0], a[1]), c1 = Vec::pair_quarters(a[2], a[3]),
          c2 = Vec::pair_quarters(a[4], a[5]), c3 = Vec::pair_quarters(a[6], a[7]),
          c4 = Vec::pair_quarters(a[8], a[9]), c5 = Vec::pair_quarters(a[10], a[11]),
          c6 = Vec::pair_quarters(a[12], a[13]), c7 = Vec::pair_quarters(a[14], a[15]);
  // 8 -> 2: sums 0-15 from c0-c3, 16-31 from c4-c7
  const R sc = Vec::set1(scale);
  _mm512_storeu_ps(out, Vec::mul(Vec::quarter_sums(c0, c1, c2, c3), sc));
  _mm512_storeu_ps(out + 16, Vec::mul(Vec::quarter_sums(c4, c5, c6, c7), sc));
}

// Two keys per accumulator: lanes 0-7 sum key 2p's products, lanes 8-15 key 2p + 1's, each over
// 16 of head_dim's elements per VDPBF16PS (the query's half-line broadcast to both halves). The
// instructions are the same number as one key per accumulator, but the reduction tree ends a level
// early and yields 32 sums from 16 accumulators, in two vectors stored a row at a time: with
// head_dim 64 a key takes two VDPBF16PS per query row, and reducing 16 sums took as many
// instructions as the products (qk_dot_block). MR x NP = 16 accumulators; 2 NP keys.
// (Always inlined into its key loop: out of line, every 8 keys paid a call that zeroed the 16
// accumulators and spilled pointers, about a tenth of Q K^T's time; docs/kernels.md.)
template <int MR, int NP, bool kToL2>
VATTN_BF16_DOT_TARGET __attribute__((always_inline)) inline void qk_dot_pairs_block(
    const bf16* q, int64_t ldq, const bf16* k, int64_t ldk, int d, float scale, float* s, int64_t lds, int64_t pf_bytes,
    int64_t pf_n) {
  static_assert(MR * NP == 16, "one full reduction tree");
  R acc[MR * NP];
  for (int i = 0; i < MR * NP; ++i) acc[i] = Vec::zero();
  for (int x = 0; x < d; x += 32) {  // a 64-byte line of each key row
    for (int t = 0; t < 2 * NP && t < pf_n; ++t) prefetch_line<kToL2>(bytes_on(k + t * ldk + x, pf_bytes));
    __m512i qlo[MR], qhi[MR];  // q[r][x, x + 16) and q[r][x + 16, x + 32), in both halves
    for (int r = 0; r < MR; ++r) {
      qlo[r] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * ldq + x)));
      qhi[r] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * ldq + x + 16)));
    }
    for (int p = 0; p < NP; ++p) {
      const __m512i a = _mm512_loadu_si512(k + (2 * p) * ldk + x), b = _mm512_loadu_si512(k + (2 * p + 1) * ldk + x);
      const __m512i lo = _mm512_shuffle_i64x2(a, b, 0x44);  // [a[x, x + 16), b[x, x + 16)]
      const __m512i hi = _mm512_shuffle_i64x2(a, b, 0xee);  // [a[x + 16, x + 32), b[x + 16, x + 32)]
      for (int r = 0; r < MR; ++r) {
        acc[r * NP + p] = _mm512_dpbf16_ps(acc[r * NP + p], reinterpret_cast<__m512bh>(qlo[r]),
                                           reinterpret_cast<__m512bh>(lo));
        acc[r * NP + p] = _mm512_dpbf16_ps(acc[r * NP + p], reinterpret_cast<__m512bh>(qhi[r]),
                                           reinterpret_cast<__m512bh>(hi));
      }
    }
  }
  float sums[32];
  pair_sums(acc, scale, sums);
  for (int r = 0; r < MR; ++r)
    for (int t = 0; t < 2 * NP; t += 8) _mm256_storeu_ps(s + r * lds + t, _mm256_loadu_ps(sums + r * 2 * NP + t));
}

template <int MR, bool kToL2>
VATTN_BF16_DOT_TARGET inline void qk_dot_rows(const bf16* q, int64_t ldq, const bf16* k, int64_t ldk, int64_t n,
                                              int d, float scale, float* s, int64_t lds, int64_t pf_bytes,
                                              int64_t pf_n) {
  constexpr int NT = 16 / MR;  // a full hsum_n tree
  int64_t t = 0;
  // head_dim 64 only: over 128 (4 lines a key row) the reduction weighs less, and Llama-3-8B's heads
  // (8 kv of 128) ran 0.90-0.92x as fast with pairs at B=8 ctx 2048 and B=16 ctx 1024 (docs/kernels.md)
  if constexpr (16 % MR == 0) {
    if (d == 64)
      for (; t + 32 / MR <= n; t += 32 / MR)
        qk_dot_pairs_block<MR, 16 / MR, kToL2>(q, ldq, k + t * ldk, ldk, d, scale, s + t, lds, pf_bytes, pf_n - t);
  }
  for (; t + NT <= n; t += NT)
    qk_dot_block<MR, NT, kToL2>(q, ldq, k + t * ldk, ldk, d, scale, s + t, lds, pf_bytes, pf_n - t);
  for (; t < n; ++t) qk_dot_block<MR, 1, kToL2>(q, ldq, k + t * ldk, ldk, d, scale, s + t, lds, pf_bytes, pf_n - t);
}

// s[r][t] = scale (q[r] . k[t]) for r < rows, t < n, head_dim d a multiple of 32; prefetches, for keys
// [0, pf_n), the row pf_bytes bytes on, as qk does
template <bool kToL2>
VATTN_BF16_DOT_TARGET __attribute__((noinline)) void qk_dot(const bf16* q, int64_t ldq, int rows, const bf16* k,
                                                            int64_t ldk, int64_t n, int d, float scale, float* s,
                                                            int64_t lds, int64_t pf_bytes, int64_t pf_n) {
  int r = 0;
  for (; r + 4 <= rows; r += 4, pf_n = 0)
    qk_dot_rows<4, kToL2>(q + r * ldq, ldq, k, ldk, n, d, scale, s + r * lds, lds, pf_bytes, pf_n);
  switch (rows - r) {
    case 3: qk_dot_rows<3, kToL2>(q + r * ldq, ldq, k, ldk, n, d, scale, s + r * lds, lds, pf_bytes, pf_n); break;
    case 2: qk_dot_rows<2, kToL2>(q + r * ldq, ldq, k, ldk, n, d, scale, s + r * lds, lds, pf_bytes, pf_n); break;
    case 1: qk_dot_rows<1, kToL2>(q + r * ldq, ldq, k, ldk, n, d, scale, s + r * lds, lds, pf_bytes, pf_n); break;
    default: break;
  }
}

// ---- rows in the lanes (kernel_lanes.h) -------------------------------------------------
//
// The transposed product st[t][r] = scale sum_x k[t][x] q[r][x] takes x in pairs: a dword of K,
// (k[t][2i], k[t][2i+1]), broadcast from the cache row as it is (no widening of K), against 16
// rows' dwords (q[r][2i], q[r][2i+1]) of the pair-transposed queries qt2[i][r].

// qt2[i][r] = (q[r][2i], q[r][2i+1]) for r < rows, 0 up to ldqt; q rows d apart, d even: each row
// is d / 2 dwords, transposed as 32-bit elements
inline void pair_transpose(const bf16* q, int rows, int d, uint32_t* qt2, int64_t ldqt) {
  transpose_rows(reinterpret_cast<const uint32_t*>(q), d / 2, rows, d / 2, qt2, ldqt);
}

template <int MT, int NR>
VATTN_BF16_DOT_TARGET inline void qkt_dot_block(const uint32_t* qt2, int64_t ldqt, const bf16* k, int64_t ldk, int d,
                                                float scale, float* st, int64_t ldst) {
  R acc[MT][NR];
  for (int t = 0; t < MT; ++t)
    for (int c = 0; c < NR; ++c) acc[t][c] = Vec::zero();
  for (int i = 0; i < d / 2; ++i) {
    __m512i qv[NR];
    for (int c = 0; c < NR; ++c) qv[c] = _mm512_loadu_si512(qt2 + i * ldqt + c * W);
    for (int t = 0; t < MT; ++t) {
      uint32_t pair;
      __builtin_memcpy(&pair, k + t * ldk + 2 * i, sizeof pair);
      const __m512i kb = _mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < NR; ++c)
        acc[t][c] = _mm512_dpbf16_ps(acc[t][c], reinterpret_cast<__m512bh>(kb), reinterpret_cast<__m512bh>(qv[c]));
    }
  }
  const R s = Vec::set1(scale);
  for (int t = 0; t < MT; ++t)
    for (int c = 0; c < NR; ++c) Vec::store(st + t * ldst + c * W, Vec::mul(acc[t][c], s));
}

template <int NR>
VATTN_BF16_DOT_TARGET inline void qkt_dot_keys(const uint32_t* qt2, int64_t ldqt, const bf16* k, int64_t ldk, int64_t n,
                                               int d, float scale, float* st, int64_t ldst) {
  int64_t t = 0;
  for (; t + kLaneKeys <= n; t += kLaneKeys)
    qkt_dot_block<kLaneKeys, NR>(qt2, ldqt, k + t * ldk, ldk, d, scale, st + t * ldst, ldst);
  switch (n - t) {
    case 3: qkt_dot_block<3, NR>(qt2, ldqt, k + t * ldk, ldk, d, scale, st + t * ldst, ldst); break;
    case 2: qkt_dot_block<2, NR>(qt2, ldqt, k + t * ldk, ldk, d, scale, st + t * ldst, ldst); break;
    case 1: qkt_dot_block<1, NR>(qt2, ldqt, k + t * ldk, ldk, d, scale, st + t * ldst, ldst); break;
    default: break;
  }
}

// st[t][r] = scale (k[t] . q[r]) for t < n and r < vecs * W, k rows of the cache ldk apart
VATTN_BF16_DOT_TARGET __attribute__((noinline)) void qk_lanes_dot(const uint32_t* qt2, int64_t ldqt, int vecs,
                                                                  const bf16* k, int64_t ldk, int64_t n, int d,
                                                                  float scale, float* st, int64_t ldst) {
  int c = 0;
  for (; c + kLaneVecs <= vecs; c += kLaneVecs)
    qkt_dot_keys<kLaneVecs>(qt2 + c * W, ldqt, k, ldk, n, d, scale, st + c * W, ldst);
  switch (vecs - c) {
    case 3: qkt_dot_keys<3>(qt2 + c * W, ldqt, k, ldk, n, d, scale, st + c * W, ldst); break;
    case 2: qkt_dot_keys<2>(qt2 + c * W, ldqt, k, ldk, n, d, scale, st + c * W, ldst); break;
    case 1: qkt_dot_keys<1>(qt2 + c * W, ldqt, k, ldk, n, d, scale, st + c * W, ldst); break;
    default: break;
  }
}
