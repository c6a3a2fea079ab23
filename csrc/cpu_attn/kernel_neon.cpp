// AArch64 Advanced SIMD (NEON), part of every AArch64 CPU: no extra flags.
#define VATTN_ISA_NAMESPACE neon_isa
#define VATTN_VEC_HEADER "vec_neon.h"
#define VATTN_KERNELS_FN neon_kernels

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#else
#define VATTN_ISA_ABSENT  // not an AArch64 build
#endif
#include "kernel_unit.h"
