// x86-64 with AVX-512F. setup.py compiles this unit alone with -mavx512f
// (and the AVX2 flags); nothing here runs unless the CPU reports AVX-512F.
#define VATTN_ISA_NAMESPACE avx512_isa
#define VATTN_VEC_HEADER "vec_avx512.h"
#define VATTN_KERNELS_FN avx512_kernels

#if defined(__x86_64__) && defined(__AVX512F__)
// GCC 12's AVX-512 intrinsics start from self-initialized "undefined"
// vectors, which -Wall reports as uninitialized at every use.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#else
#define VATTN_ISA_ABSENT  // another architecture, or built without the flags
#endif
#include "kernel_unit.h"
