// The AMX unit's kernels with emulated tiles and a 16-float emulated vector
// (tests/kernels/cpu_attn_amx_emulation.h): linked instead of
// csrc/cpu_attn/kernel_scalar.cpp by tests/kernels/test_cpu_attn_isas.py, so the
// harness's "scalar" path runs the tile code. At exit it prints how many tile
// dot products ran, so the test can see the tiles were used.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>

std::atomic<long> vattn_amx_emulated_products{0};

namespace {
struct PrintAtExit {
  ~PrintAtExit() { printf("amx tile products: %ld\n", vattn_amx_emulated_products.load()); }
} print_at_exit;
}  // namespace

#define VATTN_ISA_NAMESPACE amx_emulated_isa
#define VATTN_VEC_HEADER "cpu_attn_amx_emulation.h"
#define VATTN_KERNELS_FN scalar_kernels
#define VATTN_AMX_BF16
#include "kernel_unit.h"
