// The portable path: one float at a time, any head_dim. Also the reference
// the vector paths are compared with in the tests.
#define VATTN_ISA_NAMESPACE scalar_isa
#define VATTN_VEC_HEADER "vec_scalar.h"
#define VATTN_KERNELS_FN scalar_kernels
#include "kernel_unit.h"
