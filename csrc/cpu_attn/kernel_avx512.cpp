// x86-64 with AVX-512F. setup.py compiles this unit alone with -mavx512f
// (and the AVX2 flags); nothing here runs unless the CPU reports AVX-512F.
// Two tables: avx512_kernels, and avx512_bf16_kernels, the same kernels with
// Q K^T of bf16 queries over a bf16 cache by VDPBF16PS (kernel_bf16_dot.h;
// those functions carry their own target), picked only where the CPU also
// reports AVX512_BF16.
#define VATTN_ISA_NAMESPACE avx512_isa
#define VATTN_VEC_HEADER "vec_avx512.h"
#define VATTN_KERNELS_FN avx512_kernels
#define VATTN_BF16_DOT_KERNELS_FN avx512_bf16_kernels

#if defined(__x86_64__) && defined(__AVX512F__) && \
    ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 10))
// GCC 12's AVX-512 intrinsics start from self-initialized "undefined"
// vectors, which -Wall reports as uninitialized at every use.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define VATTN_BF16_DOT
#else
#define VATTN_ISA_ABSENT  // another architecture, built without the flags, or a compiler without AVX512_BF16
#endif
#include "kernel_unit.h"
