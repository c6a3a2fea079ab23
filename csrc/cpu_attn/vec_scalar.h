// One float per "vector": the portable path, and the reference the vector
// paths are tested against. Included inside an ISA unit's anonymous namespace.
#pragma once

struct Vec {
  static constexpr int W = 1;
  static constexpr int kRegisters = 16;  // vector registers the ISA has (register blocking)
  using R = float;

  static R zero() { return 0.0f; }
  static R set1(float x) { return x; }
  static R load(const float* p) { return *p; }
  static R load(const bf16* p) { return to_float(*p); }
  static R load(const f16* p) { return to_float(*p); }
  static void store(float* p, R x) { *p = x; }
  static void store(bf16* p, R x) { from_float(x, p); }
  static void store(f16* p, R x) { from_float(x, p); }
  static void keep(R&) {}
  static R add(R a, R b) { return a + b; }
  static R sub(R a, R b) { return a - b; }
  static R mul(R a, R b) { return a * b; }
  static R max(R a, R b) { return a > b ? a : b; }
  static R fma(R a, R b, R c) { return a * b + c; }
  static float hsum(R a) { return a; }
  static float hmax(R a) { return a; }
  static void hsum_n(const R* a, int n, float* out) {
    for (int i = 0; i < n; ++i) out[i] = a[i];
  }
  static R exp(R x) { return ::expf(x); }
  static R tanh(R x) { return ::tanhf(x); }
};
