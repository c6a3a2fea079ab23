// The scalar unit's entry point with tests/kernels/cpu_attn_wide16.h as its vector:
// linked instead of csrc/cpu_attn/kernel_scalar.cpp by tests/kernels/test_cpu_attn_isas.py.
#define VATTN_ISA_NAMESPACE wide16_isa
#define VATTN_VEC_HEADER "cpu_attn_wide16.h"
#define VATTN_KERNELS_FN scalar_kernels
#include "kernel_unit.h"
