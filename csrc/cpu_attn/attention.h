// The generic side of the host attention: plans, validation, scheduling of
// work items onto the thread pool, writes of the step's new K/V rows, merges
// of split-KV partials, and the run-time choice of the ISA.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_attn.h"

namespace vattn {
namespace cpu_attn {

// ---- limits of a call (vattn.kernels.host reads them from the module: stated here only) ----

// The largest head_dim: the split merge keeps one row of this many floats on the stack.
constexpr int32_t kMaxHeadDim = 1024;
constexpr int kNumDTypes = 3;  // DType's values, 0 .. kNumDTypes - 1
const char* torch_dtype_name(DType d);  // torch's name of the type: "float32", "bfloat16", "float16"

// A bad argument whose type (dtype) is wrong; bindings raise TypeError.
class TypeError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// How the work of one layer call is cut: items, split groups, partials.
struct Schedule {
  struct Group {
    int32_t req, head_begin, head_end, q_begin, q_end;
    int32_t first_partial, num_splits;
  };
  std::vector<WorkItem> items;  // largest first
  std::vector<Group> groups;
  int32_t num_partials = 0;
  int32_t rows_per_partial = 0;      // rows of the largest split item (kv heads x rows per head)
  int64_t max_rows = 0;           // of any item, all its heads
  int32_t max_rows_per_head = 0;  // of any item
  int threads = 1;                // threads worth running it on (at most the pool's)
  // requests whose queries make several blocks: each of their kv heads' values is read by several items
  std::vector<int32_t> multi_block_requests;
};

// One forward's requests (vattn.attention.AttentionBatch), validated once and
// shared by every layer's call. The schedule depends on the heads, the window,
// the head dim and the pool size only, so it is built on the first call and reused.
class BatchPlan {
 public:
  BatchPlan(const std::vector<int64_t>& reqids, const std::vector<int64_t>& cached_lens,
            const std::vector<int64_t>& query_lens);

  const std::vector<Request>& requests() const { return requests_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t max_seq_len() const { return max_seq_len_; }
  int64_t max_reqid() const { return max_reqid_; }

  std::shared_ptr<const Schedule> schedule(int32_t group_size, int32_t heads_kv, int64_t window, int threads,
                                           int32_t head_dim) const;

 private:
  std::vector<Request> requests_;
  int64_t num_tokens_ = 0, max_seq_len_ = 0, max_reqid_ = 0;
  mutable std::mutex mutex_;
  mutable std::map<std::tuple<int32_t, int32_t, int64_t, int, int32_t>, std::shared_ptr<const Schedule>> schedules_;
};

// Attention of one layer. `call` carries the tensors (shapes as in
// cpu_attn.h) and the options; k_new / v_new ([T, Hkv, D], or null) are
// written into the cache rows (reqid, cached_len + j) first. Validates
// everything (throws std::invalid_argument / TypeError naming the argument)
// before touching memory. Returns the ISA that ran.
Isa attention(const BatchPlan& plan, Call call, const TensorRef* k_new, const TensorRef* v_new, Isa requested);
// Completed attention() calls that ran on `isa`, in this process (so a
// framework's run can show that its layers went through this kernel).
uint64_t calls(Isa isa);
// Bytes of values packed for blocks of many rows (PackedValues) by the calls so far, in this process.
uint64_t packed_bytes();
// Whether decode items that request the next tile's lines as they work request them into L2 only
// (Call::prefetch_to_l2): on cores whose L1 data cache is under 48 KiB.
bool decode_prefetch_to_l2();

// ---- ISA choice ---------------------------------------------------------------

const char* isa_name(Isa isa);
std::string isa_names();  // every path's name, comma-separated, for messages
bool parse_isa(const std::string& name, Isa* isa);
bool isa_compiled(Isa isa);   // this build has kernels for it
bool isa_supported(Isa isa);  // compiled, and the CPU (and OS) can run it
Isa best_isa();               // the fastest supported one
// best_isa(), or the lower one VATTN_CPU_ATTN_ISA names; `note` says why when
// the variable was set but could not be honoured.
Isa default_isa(std::string* note = nullptr);

int pool_threads();
// Whose threads run the work: "openmp (<library>)" (the runtime torch loaded) or "own".
std::string pool_kind();

}  // namespace cpu_attn
}  // namespace vattn
