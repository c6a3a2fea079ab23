// x86-64 with AVX-512F. setup.py compiles this unit alone with -mavx512f
// (and the AVX2 flags); nothing here runs unless the CPU reports AVX-512F.
#include <math.h>
#include <stdint.h>

#include "convert.h"
#include "cpu_attn.h"

#if defined(__x86_64__) && defined(__AVX512F__)
// GCC 12's AVX-512 intrinsics start from self-initialized "undefined"
// vectors, which -Wall reports as uninitialized at every use.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

namespace vattn {
namespace cpu_attn {
namespace avx512_isa {
namespace {
#include "vec_avx512.h"
#include "kernel_impl.h"
}  // namespace
}  // namespace avx512_isa

const KernelTable* avx512_kernels() {
  static const KernelTable table{"avx512", avx512_isa::Vec::W, avx512_isa::run_item};
  return &table;
}

}  // namespace cpu_attn
}  // namespace vattn
#else
namespace vattn {
namespace cpu_attn {
const KernelTable* avx512_kernels() { return nullptr; }  // another architecture, or built without the flags
}  // namespace cpu_attn
}  // namespace vattn
#endif
