// A 16-float "vector" in plain C++ (the width of AVX-512, on any CPU), for
// tests/kernels/test_cpu_attn_isas.py: built in place of the scalar unit, it runs the
// kernel's vector-width-dependent code (tiles padded to whole vectors, 16-wide
// register blocks) where no AVX-512 CPU is at hand. Same contract as vec_*.h.
#pragma once

struct Wide16 {
  float v[16];
};

struct Vec {
  static constexpr int W = 16;
  static constexpr int kRegisters = 32;  // vector registers the ISA has (register blocking)
  using R = Wide16;

  template <class F>
  static R each(F f) {
    R r;
    for (int i = 0; i < W; ++i) r.v[i] = f(i);
    return r;
  }
  static R zero() { return set1(0.0f); }
  static R set1(float x) { return each([&](int) { return x; }); }
  template <class T>
  static R load(const T* p) { return each([&](int i) { return to_float(p[i]); }); }
  template <class T>
  static void store(T* p, R x) { for (int i = 0; i < W; ++i) from_float(x.v[i], p + i); }
  static void keep(R&) {}
  static R add(R a, R b) { return each([&](int i) { return a.v[i] + b.v[i]; }); }
  static R sub(R a, R b) { return each([&](int i) { return a.v[i] - b.v[i]; }); }
  static R mul(R a, R b) { return each([&](int i) { return a.v[i] * b.v[i]; }); }
  static R max(R a, R b) { return each([&](int i) { return a.v[i] > b.v[i] ? a.v[i] : b.v[i]; }); }
  static R fma(R a, R b, R c) { return each([&](int i) { return a.v[i] * b.v[i] + c.v[i]; }); }
  static float hsum(R a) {
    float s = 0.0f;
    for (float x : a.v) s += x;
    return s;
  }
  static float hmax(R a) {
    float m = a.v[0];
    for (float x : a.v) m = m > x ? m : x;
    return m;
  }
  static void hsum_n(const R* a, int n, float* out) {
    for (int i = 0; i < n; ++i) out[i] = hsum(a[i]);
  }
  static R exp(R a) { return each([&](int i) { return ::expf(a.v[i]); }); }
  static R tanh(R a) { return each([&](int i) { return ::tanhf(a.v[i]); }); }
};
