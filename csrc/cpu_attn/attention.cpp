#include "attention.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include <unistd.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__aarch64__)
#include <sys/auxv.h>
#include <sys/prctl.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
#ifndef HWCAP_SVE
#define HWCAP_SVE (1 << 22)
#endif
#ifndef PR_SVE_GET_VL
#define PR_SVE_GET_VL 51
#define PR_SVE_VL_LEN_MASK 0xffff
#endif
#endif

#include "convert.h"
#include "thread_pool.h"

namespace vattn {
namespace cpu_attn {

const char* torch_dtype_name(DType d) {
  switch (d) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
  }
  return "?";
}

namespace {

constexpr int32_t kBlockRows = 64;       // query rows (queries x group heads) per prefill item
constexpr int32_t kDecodeRows = 16;      // at most this many rows per kv head: one item spans all kv heads
constexpr int64_t kMinSplitKeys = 256;   // a split covers at least this many keys
constexpr int kItemsPerThread = 4;       // splitting aims at this many items per thread
// Work (rows x keys x head_dim) below which one more thread costs more than it saves: handing
// items to another thread and waiting for it takes about 1.5 us (2 threads of libgomp, 2-core
// AVX-512 VM), and a share of this size takes about 2 us there (bf16 decode, head_dim 64).
constexpr double kMinThreadWork = 96 * 1024;

std::atomic<uint64_t> call_counts[kNumIsas];  // completed attention() calls per ISA, since the module loaded
std::atomic<uint64_t> packed_value_bytes{0};   // values packed (PackedValues), since the module loaded

// Plain string arithmetic: the extension's one iostream was here, on the error path where a crash was seen
// on one machine (docs/gpu.md, the H200 run); without it the path needs no locale or stream state.
std::string shape_str(const TensorRef& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

[[noreturn]] void bad(const std::string& message) { throw std::invalid_argument(message); }

void check_rank(const TensorRef& t, const char* name, int ndim, const char* dims) {
  if (t.ndim != ndim) bad(std::string(name) + " must be " + dims + ", got " + std::to_string(t.ndim) + "-D " + shape_str(t));
  for (int i = 0; i < ndim; ++i)
    if (t.strides[i] < 0) bad(std::string(name) + " must have non-negative strides");
  if (t.shape[ndim - 1] > 1 && t.strides[ndim - 1] != 1)
    bad(std::string(name) + " must be contiguous in its last dimension (stride 1), got stride " +
        std::to_string(t.strides[ndim - 1]));
}

void validate(const BatchPlan& plan, const Call& c, const TensorRef* k_new, const TensorRef* v_new) {
  check_rank(c.q, "q", 3, "[num_tokens, num_heads_q, head_dim]");
  check_rank(c.out, "out", 3, "[num_tokens, num_heads_q, head_dim]");
  check_rank(c.k_cache, "k_cache", 4, "[max_batch_size, max_context_len, num_heads_kv, head_dim]");
  check_rank(c.v_cache, "v_cache", 4, "[max_batch_size, max_context_len, num_heads_kv, head_dim]");
  const int64_t T = c.q.shape[0], Hq = c.q.shape[1], D = c.q.shape[2];
  const int64_t B = c.k_cache.shape[0], L = c.k_cache.shape[1], Hkv = c.k_cache.shape[2];
  if (T != plan.num_tokens())
    bad("q must have num_tokens = " + std::to_string(plan.num_tokens()) + " rows (sum of query_lens), got " +
        shape_str(c.q));
  if (D < 1 || D > kMaxHeadDim) bad("head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "], got " + std::to_string(D));
  for (int i = 0; i < 4; ++i)
    if (c.v_cache.shape[i] != c.k_cache.shape[i])
      bad("k_cache and v_cache shapes differ: " + shape_str(c.k_cache) + " vs " + shape_str(c.v_cache));
  if (c.k_cache.shape[3] != D)
    bad("k_cache head_dim (" + std::to_string(c.k_cache.shape[3]) + ") must equal q's (" + std::to_string(D) + ")");
  if (Hkv < 1 || Hq < 1 || Hq % Hkv != 0)
    bad("q heads (" + std::to_string(Hq) + ") must be a positive multiple of the cache's kv heads (" +
        std::to_string(Hkv) + ")");
  for (int i = 0; i < 3; ++i)
    if (c.out.shape[i] != c.q.shape[i]) bad("out must have q's shape " + shape_str(c.q) + ", got " + shape_str(c.out));
  if (c.out.dtype != c.q.dtype)
    throw TypeError(std::string("out must have q's dtype (") + torch_dtype_name(c.q.dtype) + "), got " +
                    torch_dtype_name(c.out.dtype));
  if (c.v_cache.dtype != c.k_cache.dtype)
    throw TypeError(std::string("k_cache and v_cache dtypes differ: ") + torch_dtype_name(c.k_cache.dtype) +
                    " vs " + torch_dtype_name(c.v_cache.dtype));
  if (plan.max_reqid() >= B)
    bad("reqids must be in [0, " + std::to_string(B - 1) + "] for this cache (max_batch_size " + std::to_string(B) +
        "), got " + std::to_string(plan.max_reqid()));
  if (plan.max_seq_len() > L)
    bad("cached_lens + query_lens must be <= " + std::to_string(L) + " (the cache's max_context_len), got " +
        std::to_string(plan.max_seq_len()));
  if ((k_new == nullptr) != (v_new == nullptr)) bad("k and v must be given together (or neither)");
  const TensorRef* news[2] = {k_new, v_new};
  for (int i = 0; i < 2; ++i) {
    const TensorRef* t = news[i];
    if (!t) continue;
    const char* name = i == 0 ? "k" : "v";
    check_rank(*t, name, 3, "[num_tokens, num_heads_kv, head_dim]");
    if (t->shape[0] != T || t->shape[1] != Hkv || t->shape[2] != D)
      bad(std::string(name) + " must be [" + std::to_string(T) + ", " + std::to_string(Hkv) + ", " +
          std::to_string(D) + "] (new tokens, kv heads, head_dim), got " + shape_str(*t));
    if (t->dtype != c.k_cache.dtype)
      throw TypeError(std::string(name) + " must have the cache's dtype (" + torch_dtype_name(c.k_cache.dtype) +
                      "), got " + torch_dtype_name(t->dtype));
  }
  if (c.lse.data) {
    check_rank(c.lse, "lse", 2, "[num_tokens, num_heads_q]");
    if (c.lse.shape[0] != T || c.lse.shape[1] != Hq)
      bad("lse must be [" + std::to_string(T) + ", " + std::to_string(Hq) + "], got " + shape_str(c.lse));
    if (c.lse.dtype != DType::kF32)
      throw TypeError(std::string("lse must be float32, got ") + torch_dtype_name(c.lse.dtype));
  }
  if (!std::isfinite(c.scale)) bad("softmax_scale must be finite, got " + std::to_string(c.scale));
  if (!(c.softcap >= 0.0f) || !std::isfinite(c.softcap))
    bad("logits_soft_cap must be a finite value >= 0 (0 = off), got " + std::to_string(c.softcap));
  if (c.window < 0) bad("sliding_window must be >= 0 (0 = off), got " + std::to_string(c.window));
}

// ---- new K/V rows ---------------------------------------------------------------

void write_rows(const BatchPlan& plan, const TensorRef& cache, const TensorRef& src) {
  const int64_t esize = element_size(cache.dtype);
  const int64_t H = cache.shape[2], D = cache.shape[3];
  const bool whole_token = (H == 1 || (cache.strides[2] == D && src.strides[1] == D));
  for (const Request& r : plan.requests()) {
    for (int64_t j = 0; j < r.query_len; ++j) {
      char* dst = cache.data + (r.reqid * cache.strides[0] + (r.cached_len + j) * cache.strides[1]) * esize;
      const char* from = src.data + (r.query_start + j) * src.strides[0] * esize;
      if (whole_token) {
        std::memcpy(dst, from, H * D * esize);
      } else {
        for (int64_t h = 0; h < H; ++h)
          std::memcpy(dst + h * cache.strides[2] * esize, from + h * src.strides[1] * esize, D * esize);
      }
    }
  }
}

// ---- split merges ---------------------------------------------------------------

template <class T>
void store_row(const TensorRef& out, int64_t token, int64_t head, const float* src, int d) {
  T* dst = reinterpret_cast<T*>(out.data) + token * out.strides[0] + head * out.strides[1];
  for (int x = 0; x < d; ++x) from_float(src[x], dst + x);
}

// Combines the splits of one group: O = sum_s e^(m_s - M) O_s / sum_s e^(m_s - M) l_s.
void merge(const Call& c, const Schedule::Group& g) {
  const Request& rq = c.requests[g.req];
  const int G = c.group_size, d = c.head_dim;
  const int rows_per_head = (g.q_end - g.q_begin) * G;
  const int rows = (g.head_end - g.head_begin) * rows_per_head;
  float row[kMaxHeadDim];
  for (int hr = 0; hr < rows; ++hr) {
    // The largest split max; a NaN one (a split that read a NaN) wins and stays, so the row comes out NaN.
    float m = -INFINITY;
    for (int s = 0; s < g.num_splits; ++s) {
      const float ms = c.partial_max[static_cast<int64_t>(g.first_partial + s) * c.rows_per_partial + hr];
      if (m == m && !(ms <= m)) m = ms;
    }
    float l = 0.0f;
    std::fill(row, row + d, 0.0f);
    if (m != -INFINITY) {
      for (int s = 0; s < g.num_splits; ++s) {
        const int64_t at = static_cast<int64_t>(g.first_partial + s) * c.rows_per_partial + hr;
        if (c.partial_max[at] == -INFINITY) continue;
        const float w = std::exp(c.partial_max[at] - m);
        l += w * c.partial_sum[at];
        const float* acc = c.partial_acc + at * d;
        for (int x = 0; x < d; ++x) row[x] += w * acc[x];
      }
    }
    const float inv = l == 0.0f ? 0.0f : 1.0f / l;
    for (int x = 0; x < d; ++x) row[x] *= inv;
    const int r = hr % rows_per_head;
    const int64_t token = rq.query_start + g.q_begin + r / G;
    const int64_t head = static_cast<int64_t>(g.head_begin + hr / rows_per_head) * G + r % G;
    with_storage_type(c.out.dtype, [&](auto tag) { store_row<decltype(tag)>(c.out, token, head, row, d); });
    if (c.lse.data)
      reinterpret_cast<float*>(c.lse.data)[token * c.lse.strides[0] + head * c.lse.strides[1]] =
          l == 0.0f ? -INFINITY : m + std::log(l);
  }
}

// ---- the job ------------------------------------------------------------------------

struct Job {
  const Call* call;
  const KernelTable* kernels;
  const Schedule* schedule;
  std::atomic<int32_t>* remaining;  // per group: splits not finished yet
};

void run_task(void* ctx, int64_t index, int64_t next, float* scratch) {
  const Job& job = *static_cast<const Job*>(ctx);
  const WorkItem& it = job.schedule->items[index];
  job.kernels->run_item(*job.call, it, next >= 0 ? &job.schedule->items[next] : nullptr, scratch);
  // the last split of a group merges it (acq_rel: it sees every other split's partials)
  if (it.group >= 0 && job.remaining[it.group].fetch_sub(1, std::memory_order_acq_rel) == 1)
    merge(*job.call, job.schedule->groups[it.group]);
}

// Where split items leave their partial results, and the per-group count of
// splits still running: buffers of the calling thread, grown on demand and
// reused by its later calls, so that a layer call does not allocate (and, on
// a many-core pool with many splits, page-fault in) megabytes every time.
// Every item writes its partial before the merge reads it: nothing needs zeroing.
class SplitBuffers {
 public:
  float* partials(size_t floats) {
    if (floats > partial_capacity_) {
      partials_.reset(new float[floats]);
      partial_capacity_ = floats;
    }
    return partials_.get();
  }
  std::atomic<int32_t>* counters(size_t groups) {
    if (groups > counter_capacity_) {
      counters_.reset(new std::atomic<int32_t>[groups]);
      counter_capacity_ = groups;
    }
    return counters_.get();
  }

 private:
  std::unique_ptr<float[]> partials_;
  size_t partial_capacity_ = 0;
  std::unique_ptr<std::atomic<int32_t>[]> counters_;
  size_t counter_capacity_ = 0;
};
thread_local SplitBuffers split_buffers;

// ---- values packed once per call -------------------------------------------------------

// The most a call packs: requests past it keep widening their V tiles in every block.
constexpr int64_t kMaxPackedBytes = int64_t{64} << 20;
constexpr int64_t kPackTokens = 256;  // tokens of one kv head per packing task

// One packing task: `tokens` rows of head_dim floats from `src` (rows `ld` floats apart) to `dst` (contiguous).
struct PackTask {
  const float* src;
  int64_t tokens;
  float* dst;
};

struct PackJob {
  const PackTask* tasks;
  int64_t ld;
  int32_t head_dim;
};

void run_pack_task(void* ctx, int64_t index, int64_t, float*) {
  const PackJob& job = *static_cast<const PackJob*>(ctx);
  const PackTask& t = job.tasks[index];
  for (int64_t i = 0; i < t.tokens; ++i)
    std::memcpy(t.dst + i * job.head_dim, t.src + i * job.ld, job.head_dim * sizeof(float));
}

// The packed values of the calling thread's calls: grown on demand, reused by its later calls.
struct PackBuffers {
  std::unique_ptr<float[]> values;
  size_t capacity = 0;
  std::vector<PackedValues> per_request;
  std::vector<PackTask> tasks;
};
thread_local PackBuffers pack_buffers;

// Packs the values of the requests with several query blocks (Schedule::multi_block_requests) where
// their blocks would otherwise copy every fp32 V tile they read (tokens a multiple of 1 KiB apart), up
// to kMaxPackedBytes in all, on the pool; returns Call::packed_values, or null where nothing was packed.
// Each kv head of such a request is read by all of its blocks: packing copies its values once, where
// the blocks copy them once each (a 2048-token prompt with 8 kv heads of 128: 128 blocks). 16-bit
// caches are not packed: their blocks widen each tile from half the bytes packed fp32 rows would
// stream, and packed, bf16 prefill of 4 prompts of 512 tokens (8 kv heads of 128) ran 0.97x as fast
// on the AVX2 path (docs/kernels.md).
const PackedValues* pack_values(const BatchPlan& plan, const Call& c, const Schedule& sched, ThreadPool& pool) {
  if (sched.multi_block_requests.empty() || c.v_cache.dtype != DType::kF32) return nullptr;
  const TensorRef& vc = c.v_cache;
  if (!values_copied(vc.dtype, vc.strides[1] * static_cast<int64_t>(sizeof(float)))) return nullptr;
  const std::vector<Request>& requests = plan.requests();
  PackBuffers& b = pack_buffers;
  b.per_request.assign(requests.size(), PackedValues{});
  b.tasks.clear();
  // first the requests that fit and their sizes (head_stride > 0 marks them), then one buffer for all
  int64_t floats = 0;
  for (int32_t i : sched.multi_block_requests) {
    const Request& r = requests[i];
    const int64_t first = c.window > 0 ? std::max<int64_t>(0, r.cached_len - c.window + 1) : 0;
    const int64_t head_floats = (r.cached_len + r.query_len - first) * c.head_dim;
    if ((floats + head_floats * c.num_heads_kv) * static_cast<int64_t>(sizeof(float)) > kMaxPackedBytes) continue;
    b.per_request[i] = PackedValues{nullptr, first, head_floats};
    floats += head_floats * c.num_heads_kv;
  }
  if (floats == 0) return nullptr;
  if (static_cast<size_t>(floats) > b.capacity) {
    b.values.reset(new float[floats]);
    b.capacity = static_cast<size_t>(floats);
  }
  float* at = b.values.get();
  for (int32_t i : sched.multi_block_requests) {
    PackedValues& p = b.per_request[i];
    if (p.head_stride == 0) continue;
    p.data = at;
    const int64_t tokens = p.head_stride / c.head_dim;
    for (int32_t h = 0; h < c.num_heads_kv; ++h)
      for (int64_t t0 = 0; t0 < tokens; t0 += kPackTokens) {
        const float* src = reinterpret_cast<const float*>(vc.data) + requests[i].reqid * vc.strides[0] +
                           (p.first_token + t0) * vc.strides[1] + h * vc.strides[2];
        b.tasks.push_back(PackTask{src, std::min(kPackTokens, tokens - t0), at + h * p.head_stride + t0 * c.head_dim});
      }
    at += p.head_stride * c.num_heads_kv;
  }
  PackJob job{b.tasks.data(), vc.strides[1], c.head_dim};
  pool.run(static_cast<int64_t>(b.tasks.size()), run_pack_task, &job, 0, sched.threads);
  packed_value_bytes.fetch_add(static_cast<uint64_t>(floats) * sizeof(float), std::memory_order_relaxed);
  return b.per_request.data();
}

// Bytes of a cache level a core has: sysconf's `name`, or `fallback` where the C library cannot tell.
int64_t cache_bytes(int name, int64_t fallback) {
  const long n = sysconf(name);
  return n > 0 ? static_cast<int64_t>(n) : fallback;
}

// L1 data (48 KiB where unknown: the size that keeps the decode's requests in L1).
int64_t l1d_bytes_per_core() {
  static const int64_t bytes = cache_bytes(_SC_LEVEL1_DCACHE_SIZE, int64_t{48} << 10);
  return bytes;
}

const KernelTable* kernels_of(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return scalar_kernels();
    case Isa::kAvx2: return avx2_kernels();
    case Isa::kAvx512: return avx512_kernels();
    case Isa::kNeon: return neon_kernels();
    case Isa::kSve: return sve_kernels();
    case Isa::kAmx: return amx_kernels();
    case Isa::kAvx512Bf16: return avx512_bf16_kernels();
  }
  return nullptr;
}

// Every path, fastest first: the order in which the default is picked and requests fall back.
constexpr Isa kFastestFirst[] = {Isa::kAmx, Isa::kAvx512Bf16, Isa::kAvx512, Isa::kAvx2,
                                  Isa::kSve, Isa::kNeon,        Isa::kScalar};

// The requested ISA, or the next lower supported one whose vector width divides head_dim.
Isa usable_isa(Isa requested, int head_dim) {
  bool reached = false;
  for (Isa isa : kFastestFirst) {
    reached = reached || isa == requested;
    if (reached && isa_supported(isa) && head_dim % kernels_of(isa)->vector_floats == 0) return isa;
  }
  return Isa::kScalar;
}

}  // namespace

// ---- plan and schedule ------------------------------------------------------------------

BatchPlan::BatchPlan(const std::vector<int64_t>& reqids, const std::vector<int64_t>& cached_lens,
                     const std::vector<int64_t>& query_lens) {
  if (reqids.size() != cached_lens.size() || reqids.size() != query_lens.size())
    bad("reqids, cached_lens and query_lens must have equal lengths, got " + std::to_string(reqids.size()) + ", " +
        std::to_string(cached_lens.size()) + ", " + std::to_string(query_lens.size()));
  if (reqids.empty()) bad("reqids must name at least one request");
  if (reqids.size() > (1u << 30)) bad("at most 2^30 requests per batch");
  std::vector<int64_t> sorted(reqids);
  std::sort(sorted.begin(), sorted.end());
  if (sorted.front() < 0 || std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    bad("reqids must be distinct non-negative ints");
  int64_t start = 0;
  for (size_t i = 0; i < reqids.size(); ++i) {
    if (cached_lens[i] < 0) bad("cached_lens must be >= 0, got " + std::to_string(cached_lens[i]));
    if (query_lens[i] < 1) bad("query_lens must be >= 1, got " + std::to_string(query_lens[i]));
    if (cached_lens[i] > (int64_t{1} << 40) || query_lens[i] > (int64_t{1} << 30))
      bad("cached_lens must be < 2^40 and query_lens < 2^30");
    requests_.push_back(Request{reqids[i], cached_lens[i], query_lens[i], start});
    start += query_lens[i];
    max_seq_len_ = std::max(max_seq_len_, cached_lens[i] + query_lens[i]);
  }
  if (start > (int64_t{1} << 31)) bad("at most 2^31 new tokens per batch");
  num_tokens_ = start;
  max_reqid_ = sorted.back();
}

std::shared_ptr<const Schedule> BatchPlan::schedule(int32_t group_size, int32_t heads_kv, int64_t window,
                                                    int threads, int32_t head_dim) const {
  // attention() validated these already; Plan.num_items reaches here directly
  if (group_size < 1 || heads_kv < 1) bad("group_size and heads_kv must be >= 1");
  if (window < 0) bad("window must be >= 0 (0 = off), got " + std::to_string(window));
  if (head_dim < 1 || head_dim > kMaxHeadDim)
    bad("head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "], got " + std::to_string(head_dim));
  const auto key = std::make_tuple(group_size, heads_kv, window, threads, head_dim);
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = schedules_.find(key);
  if (found != schedules_.end()) return found->second;

  auto sched = std::make_shared<Schedule>();
  // Whole items first: a decode (few rows per kv head) spans every kv head, so
  // its key tiles are runs of whole token rows; a prefill block takes one kv head.
  const int32_t block = std::max<int32_t>(1, kBlockRows / group_size);  // queries per prefill item
  std::vector<WorkItem> whole;
  for (size_t i = 0; i < requests_.size(); ++i) {
    const Request& r = requests_[i];
    const bool decode = r.query_len * group_size <= kDecodeRows;
    const int64_t blocks = decode ? 1 : (r.query_len + block - 1) / block;
    if (blocks > 1) sched->multi_block_requests.push_back(static_cast<int32_t>(i));
    const int64_t per_block = (r.query_len + blocks - 1) / blocks;  // balanced blocks
    for (int64_t q0 = 0; q0 < r.query_len; q0 += per_block) {
      const int64_t q1 = std::min(r.query_len, q0 + per_block);
      const int64_t k_end = r.cached_len + q1;  // the block's last query sees keys up to its own position
      const int64_t k_begin = window > 0 ? std::max<int64_t>(0, r.cached_len + q0 - window + 1) : 0;
      const int32_t step = decode ? heads_kv : 1;
      for (int32_t h = 0; h < heads_kv; h += step)
        whole.push_back(WorkItem{static_cast<int32_t>(i), h, h + step, static_cast<int32_t>(q0),
                                 static_cast<int32_t>(q1), k_begin, k_end, -1, -1});
    }
  }
  auto cost = [&](const WorkItem& it) {
    return static_cast<int64_t>(it.head_end - it.head_begin) * (it.q_end - it.q_begin) * group_size *
           (it.k_end - it.k_begin + 16);
  };
  double total = 0;
  for (const WorkItem& it : whole) total += static_cast<double>(cost(it));
  // a call too small to share runs on fewer threads (one: not split at all)
  threads = static_cast<int>(std::max(1.0, std::min<double>(threads, std::floor(total * head_dim / kMinThreadWork))));
  sched->threads = threads;
  // Then cut the large ones, keys first (long contexts), then kv heads, so that
  // every thread gets several items and the largest-first order can balance them.
  const double target = total / (static_cast<double>(threads) * kItemsPerThread);
  for (const WorkItem& it : whole) {
    const int64_t keys = it.k_end - it.k_begin;
    const int32_t heads = it.head_end - it.head_begin;
    const int32_t rows_per_head = (it.q_end - it.q_begin) * group_size;
    const int64_t want = threads > 1 ? static_cast<int64_t>(std::ceil(cost(it) / target)) : 1;
    int64_t key_splits = std::max<int64_t>(1, std::min(want, keys / kMinSplitKeys));
    const int32_t head_splits = static_cast<int32_t>(std::min<int64_t>(heads, (want + key_splits - 1) / key_splits));
    const int64_t tile = kMaxKeyTile;  // splits start on tile boundaries for any tile size that divides it
    const int64_t chunk = ((keys + key_splits - 1) / key_splits + tile - 1) / tile * tile;
    key_splits = (keys + chunk - 1) / chunk;
    for (int32_t hs = 0; hs < head_splits; ++hs) {
      WorkItem part = it;
      part.head_begin = it.head_begin + static_cast<int32_t>(static_cast<int64_t>(heads) * hs / head_splits);
      part.head_end = it.head_begin + static_cast<int32_t>(static_cast<int64_t>(heads) * (hs + 1) / head_splits);
      const int32_t rows = (part.head_end - part.head_begin) * rows_per_head;
      sched->max_rows = std::max<int64_t>(sched->max_rows, rows);
      sched->max_rows_per_head = std::max(sched->max_rows_per_head, rows_per_head);
      if (key_splits <= 1) {
        sched->items.push_back(part);
        continue;
      }
      const int32_t group = static_cast<int32_t>(sched->groups.size());
      sched->groups.push_back(Schedule::Group{part.req, part.head_begin, part.head_end, part.q_begin, part.q_end,
                                              sched->num_partials, static_cast<int32_t>(key_splits)});
      sched->rows_per_partial = std::max(sched->rows_per_partial, rows);
      for (int64_t s = 0; s < key_splits; ++s) {
        WorkItem split = part;
        split.k_begin = it.k_begin + s * chunk;
        split.k_end = std::min(it.k_end, split.k_begin + chunk);
        split.group = group;
        split.partial = sched->num_partials++;
        sched->items.push_back(split);
      }
    }
  }
  // Largest first: dynamic claiming then balances the tail.
  std::stable_sort(sched->items.begin(), sched->items.end(),
                   [&](const WorkItem& a, const WorkItem& b) { return cost(a) > cost(b); });
  schedules_.emplace(key, sched);
  return sched;
}

// ---- entry ----------------------------------------------------------------------

Isa attention(const BatchPlan& plan, Call c, const TensorRef* k_new, const TensorRef* v_new, Isa requested) {
  validate(plan, c, k_new, v_new);
  c.requests = plan.requests().data();
  c.num_heads_q = static_cast<int32_t>(c.q.shape[1]);
  c.num_heads_kv = static_cast<int32_t>(c.k_cache.shape[2]);
  c.group_size = c.num_heads_q / c.num_heads_kv;
  c.head_dim = static_cast<int32_t>(c.q.shape[2]);
  const Isa isa = usable_isa(requested, c.head_dim);

  if (k_new) {  // the step's rows first: the queries attend to them
    write_rows(plan, c.k_cache, *k_new);
    write_rows(plan, c.v_cache, *v_new);
  }
  ThreadPool& pool = ThreadPool::instance();
  const auto sched = plan.schedule(c.group_size, c.num_heads_kv, c.window, pool.threads(), c.head_dim);
  std::atomic<int32_t>* remaining = nullptr;
  if (sched->num_partials > 0) {
    const int64_t partial_rows = static_cast<int64_t>(sched->num_partials) * sched->rows_per_partial;
    c.partial_acc = split_buffers.partials(static_cast<size_t>(partial_rows * (c.head_dim + 2)));
    c.partial_max = c.partial_acc + partial_rows * c.head_dim;
    c.partial_sum = c.partial_max + partial_rows;
    c.rows_per_partial = sched->rows_per_partial;
    remaining = split_buffers.counters(sched->groups.size());
    for (size_t g = 0; g < sched->groups.size(); ++g) remaining[g].store(sched->groups[g].num_splits);
  }
  c.prefetch_to_l2 = decode_prefetch_to_l2();
  c.packed_values = pack_values(plan, c, *sched, pool);
  Job job{&c, kernels_of(isa), sched.get(), remaining};
  pool.run(static_cast<int64_t>(sched->items.size()), run_task, &job,
           scratch_floats(sched->max_rows, sched->max_rows_per_head, c.head_dim), sched->threads);
  call_counts[static_cast<int>(isa)].fetch_add(1, std::memory_order_relaxed);
  return isa;
}

uint64_t calls(Isa isa) { return call_counts[static_cast<int>(isa)].load(std::memory_order_relaxed); }

bool decode_prefetch_to_l2() { return l1d_bytes_per_core() < (int64_t{48} << 10); }

uint64_t packed_bytes() { return packed_value_bytes.load(std::memory_order_relaxed); }

// ---- ISA choice -----------------------------------------------------------------------

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kNeon: return "neon";
    case Isa::kSve: return "sve256";
    case Isa::kAmx: return "amx";
    case Isa::kAvx512Bf16: return "avx512_bf16";
  }
  return "?";
}

std::string isa_names() {
  std::string names;
  for (int i = 0; i < kNumIsas; ++i) names += std::string(i ? ", " : "") + isa_name(static_cast<Isa>(i));
  return names;
}

bool parse_isa(const std::string& name, Isa* isa) {
  for (int i = 0; i < kNumIsas; ++i) {
    if (name == isa_name(static_cast<Isa>(i))) {
      *isa = static_cast<Isa>(i);
      return true;
    }
  }
  return false;
}

bool isa_compiled(Isa isa) { return kernels_of(isa) != nullptr; }

namespace {

#if defined(__x86_64__)
// AVX512_BF16 (CPUID leaf 7 subleaf 1, EAX bit 5) and AVX512BW (leaf 7 subleaf 0, EBX bit 30), which
// the VDPBF16PS functions are built with (read directly: not every compiler's __builtin_cpu_supports
// knows "avx512bf16"; the OS's support of the AVX-512 state is __builtin_cpu_supports("avx512f")'s)
bool cpu_has_avx512_bf16() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(ebx & (1u << 30)) || eax < 1) return false;
  return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 5));
}
#endif

// What the CPU and OS offer; asked once per process (isa_supported), since every
// layer call consults it (on AArch64 the SVE check is a system call).
bool detect_isa(Isa isa) {
  if (!isa_compiled(isa)) return false;
  switch (isa) {
    case Isa::kScalar: return true;
#if defined(__x86_64__)
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::kAvx512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c");
    case Isa::kAvx512Bf16:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c") && cpu_has_avx512_bf16();
    case Isa::kAmx: {
      // CPUID leaf 7, subleaf 0, EDX: AMX-BF16 is bit 22, AMX-TILE bit 24 (read directly:
      // not every compiler's __builtin_cpu_supports knows the AMX names)
      unsigned eax, ebx, ecx, edx;
      if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 22)) || !(edx & (1u << 24)) ||
          !__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("f16c") || !cpu_has_avx512_bf16())
        return false;
      // Linux (5.16+) hands a process the 8 KiB tile state only when asked
      // (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it a
      // tile instruction kills the process. The permission covers every thread.
      constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
      return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
    }
#endif
#if defined(__aarch64__)
    case Isa::kNeon: return (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0;
    case Isa::kSve: {  // the unit is built for 256-bit vectors: the thread's length must be exactly that
      if (!(getauxval(AT_HWCAP) & HWCAP_SVE)) return false;
      const int vl = prctl(PR_SVE_GET_VL, 0, 0, 0, 0);
      return vl >= 0 && (vl & PR_SVE_VL_LEN_MASK) == 32;
    }
#endif
    default: return false;
  }
}

}  // namespace

bool isa_supported(Isa isa) {
  static const auto supported = [] {
    std::array<bool, kNumIsas> out{};
    for (int i = 0; i < kNumIsas; ++i) out[i] = detect_isa(static_cast<Isa>(i));
    return out;
  }();
  return supported[static_cast<int>(isa)];
}

Isa best_isa() {
  for (Isa isa : kFastestFirst)
    if (isa_supported(isa)) return isa;
  return Isa::kScalar;
}

Isa default_isa(std::string* note) {
  const Isa best = best_isa();
  const char* env = std::getenv("VATTN_CPU_ATTN_ISA");
  if (!env || !*env) return best;
  Isa wanted;
  if (!parse_isa(env, &wanted)) {
    if (note) *note = std::string("VATTN_CPU_ATTN_ISA=") + env + " is not one of " + isa_names() + "; ignored";
    return best;
  }
  if (!isa_supported(wanted)) {
    if (note) *note = std::string("VATTN_CPU_ATTN_ISA=") + env + " is not supported here; using " + isa_name(best);
    return best;
  }
  return wanted;
}

int pool_threads() { return ThreadPool::instance().threads(); }

std::string pool_kind() { return ThreadPool::instance().kind(); }

}  // namespace cpu_attn
}  // namespace vattn
