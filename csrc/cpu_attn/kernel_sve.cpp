// AArch64 SVE at a 256-bit vector length. setup.py compiles this unit alone
// with -march=armv8.2-a+sve -msve-vector-bits=256; nothing here runs unless
// the CPU reports SVE and the process's vector length is 256 bits
// (attention.cpp checks both before choosing it).
#include <math.h>
#include <stdint.h>

#include "convert.h"
#include "cpu_attn.h"

#if defined(__aarch64__) && defined(__ARM_FEATURE_SVE) && defined(__ARM_FEATURE_SVE_BITS) && \
    __ARM_FEATURE_SVE_BITS == 256
#include <arm_sve.h>

namespace vattn {
namespace cpu_attn {
namespace sve_isa {
namespace {
#include "vec_sve.h"
#include "kernel_impl.h"
}  // namespace
}  // namespace sve_isa

const KernelTable* sve_kernels() {
  static const KernelTable table{"sve256", sve_isa::Vec::W, sve_isa::run_item};
  return &table;
}

}  // namespace cpu_attn
}  // namespace vattn
#else
namespace vattn {
namespace cpu_attn {
const KernelTable* sve_kernels() { return nullptr; }  // not an AArch64 build, or built without the flags
}  // namespace cpu_attn
}  // namespace vattn
#endif
