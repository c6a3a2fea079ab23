// x86-64 with AVX2, FMA and F16C. setup.py compiles this unit alone with
// -mavx2 -mfma -mf16c; nothing here runs unless the CPU reports all three.
#define VATTN_ISA_NAMESPACE avx2_isa
#define VATTN_VEC_HEADER "vec_avx2.h"
#define VATTN_KERNELS_FN avx2_kernels

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#else
#define VATTN_ISA_ABSENT  // another architecture, or built without the flags
#endif
#include "kernel_unit.h"
