// AArch64 SVE at a 256-bit vector length. setup.py compiles this unit alone
// with -march=armv8.2-a+sve -msve-vector-bits=256; nothing here runs unless
// the CPU reports SVE and the process's vector length is 256 bits
// (attention.cpp checks both before choosing it).
#define VATTN_ISA_NAMESPACE sve_isa
#define VATTN_VEC_HEADER "vec_sve.h"
#define VATTN_KERNELS_FN sve_kernels

#if defined(__aarch64__) && defined(__ARM_FEATURE_SVE) && defined(__ARM_FEATURE_SVE_BITS) && \
    __ARM_FEATURE_SVE_BITS == 256
#include <arm_sve.h>
#else
#define VATTN_ISA_ABSENT  // not an AArch64 build, or built without the flags
#endif
#include "kernel_unit.h"
