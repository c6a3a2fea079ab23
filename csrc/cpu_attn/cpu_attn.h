// Batched attention on vattn's contiguous KV cache, on the host.
//
// One call serves one layer of one forward: a mixed batch of prefill chunks
// and decodes, each request reading its keys and values in place from
// k_cache[reqid, :seq_len] (any token and slice strides, head_dim stride 1).
// The work is cut into items (request, kv head, query block, key split) and
// run on a persistent thread pool; each ISA's kernels live in their own
// translation unit compiled with that ISA's flags and are picked at run time.
//
// This header is plain data shared by the generic code and every ISA unit:
// no standard-library templates cross into the ISA units (they are compiled
// with other target flags, and a template instantiated there could be the
// copy the linker keeps for everyone); its functions are static, a copy per unit.
#pragma once

#include <cstdint>

namespace vattn {
namespace cpu_attn {

enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// kSve: SVE at a 256-bit vector length ("sve256"; other lengths use NEON).
// kAmx: AVX-512 with AMX-BF16 tiles for prefill blocks of a bf16 cache ("amx").
// kAvx512Bf16: AVX-512 with Q K^T of bf16 queries over a bf16 cache by VDPBF16PS ("avx512_bf16").
enum class Isa : int32_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kNeon = 3, kSve = 4, kAmx = 5, kAvx512Bf16 = 6 };
constexpr int kNumIsas = 7;

// A strided view of one tensor argument (strides in elements).
struct TensorRef {
  char* data = nullptr;
  DType dtype = DType::kF32;
  int32_t ndim = 0;
  int64_t shape[4] = {0, 0, 0, 0};
  int64_t strides[4] = {0, 0, 0, 0};
};

// One request of the batch. Its queries are tokens [query_start,
// query_start + query_len) of q/out, at positions cached_len .. seq_len - 1.
struct Request {
  int64_t reqid;
  int64_t cached_len;  // tokens in the cache before this forward
  int64_t query_len;   // new tokens (>= 1)
  int64_t query_start; // first row of this request in q / out / k / v
};

// One unit of work: the query heads of kv heads [head_begin, head_end) for
// the queries [q_begin, q_end) (request-local) of request `req`, over keys
// [k_begin, k_end). Within a kv head, rows are query-major: row = j * G + g.
// Decode items cover all kv heads, so each key tile is a run of whole token
// rows in memory (one TLB walk and one prefetch stream for every head).
struct WorkItem {
  int32_t req;       // index into the batch's requests
  int32_t head_begin, head_end;  // kv heads
  int32_t q_begin, q_end;
  int64_t k_begin, k_end;
  int32_t group;     // split group (items of one (req, heads, query block) over
                     // different key ranges), or -1: the item writes the output
  int32_t partial;   // where a split item leaves its partial result
};

// The values of one request, copied once per call into fp32 rows [kv head][token][d] (attention.cpp
// decides which requests): blocks of many rows then read V tiles there in place instead of copying
// each tile again in every block.
struct PackedValues {
  const float* data = nullptr;  // token first_token of kv head 0; null: this request is not packed
  int64_t first_token = 0;
  int64_t head_stride = 0;      // floats from one kv head's rows to the next's
};

// Whether blocks of many rows copy each V tile they read (run_item_typed): a 16-bit cache is widened
// to fp32, and fp32 tokens a multiple of 1 KiB apart (8 kv heads of 128: 4 KiB) are copied, because
// such rows share L1 sets and would evict each other between a block's re-reads of the tile.
static inline bool values_copied(DType dtype, int64_t token_stride_bytes) {
  return dtype != DType::kF32 || token_stride_bytes % 1024 == 0;
}

// Everything a kernel needs for one call. Plain pointers: the ISA units see
// no containers.
struct Call {
  // q, out: [T, Hq, D]; k_cache, v_cache: [B, L, Hkv, D]; lse: [T, Hq] f32 or null
  TensorRef q, out, k_cache, v_cache, lse;
  const Request* requests = nullptr;
  int32_t num_heads_q = 0, num_heads_kv = 0, group_size = 0, head_dim = 0;
  float scale = 1.0f;       // softmax scale, applied to q . k
  float softcap = 0.0f;     // > 0: scores become softcap * tanh(score / softcap)
  int64_t window = 0;       // > 0: a query at p sees keys (p - window, p]
  // the lines a decode item requests as it works (kernel_impl.h's request rule) go to L2 only, not L1: on a
  // core with a 32 KiB L1 data cache (AMD Zen 4) decode from memory ran 1.0-2.0x as fast so; with a
  // 48 KiB L1 (a Zen 5, by the other EPYC's results) it ran level or slower (docs/kernels.md)
  bool prefetch_to_l2 = false;
  // partial results of split items: [partial][row][D] accumulators, [partial][row] max and sum
  float* partial_acc = nullptr;
  float* partial_max = nullptr;
  float* partial_sum = nullptr;
  int32_t rows_per_partial = 0;
  // per request, or null: values packed for this call
  const PackedValues* packed_values = nullptr;
};

// 2^f for f in [-1/2, 1/2] by a degree-6 minimax polynomial (relative error 1.1e-7 in fp32), highest
// coefficient first for Horner's rule: the x86 Vec::exp of every unit (docs/kernels.md, "The exponential").
constexpr float kExp2Poly[] = {1.534581242594868e-4f, 1.3399930903688073e-3f, 9.618489071726799e-3f,
                               5.550328642129898e-2f, 2.4022646248340607e-1f, 6.931471824645996e-1f, 1.0f};

// Keys per tile. Prefill blocks (many rows per kv head share each K/V load)
// take 64. A decode item's tile spans all of its kv heads' rows of its
// tokens, and its K tile's scores are all computed before the V tile is
// read, so a tile (and, where the item requests the next tile's lines while
// this one computes, that one too) must sit in L2: at most max_bytes (64 KiB,
// or less for a streaming item or one whose K/V come from memory, see
// run_item_typed) of K (and of V) per tile: 8 to 128 tokens,
// a power of two (so that tiles divide the 128-token split boundaries). Few
// kv heads of 64 take 128-token tiles, halving the per-tile softmax work:
// against 64-token tiles 1.03-1.07x (8 q / 2 kv heads of 64, bf16 decode,
// host_kernel_ab.py single-threaded on a 2-core AVX-512 VM).
constexpr int32_t kMaxKeyTile = 128;
constexpr int32_t kPrefillKeyTile = 64;
static inline int32_t key_tile(int32_t rows_per_head, int64_t token_bytes, int64_t max_bytes) {
  if (rows_per_head > 16) return kPrefillKeyTile;
  int32_t tile = kMaxKeyTile;
  while (tile > 8 && tile * token_bytes > max_bytes) tile /= 2;
  return tile;
}

// Floats of per-thread scratch for an item of `rows` rows in all
// (kv heads x rows_per_head) and head dim `d`. Non-decreasing in each
// argument, so the maxima over a schedule's items bound every item.
static inline int64_t scratch_floats(int64_t rows, int32_t rows_per_head, int32_t d) {
  // q, acc: rows x d; scores: rows (decode: every head's) or rows_per_head rounded up to 16,
  // x tile; max, sum, alpha: rows, or for blocks of more than 8 rows a head each head's rows
  // rounded up to a whole vector (at most 16 floats, under twice the rows from 9 rows on);
  // widened K and V tiles: tile x d; then either the AMX unit's Q and P as two bf16 terms each
  // and its P V product (rows_per_head rounded up to 16 by d rounded up to 32, tile and d) or
  // the transposed Q of the rows-in-lanes blocks (padded rows by d, under 2 rows x d);
  // slack for aligning each block to 64 bytes
  const int64_t rows_pad = (rows_per_head + 15) / 16 * 16, d_pad = (d + 31) / 32 * 32;
  const int64_t amx = rows_pad * (d_pad + kMaxKeyTile + d), transposed_q = 2 * rows * d;
  return 2 * rows * d + (rows > rows_pad ? rows : rows_pad) * kMaxKeyTile + 6 * rows + 2 * kMaxKeyTile * d +
         (amx > transposed_q ? amx : transposed_q) + 12 * 16;
}

// One ISA's kernels.
struct KernelTable {
  int32_t vector_floats;  // floats per vector register; head_dim must be a multiple
  // Runs one item; `next` is the item the same thread runs after it (its first tile may be requested
  // ahead), or null; `scratch` holds scratch_floats(rows, D) floats.
  void (*run_item)(const Call& call, const WorkItem& item, const WorkItem* next, float* scratch);
};

// Defined by each ISA unit; null where the unit was built for another architecture.
const KernelTable* scalar_kernels();
const KernelTable* avx2_kernels();
const KernelTable* avx512_kernels();
const KernelTable* avx512_bf16_kernels();
const KernelTable* neon_kernels();
const KernelTable* sve_kernels();
const KernelTable* amx_kernels();

}  // namespace cpu_attn
}  // namespace vattn
