// The fp32 multiply-add ceiling of one core at one x86 kernel unit's vector
// width, which benchmarks/prefill_ceiling.py times beside the host kernel's
// prefill (a compute-bound call: two multiply-adds per score and head_dim).
// Built with setup.py's flags of that unit, so the vectors are the unit's
// (16 floats for AVX-512, 8 for AVX2) and the multiply-adds its FMAs.
//
// Twelve independent chains: an FMA's latency (4 cycles on current x86 cores)
// times two FMA pipes needs at least eight in flight to keep both busy, and
// twelve chains plus the two operands still fit AVX2's 16 registers. Each
// chain is a named variable (an array is kept in memory by the empty asm
// below, turning the loop into stores) that the asm keeps from being folded.

#include <cstdint>

#include "probe_vector.h"

namespace {

typedef float VecF __attribute__((vector_size(kVecBytes)));
constexpr int kChains = 12;

VecF splat(float x) {
  VecF v;
  for (int i = 0; i < kVecBytes / 4; ++i) v[i] = x;
  return v;
}

}  // namespace

extern "C" {

int fma_vector_floats() { return kVecBytes / 4; }

int fma_chains() { return kChains; }

// iterations x kChains vector multiply-adds; returns the lanes' sum, so that no chain is dropped
double fma_run(int64_t iterations) {
  const VecF b = splat(0.9999999f), c = splat(1e-7f);
#define CHAIN(i) VecF a##i = splat(1.0f + (i) * 1e-7f);
  CHAIN(0) CHAIN(1) CHAIN(2) CHAIN(3) CHAIN(4) CHAIN(5) CHAIN(6) CHAIN(7) CHAIN(8) CHAIN(9) CHAIN(10) CHAIN(11)
#undef CHAIN
  for (int64_t n = 0; n < iterations; ++n) {
#define STEP(i) a##i = a##i * b + c;
    STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7) STEP(8) STEP(9) STEP(10) STEP(11)
#undef STEP
    asm volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5));
    asm volatile("" : "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));
  }
  const VecF sum = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)) + ((a8 + a9) + (a10 + a11));
  double total = 0;
  for (int i = 0; i < kVecBytes / 4; ++i) total += sum[i];
  return total;
}

}  // extern "C"
