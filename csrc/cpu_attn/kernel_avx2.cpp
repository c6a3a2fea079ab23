// x86-64 with AVX2, FMA and F16C. setup.py compiles this unit alone with
// -mavx2 -mfma -mf16c; nothing here runs unless the CPU reports all three.
#include <math.h>
#include <stdint.h>

#include "convert.h"
#include "cpu_attn.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace vattn {
namespace cpu_attn {
namespace avx2_isa {
namespace {
#include "vec_avx2.h"
#include "kernel_impl.h"
}  // namespace
}  // namespace avx2_isa

const KernelTable* avx2_kernels() {
  static const KernelTable table{"avx2", avx2_isa::Vec::W, avx2_isa::run_item};
  return &table;
}

}  // namespace cpu_attn
}  // namespace vattn
#else
namespace vattn {
namespace cpu_attn {
const KernelTable* avx2_kernels() { return nullptr; }  // another architecture, or built without the flags
}  // namespace cpu_attn
}  // namespace vattn
#endif
