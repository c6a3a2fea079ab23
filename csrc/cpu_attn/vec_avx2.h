// 8 floats per vector: AVX2 + FMA + F16C. Included inside the AVX2 unit's
// anonymous namespace, after <immintrin.h>.
#pragma once

struct Vec {
  static constexpr int W = 8;
  static constexpr int kRegisters = 16;  // vector registers the ISA has (register blocking)
  using R = __m256;

  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static R load(const bf16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static R load(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // The 2 W bf16 at p as two fp32 vectors, each bf16 interleaved with a zero word inside its 128-bit lane:
  // lo = p[0..3], p[8..11] and hi = p[4..7], p[12..15]. One in-lane shuffle a vector, where load(bf16)
  // takes a lane-crossing widen and a shift.
  static constexpr bool kBf16Pairs = true;
  static void load_bf16_pairs(const bf16* p, R& lo, R& hi) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), zero = _mm256_setzero_si256();
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x));
  }
  // the element of a 2 W chunk at position i of [lo | hi]
  static constexpr int pair_element(int i) { return (i & 3) + (i & 4 ? 8 : 0) + (i & 8 ? 4 : 0); }
  static void store(float* p, R x) { _mm256_storeu_ps(p, x); }
  static void store(bf16* p, R x) {
    // round to nearest even; NaN keeps its top bits and turns quiet
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void store(f16* p, R x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  // Pins v to a register here, so that the compiler does not fold its reloads into every
  // FMA that uses it (one load per FMA would bound the loop by loads, not FMAs).
  static void keep(R& v) { asm("" : "+x"(v)); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(R a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float hmax(R a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // [a0 + a1, a2 + a3, b0 + b1, b2 + b3] in each 128-bit lane: what vhaddps computes, bit for bit, in two
  // one-uop shuffles and an add. vhaddps is slower where it is several uops: on a 2-core Zen 4, a tree of six
  // took 14-16 cycles a tree in a loop of it alone, this form 10-11.
  static R pair_add(R a, R b) { return _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xdd)); }
  // out[i] = hsum(a[i]); eight at once with one transposing add tree. Always inlined: Q K^T's register
  // block in pairs grew past GCC's inlining limit and called it once a block.
  __attribute__((always_inline)) static void hsum_n(const R* a, int n, float* out) {
    if (n == 8) {
      const __m256 h0 = pair_add(a[0], a[1]), h1 = pair_add(a[2], a[3]);
      const __m256 h2 = pair_add(a[4], a[5]), h3 = pair_add(a[6], a[7]);
      const __m256 g0 = pair_add(h0, h1), g1 = pair_add(h2, h3);
      _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20),
                                          _mm256_permute2f128_ps(g0, g1, 0x31)));
      return;
    }
    for (int i = 0; i < n; ++i) out[i] = hsum(a[i]);
  }
  // e^x = 2^n 2^f, t = x log2(e), n = round(t), f = t - n in [-1/2, 1/2], 2^f by kExp2Poly
  // (cpu_attn.h; relative error 1.1e-7 in fp32), 2^n built in the exponent bits. The kernel takes e^x of
  // x <= 0 only (scores less their running max, tanh's -2|x|); rounding t = x log2(e) costs about |t| 2^-24
  // relative, what rounding the score itself costs. 0 below -87.33 (also -inf; n >= -126 above it, so 2^n
  // is a normal float), NaN passes through (its n's bits make 2^n = 1).
  static R exp(R x) {
    const R tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33f), _CMP_LT_OQ);
    const R t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const R n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const R f = _mm256_sub_ps(t, n);
    R p = _mm256_set1_ps(kExp2Poly[0]);
    for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
    const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n)));
  }
  // tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|)
  static R tanh(R x) {
    const R sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
    const R e = exp(_mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), _mm256_set1_ps(-2.0f)));
    const R one = _mm256_set1_ps(1.0f);
    return _mm256_or_ps(sign, _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)));
  }
};
