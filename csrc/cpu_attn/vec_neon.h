// 4 floats per vector: AArch64 Advanced SIMD (NEON). Included inside the
// NEON unit's anonymous namespace, after <arm_neon.h>.
#pragma once

struct Vec {
  static constexpr int W = 4;
  static constexpr int kRegisters = 32;  // vector registers the ISA has (register blocking)
  using R = float32x4_t;

  static R zero() { return vdupq_n_f32(0.0f); }
  static R set1(float x) { return vdupq_n_f32(x); }
  static R load(const float* p) { return vld1q_f32(p); }
  static R load(const bf16* p) {
    const uint32x4_t wide = vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16);
    return vreinterpretq_f32_u32(wide);
  }
  static R load(const f16* p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
  }
  static void store(float* p, R x) { vst1q_f32(p, x); }
  static void store(bf16* p, R x) {
    const uint32x4_t u = vreinterpretq_u32_f32(x);
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(odd, vdupq_n_u32(0x7fff))), 16);
    const uint32x4_t nan = vorrq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(0x40));
    r = vbslq_u32(vceqq_f32(x, x), r, nan);  // x == x is false only for NaN
    vst1_u16(reinterpret_cast<uint16_t*>(p), vmovn_u32(r));
  }
  static void store(f16* p, R x) {
    vst1_u16(reinterpret_cast<uint16_t*>(p), vreinterpret_u16_f16(vcvt_f16_f32(x)));
  }
  // Pins v to a register here, so that the compiler does not fold its reloads into every
  // FMA that uses it (one load per FMA would bound the loop by loads, not FMAs).
  static void keep(R& v) { asm("" : "+w"(v)); }
  static R add(R a, R b) { return vaddq_f32(a, b); }
  static R sub(R a, R b) { return vsubq_f32(a, b); }
  static R mul(R a, R b) { return vmulq_f32(a, b); }
  static R max(R a, R b) { return vmaxq_f32(a, b); }
  static R fma(R a, R b, R c) { return vfmaq_f32(c, a, b); }
  static float hsum(R a) { return vaddvq_f32(a); }
  static float hmax(R a) { return vmaxvq_f32(a); }
  static void hsum_n(const R* a, int n, float* out) {
    for (int i = 0; i < n; ++i) out[i] = hsum(a[i]);
  }
  static R exp(R x) {
    const uint32x4_t tiny = vcltq_f32(x, vdupq_n_f32(-87.33f));
    x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.33f)), vdupq_n_f32(88.0f));
    const R n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    x = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    x = vfmsq_f32(x, n, vdupq_n_f32(-2.12194440e-4f));
    R y = vdupq_n_f32(1.9875691500e-4f);
    y = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), y, x);
    y = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), y, x);
    y = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), y, x);
    y = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), y, x);
    y = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), y, x);
    y = vfmaq_f32(vaddq_f32(x, vdupq_n_f32(1.0f)), y, vmulq_f32(x, x));
    const int32x4_t pow2n = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    const R out = vmulq_f32(y, vreinterpretq_f32_s32(pow2n));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(out), tiny));
  }
  static R tanh(R x) {
    const uint32x4_t sign = vandq_u32(vreinterpretq_u32_f32(x), vdupq_n_u32(0x80000000u));
    const R e = exp(vmulq_f32(vabsq_f32(x), vdupq_n_f32(-2.0f)));
    const R one = vdupq_n_f32(1.0f);
    const R t = vdivq_f32(vsubq_f32(one, e), vaddq_f32(one, e));
    return vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(t), sign));
  }
};
