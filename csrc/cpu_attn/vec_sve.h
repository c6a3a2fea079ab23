// 8 floats per vector: AArch64 SVE at a 256-bit vector length (Neoverse V1,
// Graviton3). Included inside the SVE unit's anonymous namespace, after
// <arm_sve.h>; the unit is compiled with -msve-vector-bits=256, which makes
// the vector types fixed-size (so the kernel's register blocks can be arrays
// of them) and binds the code to CPUs whose vector length is 256 bits: the
// unit runs only where the kernel table's run-time check finds exactly that.
// At 128 bits SVE offers this kernel nothing over NEON, which serves there.
#pragma once

typedef svfloat32_t sve_f32 __attribute__((arm_sve_vector_bits(256)));
typedef svuint32_t sve_u32 __attribute__((arm_sve_vector_bits(256)));
typedef svint32_t sve_s32 __attribute__((arm_sve_vector_bits(256)));

struct Vec {
  static constexpr int W = 8;
  static constexpr int kRegisters = 32;  // vector registers the ISA has (register blocking)
  using R = sve_f32;

  static svbool_t all() { return svptrue_b32(); }
  static R zero() { return svdup_n_f32(0.0f); }
  static R set1(float x) { return svdup_n_f32(x); }
  static R load(const float* p) { return svld1_f32(all(), p); }
  // a bf16 is the high half of an fp32: load each 16-bit value into the low half of a lane, shift up
  static R load(const bf16* p) {
    return svreinterpret_f32_u32(svlsl_n_u32_x(all(), svld1uh_u32(all(), reinterpret_cast<const uint16_t*>(p)), 16));
  }
  // FCVT (half to single) reads the low half of each 32-bit lane, where the widening load puts it
  static R load(const f16* p) {
    const svuint32_t halves = svld1uh_u32(all(), reinterpret_cast<const uint16_t*>(p));
    return svcvt_f32_f16_x(all(), svreinterpret_f16_u32(halves));
  }
  static void store(float* p, R x) { svst1_f32(all(), p, x); }
  // round to nearest even, NaN kept a (quiet) NaN; a truncating store keeps each lane's low 16 bits
  static void store(bf16* p, R x) {
    const svuint32_t u = svreinterpret_u32_f32(x);
    const svuint32_t odd = svand_n_u32_x(all(), svlsr_n_u32_x(all(), u, 16), 1);
    const svuint32_t rounded = svlsr_n_u32_x(all(), svadd_u32_x(all(), u, svadd_n_u32_x(all(), odd, 0x7fff)), 16);
    const svuint32_t nan = svorr_n_u32_x(all(), svlsr_n_u32_x(all(), u, 16), 0x40);
    const svuint32_t r = svsel_u32(svcmpuo_f32(all(), x, x), nan, rounded);
    svst1h_u32(all(), reinterpret_cast<uint16_t*>(p), r);
  }
  // FCVT (single to half) writes the low half of each 32-bit lane
  static void store(f16* p, R x) {
    const svuint32_t halves = svreinterpret_u32_f16(svcvt_f16_f32_x(all(), x));
    svst1h_u32(all(), reinterpret_cast<uint16_t*>(p), halves);
  }
  // Pins v to a register here (see vec_neon.h): z registers take the "w" constraint.
  static void keep(R& v) { asm("" : "+w"(v)); }
  static R add(R a, R b) { return svadd_f32_x(all(), a, b); }
  static R sub(R a, R b) { return svsub_f32_x(all(), a, b); }
  static R mul(R a, R b) { return svmul_f32_x(all(), a, b); }
  static R max(R a, R b) { return svmax_f32_x(all(), a, b); }
  static R fma(R a, R b, R c) { return svmla_f32_x(all(), c, a, b); }  // c + a * b
  static float hsum(R a) { return svaddv_f32(all(), a); }
  static float hmax(R a) { return svmaxv_f32(all(), a); }
  static void hsum_n(const R* a, int n, float* out) {
    for (int i = 0; i < n; ++i) out[i] = hsum(a[i]);
  }
  // e^x as in vec_neon.h: x = n ln2 + r, a degree-6 polynomial of r times 2^n; 0 below -87.33
  static R exp(R x) {
    const svbool_t tiny = svcmplt_n_f32(all(), x, -87.33f);
    x = svmin_n_f32_x(all(), svmax_n_f32_x(all(), x, -87.33f), 88.0f);
    const R n = svrintn_f32_x(all(), svmul_n_f32_x(all(), x, 1.44269504088896341f));
    x = svmls_f32_x(all(), x, n, svdup_n_f32(0.693359375f));
    x = svmls_f32_x(all(), x, n, svdup_n_f32(-2.12194440e-4f));
    R y = svdup_n_f32(1.9875691500e-4f);
    y = svmla_f32_x(all(), svdup_n_f32(1.3981999507e-3f), y, x);
    y = svmla_f32_x(all(), svdup_n_f32(8.3334519073e-3f), y, x);
    y = svmla_f32_x(all(), svdup_n_f32(4.1665795894e-2f), y, x);
    y = svmla_f32_x(all(), svdup_n_f32(1.6666665459e-1f), y, x);
    y = svmla_f32_x(all(), svdup_n_f32(5.0000001201e-1f), y, x);
    y = svmla_f32_x(all(), svadd_n_f32_x(all(), x, 1.0f), y, svmul_f32_x(all(), x, x));
    const svint32_t pow2n = svlsl_n_s32_x(all(), svadd_n_s32_x(all(), svcvt_s32_f32_x(all(), n), 127), 23);
    const R out = svmul_f32_x(all(), y, svreinterpret_f32_s32(pow2n));
    return svsel_f32(tiny, svdup_n_f32(0.0f), out);
  }
  static R tanh(R x) {
    const svuint32_t sign = svand_n_u32_x(all(), svreinterpret_u32_f32(x), 0x80000000u);
    const R e = exp(svmul_n_f32_x(all(), svabs_f32_x(all(), x), -2.0f));
    const R t = svdiv_f32_x(all(), svsubr_n_f32_x(all(), e, 1.0f), svadd_n_f32_x(all(), e, 1.0f));
    return svreinterpret_f32_u32(svorr_u32_x(all(), svreinterpret_u32_f32(t), sign));
  }
};
