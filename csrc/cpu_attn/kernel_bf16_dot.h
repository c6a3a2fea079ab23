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
// and K is read as it is in the cache. P V stays in fp32 by default: P in bf16
// rounds the weights to 8 bits, which a call asks for with Call::p_bf16 (below).
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

// ---- P V with P rounded to bf16 (Call::p_bf16, decode items) ------------------------------
//
// VDPBF16PS over pairs of keys: the V rows of keys t and t+1 interleaved element by element
// (VPUNPCKLWD / VPUNPCKHWD: in each 128-bit lane L, head dims 8L + 0..3 and 8L + 4..7) against the
// pair (p[t], p[t+1]) of bf16 weights broadcast, each fp32 lane adding both products to its
// accumulator: half the multiply-adds of P V in fp32 and no widening of V. The weights lose their
// low 16 bits (round to nearest even), as FlashAttention's P does; the row sums l stay those of the
// fp32 weights. The accumulators hold a 32-dim chunk of a row in the unpacks' order, permuted from
// and back to natural order once per tile.

alignas(64) constexpr int32_t kPairLo[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
alignas(64) constexpr int32_t kPairHi[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
alignas(64) constexpr int32_t kNaturalLo[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
alignas(64) constexpr int32_t kNaturalHi[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};

inline __mmask16 first_lanes(int64_t k) { return k >= 16 ? __mmask16(0xFFFF) : k <= 0 ? __mmask16(0) : __mmask16((1u << k) - 1); }

// p[0..n) fp32 -> the same row's first bytes as bf16, zero-padded to a whole 32: in place, each
// 32-float chunk read before its 64 bytes are written at half its offset
VATTN_BF16_DOT_TARGET inline void p_to_bf16(float* p, int64_t n) {
  for (int64_t t = 0; t < n; t += 32) {
    const __m512 a = _mm512_maskz_loadu_ps(first_lanes(n - t), p + t);
    const __m512 b = _mm512_maskz_loadu_ps(first_lanes(n - t - 16), p + t + 16);
    _mm512_storeu_si512(reinterpret_cast<bf16*>(p) + t, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
  }
}

template <int MR, int NC>
VATTN_BF16_DOT_TARGET inline void pv_dot_block(const uint32_t* pw, int64_t ldpw, const float* alpha, const bf16* v,
                                               int64_t ldv, int64_t n, float* o, int64_t ldo, int64_t pf_off,
                                               int64_t pf_n) {
  const __m512i to_lo = _mm512_load_si512(kPairLo), to_hi = _mm512_load_si512(kPairHi);
  __m512 lo[MR][NC], hi[MR][NC];
  for (int r = 0; r < MR; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < NC; ++c) {
      const __m512 o0 = _mm512_loadu_ps(o + r * ldo + 32 * c), o1 = _mm512_loadu_ps(o + r * ldo + 32 * c + 16);
      lo[r][c] = _mm512_mul_ps(_mm512_permutex2var_ps(o0, to_lo, o1), a);
      hi[r][c] = _mm512_mul_ps(_mm512_permutex2var_ps(o0, to_hi, o1), a);
    }
  }
  for (int64_t t = 0; t < n; t += 2) {
    const bool pair = t + 1 < n;  // the last key of an odd tile goes with a zero row (its pair's weight is 0)
    for (int64_t u = t; u < t + 2 && u < pf_n; ++u)
      for (int c = 0; c < NC; ++c) __builtin_prefetch(v + u * ldv + pf_off + 32 * c, 0, 3);
    __m512i va[NC], vb[NC], ulo[NC], uhi[NC];
    for (int c = 0; c < NC; ++c) va[c] = _mm512_loadu_si512(v + t * ldv + 32 * c);  // each row's lines in order
    for (int c = 0; c < NC; ++c) vb[c] = pair ? _mm512_loadu_si512(v + (t + 1) * ldv + 32 * c) : _mm512_setzero_si512();
    for (int c = 0; c < NC; ++c) {
      ulo[c] = _mm512_unpacklo_epi16(va[c], vb[c]);
      uhi[c] = _mm512_unpackhi_epi16(va[c], vb[c]);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512i pp = _mm512_set1_epi32(static_cast<int>(pw[r * ldpw + t / 2]));
      for (int c = 0; c < NC; ++c) {
        lo[r][c] = _mm512_dpbf16_ps(lo[r][c], reinterpret_cast<__m512bh>(ulo[c]), reinterpret_cast<__m512bh>(pp));
        hi[r][c] = _mm512_dpbf16_ps(hi[r][c], reinterpret_cast<__m512bh>(uhi[c]), reinterpret_cast<__m512bh>(pp));
      }
    }
  }
  const __m512i back_lo = _mm512_load_si512(kNaturalLo), back_hi = _mm512_load_si512(kNaturalHi);
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) {
      _mm512_storeu_ps(o + r * ldo + 32 * c, _mm512_permutex2var_ps(lo[r][c], back_lo, hi[r][c]));
      _mm512_storeu_ps(o + r * ldo + 32 * c + 16, _mm512_permutex2var_ps(lo[r][c], back_hi, hi[r][c]));
    }
}

template <int MR>
VATTN_BF16_DOT_TARGET inline void pv_dot_rows(const uint32_t* pw, int64_t ldpw, const float* alpha, const bf16* v,
                                              int64_t ldv, int64_t n, int d, float* o, int64_t ldo, int64_t pf_off,
                                              int64_t pf_n) {
  int x = 0;  // 64 head dims a pass (4 rows: 16 accumulators), then 32
  for (; x + 64 <= d; x += 64) pv_dot_block<MR, 2>(pw, ldpw, alpha, v + x, ldv, n, o + x, ldo, pf_off, pf_n);
  for (; x < d; x += 32) pv_dot_block<MR, 1>(pw, ldpw, alpha, v + x, ldv, n, o + x, ldo, pf_off, pf_n);
}

// o[r] = alpha[r] o[r] + sum_t bf16(p[r][t]) v[t] for r < rows (p rows ldp floats apart, rewritten as
// bf16), head_dim d a multiple of 32; prefetches keys [0, pf_n) of the tile pf_off elements on, as pv does
VATTN_BF16_DOT_TARGET __attribute__((noinline)) void pv_dot(float* p, int64_t ldp, const float* alpha, int rows,
                                                            const bf16* v, int64_t ldv, int64_t n, int d, float* o,
                                                            int64_t ldo, int64_t pf_off, int64_t pf_n) {
  for (int r = 0; r < rows; ++r) p_to_bf16(p + r * ldp, n);
  const uint32_t* pw = reinterpret_cast<const uint32_t*>(p);  // (p[r][2i], p[r][2i+1]) pairs, ldp words apart
  int r = 0;
  for (; r + 4 <= rows; r += 4, pf_n = 0)
    pv_dot_rows<4>(pw + r * ldp, ldp, alpha + r, v, ldv, n, d, o + r * ldo, ldo, pf_off, pf_n);
  switch (rows - r) {
    case 3: pv_dot_rows<3>(pw + r * ldp, ldp, alpha + r, v, ldv, n, d, o + r * ldo, ldo, pf_off, pf_n); break;
    case 2: pv_dot_rows<2>(pw + r * ldp, ldp, alpha + r, v, ldv, n, d, o + r * ldo, ldo, pf_off, pf_n); break;
    case 1: pv_dot_rows<1>(pw + r * ldp, ldp, alpha + r, v, ldv, n, d, o + r * ldo, ldo, pf_off, pf_n); break;
    default: break;
  }
}
