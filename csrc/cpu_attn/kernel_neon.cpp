// AArch64 Advanced SIMD (NEON), part of every AArch64 CPU: no extra flags.
#include <math.h>
#include <stdint.h>

#include "convert.h"
#include "cpu_attn.h"

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>

namespace vattn {
namespace cpu_attn {
namespace neon_isa {
namespace {
#include "vec_neon.h"
#include "kernel_impl.h"
}  // namespace
}  // namespace neon_isa

const KernelTable* neon_kernels() {
  static const KernelTable table{"neon", neon_isa::Vec::W, neon_isa::run_item};
  return &table;
}

}  // namespace cpu_attn
}  // namespace vattn
#else
namespace vattn {
namespace cpu_attn {
const KernelTable* neon_kernels() { return nullptr; }  // not an AArch64 build
}  // namespace cpu_attn
}  // namespace vattn
#endif
