// The portable path: one float at a time, any head_dim. Also the reference
// the vector paths are compared with in the tests.
#include <math.h>
#include <stdint.h>

#include "convert.h"
#include "cpu_attn.h"

namespace vattn {
namespace cpu_attn {
namespace scalar_isa {
namespace {
#include "vec_scalar.h"
#include "kernel_impl.h"
}  // namespace
}  // namespace scalar_isa

const KernelTable* scalar_kernels() {
  static const KernelTable table{"scalar", scalar_isa::Vec::W, scalar_isa::run_item};
  return &table;
}

}  // namespace cpu_attn
}  // namespace vattn
