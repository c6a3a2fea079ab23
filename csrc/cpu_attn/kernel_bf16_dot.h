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

template <int MR, int NT>
VATTN_BF16_DOT_TARGET inline void qk_dot_block(const bf16* q, int64_t ldq, const bf16* k, int64_t ldk, int d,
                                               float scale, float* s, int64_t lds, int64_t pf_off, int64_t pf_n) {
  R acc[MR * NT];
  for (int i = 0; i < MR * NT; ++i) acc[i] = Vec::zero();
  for (int x = 0; x < d; x += 32) {  // 32 bf16 = one 64-byte line of each key row
    for (int t = 0; t < NT && t < pf_n; ++t) __builtin_prefetch(k + t * ldk + x + pf_off, 0, 3);
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

template <int MR>
VATTN_BF16_DOT_TARGET inline void qk_dot_rows(const bf16* q, int64_t ldq, const bf16* k, int64_t ldk, int64_t n,
                                              int d, float scale, float* s, int64_t lds, int64_t pf_off,
                                              int64_t pf_n) {
  constexpr int NT = 16 / MR;  // a full hsum_n tree
  int64_t t = 0;
  for (; t + NT <= n; t += NT)
    qk_dot_block<MR, NT>(q, ldq, k + t * ldk, ldk, d, scale, s + t, lds, pf_off, pf_n - t);
  for (; t < n; ++t) qk_dot_block<MR, 1>(q, ldq, k + t * ldk, ldk, d, scale, s + t, lds, pf_off, pf_n - t);
}

// s[r][t] = scale (q[r] . k[t]) for r < rows, t < n, head_dim d a multiple of 32; prefetches keys
// [0, pf_n) of the tile pf_off elements on, as qk does
VATTN_BF16_DOT_TARGET __attribute__((noinline)) void qk_dot(const bf16* q, int64_t ldq, int rows, const bf16* k,
                                                            int64_t ldk, int64_t n, int d, float scale, float* s,
                                                            int64_t lds, int64_t pf_off, int64_t pf_n) {
  int r = 0;
  for (; r + 4 <= rows; r += 4, pf_n = 0)
    qk_dot_rows<4>(q + r * ldq, ldq, k, ldk, n, d, scale, s + r * lds, lds, pf_off, pf_n);
  switch (rows - r) {
    case 3: qk_dot_rows<3>(q + r * ldq, ldq, k, ldk, n, d, scale, s + r * lds, lds, pf_off, pf_n); break;
    case 2: qk_dot_rows<2>(q + r * ldq, ldq, k, ldk, n, d, scale, s + r * lds, lds, pf_off, pf_n); break;
    case 1: qk_dot_rows<1>(q + r * ldq, ldq, k, ldk, n, d, scale, s + r * lds, lds, pf_off, pf_n); break;
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
