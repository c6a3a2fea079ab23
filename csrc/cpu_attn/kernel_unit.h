// The body of one ISA's kernel unit (kernel_<isa>.cpp), so that every unit is
// the same few lines: the unit defines
//
//   VATTN_ISA_NAMESPACE  a namespace of its own (internal linkage inside it)
//   VATTN_VEC_HEADER     its Vec header ("vec_avx2.h", ...), after the intrinsics header
//   VATTN_KERNELS_FN     the function cpu_attn.h declares (avx2_kernels, ...)
//
// and, for the AVX512_BF16 variants (kernel_bf16_dot.h), VATTN_BF16_DOT with either
// VATTN_BF16_DOT_KERNELS_FN (a second table, with them: avx512_bf16_kernels) or
// VATTN_BF16_DOT_ONLY (the unit's one table has them: the AMX unit),
//
// and includes this where its target flags and CPU are right, or defines
// VATTN_ISA_ABSENT and includes it where they are not (another architecture,
// or a compiler without the flags): the function then returns null.
#include <math.h>
#include <stdint.h>
#include <type_traits>  // std::true_type, std::false_type (kernel_impl.h's with_prefetch_hint)

#include "convert.h"
#include "cpu_attn.h"

namespace vattn {
namespace cpu_attn {

#ifdef VATTN_ISA_ABSENT
const KernelTable* VATTN_KERNELS_FN() { return nullptr; }
#ifdef VATTN_BF16_DOT_KERNELS_FN
const KernelTable* VATTN_BF16_DOT_KERNELS_FN() { return nullptr; }
#endif
#else
namespace VATTN_ISA_NAMESPACE {
namespace {
#include VATTN_VEC_HEADER
#include "kernel_impl.h"
}  // namespace
}  // namespace VATTN_ISA_NAMESPACE

const KernelTable* VATTN_KERNELS_FN() {
#ifdef VATTN_BF16_DOT_ONLY
  static const KernelTable table{VATTN_ISA_NAMESPACE::Vec::W, VATTN_ISA_NAMESPACE::run_item<true>};
#else
  static const KernelTable table{VATTN_ISA_NAMESPACE::Vec::W, VATTN_ISA_NAMESPACE::run_item<false>};
#endif
  return &table;
}
#ifdef VATTN_BF16_DOT_KERNELS_FN
const KernelTable* VATTN_BF16_DOT_KERNELS_FN() {
  static const KernelTable table{VATTN_ISA_NAMESPACE::Vec::W, VATTN_ISA_NAMESPACE::run_item<true>};
  return &table;
}
#endif
#endif

}  // namespace cpu_attn
}  // namespace vattn
