// x86-64 with AMX-BF16: the avx512_bf16 kernels, plus tile matrix products
// (TDPBF16PS) for the Q K^T and P V of prefill blocks over a bf16 cache.
// setup.py compiles this unit alone with -mamx-tile -mamx-bf16 and the
// AVX-512 flags; nothing here runs unless the CPU reports AMX-BF16,
// AVX512_BF16 and AVX-512F and Linux has granted the process the tile state.
#define VATTN_ISA_NAMESPACE amx_isa
#define VATTN_VEC_HEADER "vec_avx512.h"
#define VATTN_KERNELS_FN amx_kernels

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
// GCC 12's AVX-512 intrinsics start from self-initialized "undefined"
// vectors, which -Wall reports as uninitialized at every use.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define VATTN_BF16_DOT  // and Q K^T of bf16 queries outside the tiles by VDPBF16PS (kernel_bf16_dot.h)
#define VATTN_BF16_DOT_ONLY
#define VATTN_AMX_BF16
#else
#define VATTN_ISA_ABSENT  // another architecture, or a compiler without the AMX flags
#endif
#include "kernel_unit.h"
