// 16 floats per vector: AVX-512F. Included inside the AVX-512 unit's
// anonymous namespace, after <immintrin.h>.
#pragma once

struct Vec {
  static constexpr int W = 16;
  static constexpr int kRegisters = 32;  // vector registers the ISA has (register blocking)
  using R = __m512;

  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static R load(const bf16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static R load(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  // The 2 W bf16 at p as two fp32 vectors: even = p[0], p[2], .. and odd = p[1], p[3], ... Each dword
  // holds a pair, so a shift and a mask widen a whole line with no shuffle (load(bf16) widens W by a
  // zero-extending shuffle and a shift).
  static constexpr bool kBf16Pairs = true;
  static void load_bf16_pairs(const bf16* p, R& even, R& odd) {
    const __m512i x = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  // the element of a 2 W chunk at position i of [even | odd]
  static constexpr int pair_element(int i) { return i < W ? 2 * i : 2 * (i - W) + 1; }
  static void store(float* p, R x) { _mm512_storeu_ps(p, x); }
  static void store(bf16* p, R x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void store(f16* p, R x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  // Pins v to a register here, so that the compiler does not fold its reloads into every
  // FMA that uses it (one load per FMA would bound the loop by loads, not FMAs).
  static void keep(R& v) { asm("" : "+v"(v)); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(R a) { return _mm512_reduce_add_ps(a); }
  static float hmax(R a) { return _mm512_reduce_max_ps(a); }
  // out[i] = hsum(a[i]) for i < n <= 16, all at once with one transposing add tree (about 3
  // instructions a sum where _mm512_reduce_add_ps takes 8: with head_dim 64 a dot product is only
  // 4 FMAs, and reducing one at a time cost more than the FMAs)
  __attribute__((always_inline)) static void hsum_n(const R* a, int n, float* out) {
    if (n < 4) {
      for (int i = 0; i < n; ++i) out[i] = hsum(a[i]);
      return;
    }
    // (always inlined, every index written out: n is then a constant and the accumulators stay in
    // registers; a loop here left them in a stack array)
    auto at = [&](int i) { return i < n ? a[i] : zero(); };
    // 16 -> 8: pair (2k, 2k+1) as [a.q0 + a.q2, a.q1 + a.q3, b.q0 + b.q2, b.q1 + b.q3] (128-bit lanes)
    auto halves = [](R x, R y) { return add(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xee)); };
    const R c0 = halves(at(0), at(1)), c1 = halves(at(2), at(3)), c2 = halves(at(4), at(5)),
            c3 = halves(at(6), at(7)), c4 = halves(at(8), at(9)), c5 = halves(at(10), at(11)),
            c6 = halves(at(12), at(13)), c7 = halves(at(14), at(15));
    // 8 -> 4: lane j of e[k] holds four partial sums of a[4k + j]
    const R e[4] = {pair_quarters(c0, c1), pair_quarters(c2, c3), pair_quarters(c4, c5), pair_quarters(c6, c7)};
    const R sums = quarter_sums(e[0], e[1], e[2], e[3]);
    if (n == 16) {
      _mm512_storeu_ps(out, sums);
      return;
    }
    _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1), sums);
  }
  // [x.q0 + x.q1, x.q2 + x.q3, y.q0 + y.q1, y.q2 + y.q3] (128-bit lanes q)
  static R pair_quarters(R x, R y) {
    return add(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xdd));
  }
  // Element 4 k + j = the sum of e_k's 128-bit lane j (its four floats): two add levels within the
  // lanes leave [e0.j, e1.j, e2.j, e3.j] in lane j, and one permutation sorts them.
  __attribute__((always_inline)) static R quarter_sums(R e0, R e1, R e2, R e3) {
    const R f0 = add(_mm512_unpacklo_ps(e0, e1), _mm512_unpackhi_ps(e0, e1));
    const R f1 = add(_mm512_unpacklo_ps(e2, e3), _mm512_unpackhi_ps(e2, e3));
    const R g = add(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(f0), _mm512_castps_pd(f1))),
                    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(f0), _mm512_castps_pd(f1))));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), g);
  }
  // e^x = 2^n 2^f, t = x log2(e), n = round(t), f = t - n in [-1/2, 1/2], 2^f by kExp2Poly
  // (cpu_attn.h; relative error 1.1e-7 in fp32): 12 operations. The kernel takes e^x of x <= 0 only (scores
  // less their running max, tanh's -2|x|); rounding t = x log2(e) costs about |t| 2^-24 relative, what
  // rounding the score itself costs. 0 below -87.33 (also -inf), NaN passes through.
  static R exp(R x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33f), _CMP_LT_OQ);
    const R t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const R n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const R f = _mm512_sub_ps(t, n);
    R p = _mm512_set1_ps(kExp2Poly[0]);
    for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
  }
  static R tanh(R x) {
    const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    const __m512i xi = _mm512_castps_si512(x);
    const R ax = _mm512_castsi512_ps(_mm512_andnot_si512(sign_bit, xi));
    const R e = exp(_mm512_mul_ps(ax, _mm512_set1_ps(-2.0f)));
    const R one = _mm512_set1_ps(1.0f);
    const R t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), _mm512_and_si512(xi, sign_bit)));
  }
};
