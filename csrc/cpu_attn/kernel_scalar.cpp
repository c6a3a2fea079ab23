// The portable path: one float at a time, any head_dim. Also the reference
// the vector paths are compared with in the tests.
// GCC 12's SLP vectorizer turns P V's scalar register block into vectors
// whose upper half it fills with a load of the next key row, one row past the
// tile: on the cache (an fp32 tile read in place) that is past seq_len, into
// a page that may be unmapped. Scalar code stays scalar here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-tree-vectorize")
#endif
#define VATTN_ISA_NAMESPACE scalar_isa
#define VATTN_VEC_HEADER "vec_scalar.h"
#define VATTN_KERNELS_FN scalar_kernels
#include "kernel_unit.h"
