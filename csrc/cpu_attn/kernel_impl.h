// The attention kernel, written once over `Vec` (one ISA's vector type and
// operations). Each ISA unit includes this inside its own anonymous
// namespace after defining Vec, so every function here has internal
// linkage and is compiled with that unit's target flags only.
//
// One work item = the G query heads of one kv head for a block of queries
// of one request, over a range of that request's keys. Its rows (query j,
// head g -> row j * G + g) share every K/V load. Keys are visited in tiles:
//
//   S = (scale * Q) K_tile^T           rows x tile, dot products, fp32
//   S = softcap * tanh(S / softcap)    optional
//   mask: causal (key <= query position), sliding window (key > position - window)
//   online softmax: m' = max(m, rowmax S), P = exp(S - m'), l = l e^(m - m') + rowsum P
//   O = O e^(m - m') + P V_tile
//
// and the item ends with O / l (or, for a split, writes O, m, l for the merge).
// K/V stay in their storage type in the cache and are widened to fp32 in
// registers; prefill blocks widen each tile once into scratch instead, since
// every row block re-reads it (or, for a prompt of several blocks in an fp32
// cache, read V from the call's packed values: run_item_typed). A decode item (all kv heads) computes every
// head's S for a tile before any softmax and P V, so the K tile and then the V
// tile are each read in one pass (fp32 decode of 8 kv heads ran 1.1-1.3x
// faster than with K and V interleaved head by head, on a 2-core AVX2 VM).
#pragma once

constexpr float kNegInf = -__builtin_inff();

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

// 64-byte aligned start at or after p
inline float* align64(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~static_cast<uintptr_t>(63));
}

using R = Vec::R;
constexpr int W = Vec::W;

// Asks for the cache line holding p ahead of use, from inside the Q K^T and P V loops: into L2 only
// where kToL2 (Call::prefetch_to_l2: cores whose L1 data cache is under 48 KiB), else into L1. A
// template argument, not a run-time flag: a flag tested in the loops, or one more argument, cost
// bf16 decode up to 7% where nothing was requested at all.
template <bool kToL2>
inline void prefetch_line(const void* p) {
  __builtin_prefetch(p, 0, kToL2 ? 1 : 3);
}

// The address `bytes` on from p, as integers: a line requested from inside a loop over one of the K and V
// allocations may lie in the other.
inline const void* bytes_on(const void* p, int64_t bytes) {
  return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes));
}

// f(std::true_type) where to_l2, else f(std::false_type): the kToL2 of the Q K^T and P V called in f.
template <class F>
inline void with_prefetch_hint(bool to_l2, F&& f) {
  if (to_l2)
    f(std::true_type{});
  else
    f(std::false_type{});
}

// f(std::true_type) where pairs, else f(std::false_type): the kPairs of the Q K^T and P V called in f.
// kCan false (a unit whose Vec has no bf16 pairs, or a cache of another type) never instantiates the
// pairs.
template <bool kCan, class F>
inline void with_pairs(bool pairs, F&& f) {
  if constexpr (kCan)
    if (pairs) {
      f(std::true_type{});
      return;
    }
  f(std::false_type{});
}

// Whether Vec widens bf16 2 W elements at a time into two vectors in an order of its own
// (Vec::load_bf16_pairs, Vec::pair_element and kBf16Pairs: vec_avx2.h, vec_avx512.h)
template <class V, class = void>
struct HasBf16Pairs : std::false_type {};
template <class V>
struct HasBf16Pairs<V, std::void_t<decltype(V::kBf16Pairs)>> : std::bool_constant<V::kBf16Pairs> {};

// vv[0, NV) = the NV W-element vectors of the row at `row`, widened to fp32. kPairs (bf16 rows, NV
// even): each 2W-element chunk c as two vectors vv[2c], vv[2c + 1] in Vec's pair order (position i of
// the two holds element Vec::pair_element(i)), so that what is multiplied with them (the queries) or
// accumulated from them (P V) holds each chunk in that order too (pair_rows). V is a parameter so that
// the name is looked up only where kPairs is instantiated.
template <bool kPairs, int NV, class T, class V = Vec>
__attribute__((always_inline)) inline void load_values(const T* row, R* vv) {
  if constexpr (kPairs) {
    static_assert(NV % 2 == 0, "whole chunks of 2 W elements");
    for (int c = 0; c < NV / 2; ++c) V::load_bf16_pairs(row + 2 * c * W, vv[2 * c], vv[2 * c + 1]);
  } else {
    for (int c = 0; c < NV; ++c) vv[c] = V::load(row + c * W);
  }
}

// rows[r] of n rows of d floats, each 2W-element chunk reordered: into Vec's pair order (kToPairs: the
// queries of a Q K^T in pairs) or from it back to element order (an accumulator of P V in pairs). Every
// index a constant (the loop unrolled): a run-time order here cost small bf16 decodes (5-35 us) 2-5% on
// the AVX-512 paths of a 2-core Zen 4.
template <bool kToPairs, class V = Vec>
inline void pair_rows(float* rows, int64_t n, int d) {
  float chunk[2 * W];
  for (int64_t r = 0; r < n; ++r)
    for (int x = 0; x < d; x += 2 * W) {
      float* at = rows + r * d + x;
      for (int i = 0; i < 2 * W; ++i) chunk[i] = at[i];
#pragma GCC unroll 32
      for (int i = 0; i < 2 * W; ++i) {
        if constexpr (kToPairs)
          at[i] = chunk[V::pair_element(i)];
        else
          at[V::pair_element(i)] = chunk[i];
      }
    }
}

// ---- Q K^T: dot products, MR rows x NT keys per register block -------------------

// The first pf_n of the NT keys also ask for the lines of the row pf_bytes bytes on from each key's
// row (a row of the V tile or of the next K tile: run_item_typed's request rule), one line at a time
// between the FMAs, so that the misses overlap the work (pf_n <= 0: none), into L2 where kToL2
// (prefetch_line). pv_block does the same from the V rows.
// Always inlined into its key loop (qk_rows), as qk_dot_pairs_block is: out of line it was a call per
// register block (2 keys on AVX2) with its accumulators zeroed and pointers spilled each time.
// kPairs (bf16 K, d a multiple of 2 W): K widened a chunk of 2 W at a time (load_values), q in pair order.
template <class T, int MR, int NT, bool kToL2, bool kPairs>
__attribute__((always_inline)) inline void qk_block(const float* q, int64_t ldq, const T* k, int64_t ldk, int d,
                                                    float* s, int64_t lds, int64_t pf_bytes, int64_t pf_n) {
  constexpr int KV = kPairs ? 2 : 1;  // vectors of each key per step
  R acc[MR * NT];
  for (int i = 0; i < MR * NT; ++i) acc[i] = Vec::zero();
  for (int x = 0; x < d; x += KV * W) {
    if (((x * static_cast<int64_t>(sizeof(T))) & 63) == 0)
      for (int t = 0; t < NT && t < pf_n; ++t) prefetch_line<kToL2>(bytes_on(k + t * ldk + x, pf_bytes));
    R kv[NT][KV];
    for (int t = 0; t < NT; ++t) load_values<kPairs, KV>(k + t * ldk + x, kv[t]);
    for (int c = 0; c < KV; ++c)
      for (int r = 0; r < MR; ++r) {
        R qv = Vec::load(q + r * ldq + x + c * W);
        Vec::keep(qv);
        for (int t = 0; t < NT; ++t) acc[r * NT + t] = Vec::fma(qv, kv[t][c], acc[r * NT + t]);
      }
  }
  float sums[MR * NT];
  Vec::hsum_n(acc, MR * NT, sums);
  for (int r = 0; r < MR; ++r)
    for (int t = 0; t < NT; ++t) s[r * lds + t] = sums[r * NT + t];
}

template <class T, int MR, bool kToL2, bool kPairs>
inline void qk_rows(const float* q, int64_t ldq, const T* k, int64_t ldk, int64_t n, int d, float* s, int64_t lds,
                    int64_t pf_bytes, int64_t pf_n) {
  // as many sums per block as hsum_n reduces in one tree: 16 at AVX-512's width, else 8
  constexpr int kSums = W >= 16 ? 16 : 8;
  constexpr int NT = kSums / MR;
  int64_t t = 0;
  for (; t + NT <= n; t += NT)
    qk_block<T, MR, NT, kToL2, kPairs>(q, ldq, k + t * ldk, ldk, d, s + t, lds, pf_bytes, pf_n - t);
  for (; t < n; ++t) qk_block<T, MR, 1, kToL2, kPairs>(q, ldq, k + t * ldk, ldk, d, s + t, lds, pf_bytes, pf_n - t);
}

// s[r][t] = q[r] . k[t] for r < rows, t < n; prefetches, for keys [0, pf_n), the row pf_bytes bytes on
// (into L2 where kToL2). kPairs (bf16 K, d a multiple of 2 W): q's rows in Vec's pair order (pair_rows).
template <class T, bool kToL2 = false, bool kPairs = false>
void qk(const float* q, int64_t ldq, int rows, const T* k, int64_t ldk, int64_t n, int d, float* s, int64_t lds,
        int64_t pf_bytes = 0, int64_t pf_n = 0) {
  int r = 0;
  for (; r + 4 <= rows; r += 4, pf_n = 0)  // the first row block prefetches
    qk_rows<T, 4, kToL2, kPairs>(q + r * ldq, ldq, k, ldk, n, d, s + r * lds, lds, pf_bytes, pf_n);
  switch (rows - r) {
    case 3: qk_rows<T, 3, kToL2, kPairs>(q + r * ldq, ldq, k, ldk, n, d, s + r * lds, lds, pf_bytes, pf_n); break;
    case 2: qk_rows<T, 2, kToL2, kPairs>(q + r * ldq, ldq, k, ldk, n, d, s + r * lds, lds, pf_bytes, pf_n); break;
    case 1: qk_rows<T, 1, kToL2, kPairs>(q + r * ldq, ldq, k, ldk, n, d, s + r * lds, lds, pf_bytes, pf_n); break;
    default: break;
  }
}

// ---- P V: MR rows x NV vectors of head_dim per register block -------------------

template <class T, int MR, int NV, bool kToL2, bool kPairs = false>
inline void pv_block(const float* p, int64_t ldp, int64_t ldpt, const float* alpha, const T* v, int64_t ldv, int64_t n, float* o,
                     int64_t ldo, int64_t pf_bytes, int64_t pf_n) {
  constexpr int kBytes = NV * W * static_cast<int>(sizeof(T));  // of each key row this block reads
  R acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    const R a = Vec::set1(alpha[r]);
    for (int c = 0; c < NV; ++c) acc[r][c] = Vec::mul(Vec::load(o + r * ldo + c * W), a);
  }
  for (int64_t t = 0; t < n; ++t) {
    if (t < pf_n)
      for (int b = 0; b < kBytes; b += 64)
        prefetch_line<kToL2>(bytes_on(v + t * ldv, pf_bytes + b));
    R vv[NV];
    load_values<kPairs, NV>(v + t * ldv, vv);
    for (int r = 0; r < MR; ++r) {
      const R pr = Vec::set1(p[r * ldp + t * ldpt]);
      for (int c = 0; c < NV; ++c) acc[r][c] = Vec::fma(pr, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) Vec::store(o + r * ldo + c * W, acc[r][c]);
}

// (a block that starts mid-line leaves that line to the block before it)
template <class T, int MR, bool kToL2, bool kPairs>
inline void pv_rows(const float* p, int64_t ldp, int64_t ldpt, const float* alpha, const T* v, int64_t ldv, int64_t n, int d,
                    float* o, int64_t ldo, int64_t pf_bytes, int64_t pf_n) {
  // 16-float vectors (32 registers): 4 rows x 4 vectors, so that a head_dim of 64 takes one pass over the keys.
  // 8-float vectors (16 registers): 4 vectors for up to 2 rows too (8 accumulators, 4 V vectors, a
  // broadcast), so that a decode item of a 2-query-head group reads each V tile in half the passes: against
  // 2 vectors, fp32 and bf16 decode of 4 q / 2 kv heads of 128 ran 1.06-1.25x faster on a 2-core AVX2 VM
  // (benchmarks/host_kernel_ab.py, cold and warm, with the 16 KiB tiles of run_item_typed); prefill stayed
  // within the spread of two equal builds.
  constexpr int NV = MR <= 2 || W >= 16 ? 4 : 2;
  auto pf_at = [&](int x) { return ((x * static_cast<int64_t>(sizeof(T))) & 63) == 0 ? pf_n : 0; };
  int x = 0;
  for (; x + NV * W <= d; x += NV * W)
    pv_block<T, MR, NV, kToL2, kPairs>(p, ldp, ldpt, alpha, v + x, ldv, n, o + x, ldo, pf_bytes, pf_at(x));
  if constexpr (kPairs)  // d a multiple of 2 W
    for (; x < d; x += 2 * W)
      pv_block<T, MR, 2, kToL2, true>(p, ldp, ldpt, alpha, v + x, ldv, n, o + x, ldo, pf_bytes, pf_at(x));
  else
    for (; x < d; x += W) pv_block<T, MR, 1, kToL2>(p, ldp, ldpt, alpha, v + x, ldv, n, o + x, ldo, pf_bytes, pf_at(x));
}

// o[r] = alpha[r] o[r] + sum_t p[r][t] v[t] for r < rows, p[r][t] at p + r * ldp + t * ldpt; prefetches
// for keys [0, pf_n) the row pf_bytes bytes on (into L2 where kToL2). kPairs (bf16 V, d a multiple of
// 2 W): o holds each 2W-element chunk as its even then its odd elements (load_values).
template <class T, bool kToL2 = false, bool kPairs = false>
void pv(const float* p, int64_t ldp, int64_t ldpt, const float* alpha, int rows, const T* v, int64_t ldv, int64_t n, int d,
        float* o, int64_t ldo, int64_t pf_bytes = 0, int64_t pf_n = 0) {
  int r = 0;
  for (; r + 4 <= rows; r += 4, pf_n = 0)  // the first row block prefetches
    pv_rows<T, 4, kToL2, kPairs>(p + r * ldp, ldp, ldpt, alpha + r, v, ldv, n, d, o + r * ldo, ldo, pf_bytes, pf_n);
  switch (rows - r) {
    case 3: pv_rows<T, 3, kToL2, kPairs>(p + r * ldp, ldp, ldpt, alpha + r, v, ldv, n, d, o + r * ldo, ldo, pf_bytes, pf_n); break;
    case 2: pv_rows<T, 2, kToL2, kPairs>(p + r * ldp, ldp, ldpt, alpha + r, v, ldv, n, d, o + r * ldo, ldo, pf_bytes, pf_n); break;
    case 1: pv_rows<T, 1, kToL2, kPairs>(p + r * ldp, ldp, ldpt, alpha + r, v, ldv, n, d, o + r * ldo, ldo, pf_bytes, pf_n); break;
    default: break;
  }
}

// ---- rows in and out --------------------------------------------------------------

template <class T>
inline void load_scaled(const T* src, float scale, int d, float* dst) {
  const R s = Vec::set1(scale);
  for (int x = 0; x < d; x += W) Vec::store(dst + x, Vec::mul(Vec::load(src + x), s));
}

template <class T>
inline void store_scaled(const float* src, float scale, int d, T* dst) {
  const R s = Vec::set1(scale);
  for (int x = 0; x < d; x += W) Vec::store(dst + x, Vec::mul(Vec::load(src + x), s));
}

template <class T>
inline void widen_rows(const T* src, int64_t ld, int64_t n, int d, float* dst) {
  for (int64_t t = 0; t < n; ++t)
    for (int x = 0; x < d; x += W) Vec::store(dst + t * d + x, Vec::load(src + t * ld + x));
}

inline const char* element(const TensorRef& t, int64_t i0, int64_t i1) {
  return t.data + (i0 * t.strides[0] + i1 * t.strides[1]) * element_size(t.dtype);
}

inline void load_query_row(const TensorRef& q, int64_t token, int64_t head, float scale, int d, float* dst) {
  const char* p = element(q, token, head);
  with_storage_type(q.dtype, [&](auto tag) { load_scaled(reinterpret_cast<const decltype(tag)*>(p), scale, d, dst); });
}

inline void store_output_row(const TensorRef& out, int64_t token, int64_t head, const float* src, float scale,
                             int d) {
  char* p = const_cast<char*>(element(out, token, head));
  with_storage_type(out.dtype, [&](auto tag) { store_scaled(src, scale, d, reinterpret_cast<decltype(tag)*>(p)); });
}

// Asks for tokens [0, n) of a tile ahead of use: `bytes` from each token's
// start, tokens `ld` elements apart, into L1. A request's tokens are
// heads * head_dim (per_layer) or layers * heads * head_dim (all_layers)
// elements apart, a stride the hardware prefetchers follow poorly; requesting
// the next tile while this one computes keeps many misses in flight.
// Prefetches never fault, and these stay inside the request's mapped rows.
template <class T>
inline void prefetch_tokens(const T* first, int64_t ld, int64_t n, int64_t bytes) {
  for (int64_t t = 0; t < n; ++t) {
    const char* p = reinterpret_cast<const char*>(first + t * ld);
    const char* line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63});
    for (; line < p + bytes; line += 64) __builtin_prefetch(line, 0, 3);
  }
}

// ---- online softmax over one tile ---------------------------------------------------

// Rows r < RB of the scores, row r at s + r * lds: keys k0 .. k0 + n - 1, of which [lo, hi) are visible
// (visible(r, lo, hi)). Each row turns into probabilities relative to its new running max (0 outside
// [lo, hi) and up to the padded width); m[r] and l[r] are updated and alpha[r] = e^(m_old - m_new), the
// factor the row's accumulator is scaled by. The RB rows go through each pass together, so that their
// dependency chains (the max, the exponentials' sum, the reductions) overlap, and their alphas take one
// vector exponential instead of a libm call each: one row at a time, a decode tile's softmax waited on
// each row's chains in turn (about 2.7 ns a key and kv head in a loop of it alone on a 2-core Zen 4, AVX2
// path, 8 q / 2 kv heads of 64, 64-key tiles; 1.5 ns this way). In the kernel the rest of a tile's work
// hides most of that: 1-3% faster at some points, within noise at most (docs/kernels.md, "Small warm
// calls: the softmax of a tile's rows").
template <int RB, class Visible>
inline void softmax_rows(float* s, int64_t lds, int64_t n, Visible visible, float softcap, float* m, float* l,
                         float* alpha) {
  const int64_t padded = (n + W - 1) / W * W;
  bool seen[RB];  // a visible key in this tile
  for (int r = 0; r < RB; ++r) {
    float* row = s + r * lds;
    int64_t lo = 0, hi = 0;
    visible(r, lo, hi);
    seen[r] = hi > lo;
    if (!seen[r]) {  // nothing visible: zeros, which the passes below keep (their shift is +inf)
      for (int64_t i = 0; i < padded; ++i) row[i] = 0.0f;
      continue;
    }
    if (softcap > 0.0f) {
      const R cap = Vec::set1(softcap), inv = Vec::set1(1.0f / softcap);
      for (int64_t i = 0; i < padded; i += W)
        Vec::store(row + i, Vec::mul(cap, Vec::tanh(Vec::mul(Vec::load(row + i), inv))));
    }
    for (int64_t i = 0; i < lo; ++i) row[i] = kNegInf;
    for (int64_t i = hi; i < padded; ++i) row[i] = kNegInf;
  }
  R mv[RB];
  for (int r = 0; r < RB; ++r) mv[r] = Vec::set1(kNegInf);
  for (int64_t i = 0; i < padded; i += W)
    for (int r = 0; r < RB; ++r) mv[r] = Vec::max(mv[r], Vec::load(s + r * lds + i));
  float m_new[RB];
  R shift[RB], sum[RB];
  for (int r = 0; r < RB; ++r) {
    const float tile_max = Vec::hmax(mv[r]);
    m_new[r] = m[r] > tile_max ? m[r] : tile_max;
    shift[r] = Vec::set1(seen[r] ? m_new[r] : __builtin_inff());
    sum[r] = Vec::zero();
  }
  for (int64_t i = 0; i < padded; i += W)
    for (int r = 0; r < RB; ++r) {
      const R e = Vec::exp(Vec::sub(Vec::load(s + r * lds + i), shift[r]));
      Vec::store(s + r * lds + i, e);
      sum[r] = Vec::add(sum[r], e);
    }
  // the RB rows' e^(m_old - m_new) by vector exponentials (0 where m_old is -inf: Vec::exp)
  constexpr int kDecay = (RB + W - 1) / W * W;
  float decay[kDecay] = {};
  for (int r = 0; r < RB; ++r) decay[r] = m[r] == kNegInf ? kNegInf : m[r] - m_new[r];
  for (int i = 0; i < kDecay; i += W) Vec::store(decay + i, Vec::exp(Vec::load(decay + i)));
  for (int r = 0; r < RB; ++r) {
    if (!seen[r]) {
      alpha[r] = 1.0f;
      continue;
    }
    alpha[r] = decay[r];
    const float tile_sum = Vec::hsum(sum[r]);
    l[r] = l[r] * alpha[r] + tile_sum;
    // A NaN score (a NaN in q or K) gives NaN probabilities, but x86's max drops NaN operands, so the
    // max may not show it: make the row's max NaN from then on, or a split that read the NaN could
    // report a max of -inf and be skipped by the merge.
    m[r] = (tile_sum != tile_sum || m[r] != m[r]) ? __builtin_nanf("") : m_new[r];
  }
}

// softmax_rows over `rows` rows, four at a time
template <class Visible>
inline void softmax_tile_rows(float* s, int64_t lds, int rows, int64_t n, Visible visible, float softcap, float* m,
                              float* l, float* alpha) {
  int r0 = 0;
  const auto from = [&](int first) {
    return [&visible, first](int r, int64_t& lo, int64_t& hi) { visible(first + r, lo, hi); };
  };
  for (; r0 + 4 <= rows; r0 += 4)
    softmax_rows<4>(s + r0 * lds, lds, n, from(r0), softcap, m + r0, l + r0, alpha + r0);
  switch (rows - r0) {
    case 3: softmax_rows<3>(s + r0 * lds, lds, n, from(r0), softcap, m + r0, l + r0, alpha + r0); break;
    case 2: softmax_rows<2>(s + r0 * lds, lds, n, from(r0), softcap, m + r0, l + r0, alpha + r0); break;
    case 1: softmax_rows<1>(s + r0 * lds, lds, n, from(r0), softcap, m + r0, l + r0, alpha + r0); break;
    default: break;
  }
}

#ifdef VATTN_AMX_BF16
// ---- AMX-BF16 tiles: prefill blocks of a bf16 cache ---------------------------------
//
// A unit that defines VATTN_AMX_BF16 has the tile intrinsics (_tile_loadconfig,
// _tile_loadd, _tile_stored, _tile_zero, _tile_dpbf16ps, _tile_release) in
// scope. TDPBF16PS C += A B reads A's dword k of row m and B's dword n of row
// k as bf16 pairs: C[m][n] += A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1]. Four
// tiles, each 16 rows x 64 bytes: tmm0 = C (16 x 16 fp32), tmm1 / tmm3 = A
// (16 rows x 32 bf16), tmm2 = B (16 pair rows x 16 dwords). K and V are bf16
// already; Q and P (fp32) go in as two bf16 terms, x = hi + lo with hi =
// bf16(x) and lo = bf16(x - hi), so that the products keep about 16 bits of
// Q and P, and scores, LSE and outputs stay as accurate as on the other paths
// (one bf16 term gave LSE errors of ~5e-3) for twice the tile work.

struct TileConfig {  // palette 1: the layout ldtilecfg reads
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

constexpr int kTileRows = 16;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline uint32_t bf16_pair(uint16_t lo, uint16_t hi) { return lo | static_cast<uint32_t>(hi) << 16; }

// B of a tile product C = A B, B[r][j] = src[r * r_stride + j * j_stride] for
// r < rows (the reduced dimension) and j < cols, as B tiles: for each chunk c
// of 32 r and block b of 16 j, 16 rows (r pairs) x 16 dwords; zero past rows
// and cols, up to `chunks` chunks. Q K^T takes K this way transposed (r: head
// dim, j: keys), P V takes V as it is (r: keys, j: head dim).
inline void pack_b_tiles(const bf16* src, int64_t r_stride, int64_t j_stride, int64_t rows, int64_t cols,
                         int64_t chunks, uint32_t* out) {
  const int64_t blocks = (cols + kTileRows - 1) / kTileRows;
  auto at = [&](int64_t r, int64_t j) -> uint16_t {
    return r < rows && j < cols ? src[r * r_stride + j * j_stride].bits : 0;
  };
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t b = 0; b < blocks; ++b) {
      uint32_t* tile = out + (c * blocks + b) * 256;
      for (int p = 0; p < 16; ++p) {
        const int64_t r = c * 32 + 2 * p;
        for (int x = 0; x < 16; ++x) tile[p * 16 + x] = bf16_pair(at(r, b * 16 + x), at(r + 1, b * 16 + x));
      }
    }
}

// rows x cols fp32 (row stride ld) -> two bf16 terms hi + lo, rows of width `width` each
// (zero past cols and rows, up to rows_pad); cols a multiple of W
inline void to_bf16_terms(const float* src, int64_t ld, int rows, int rows_pad, int64_t cols, int64_t width,
                          bf16* hi, bf16* lo) {
  for (int r = 0; r < rows_pad; ++r) {
    bf16* h = hi + r * width;
    bf16* l = lo + r * width;
    int64_t x = 0;
    if (r < rows)
      for (; x < cols; x += W) {
        const R v = Vec::load(src + r * ld + x);
        Vec::store(h + x, v);
        Vec::store(l + x, Vec::sub(v, Vec::load(h + x)));
      }
    for (; x < width; ++x) h[x].bits = l[x].bits = 0;
  }
}

// C tile (tmm0) = (a_hi + a_lo) B over `chunks` chunks of 32 A columns: A rows
// `lda` bf16 apart, chunk c's B tile at b_tiles + c * b_step dwords
inline void tile_product(const bf16* a_hi, const bf16* a_lo, int64_t lda, int64_t chunks, const uint32_t* b_tiles,
                         int64_t b_step) {
  _tile_zero(0);
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(2, b_tiles + c * b_step, 64);
    _tile_loadd(1, a_hi + c * 32, lda * 2);
    _tile_loadd(3, a_lo + c * 32, lda * 2);
    _tile_dpbf16ps(0, 1, 2);
    _tile_dpbf16ps(0, 3, 2);
  }
}

// s[r][t] = q[r] . k[t], r < rows_pad (a multiple of 16), t < round_up(n, 16)
inline void qk_tiles(const bf16* q_hi, const bf16* q_lo, int d_pad, int rows_pad, const uint32_t* k_tiles, int64_t n,
                     float* s, int64_t lds) {
  const int64_t blocks = (n + kTileRows - 1) / kTileRows;
  for (int r0 = 0; r0 < rows_pad; r0 += kTileRows)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = static_cast<int64_t>(r0) * d_pad;
      tile_product(q_hi + at, q_lo + at, d_pad, d_pad / 32, k_tiles + b * 256, blocks * 256);
      _tile_stored(0, s + r0 * lds + b * kTileRows, lds * 4);
    }
}

// o[r] = alpha[r] o[r] + p[r] V for r < rows; p rows are n_pad (a multiple of 32) keys wide
inline void pv_tiles(const bf16* p_hi, const bf16* p_lo, int64_t n_pad, const float* alpha, int rows, int rows_pad,
                     const uint32_t* v_tiles, int d, float* product, float* o) {
  const int blocks = d / 16;
  for (int r0 = 0; r0 < rows_pad; r0 += kTileRows)
    for (int b = 0; b < blocks; ++b) {
      tile_product(p_hi + r0 * n_pad, p_lo + r0 * n_pad, n_pad, n_pad / 32, v_tiles + b * 256, blocks * 256);
      _tile_stored(0, product + static_cast<int64_t>(r0) * d + b * 16, d * 4);
    }
  for (int r = 0; r < rows; ++r) {
    const R a = Vec::set1(alpha[r]);
    for (int x = 0; x < d; x += W)
      Vec::store(o + r * d + x, Vec::fma(Vec::load(o + r * d + x), a, Vec::load(product + static_cast<int64_t>(r) * d + x)));
  }
}

template <class T>
struct UsesTiles {
  static constexpr bool value = false;
};
template <>
struct UsesTiles<bf16> {
  static constexpr bool value = true;
};
#endif  // VATTN_AMX_BF16

#include "kernel_lanes.h"
#ifdef VATTN_BF16_DOT
#include "kernel_bf16_dot.h"
#endif

template <class T>
struct IsFloat {
  static constexpr bool value = false;
};
template <>
struct IsFloat<float> {
  static constexpr bool value = true;
};
template <class T>
struct IsBf16 {
  static constexpr bool value = false;
};
template <>
struct IsBf16<bf16> {
  static constexpr bool value = true;
};

// ---- one work item ------------------------------------------------------------------

// kDot: the AVX512_BF16 variant of the unit (kernel_bf16_dot.h), with Q K^T of bf16 queries over a bf16 cache
// by VDPBF16PS
template <class T, bool kDot>
void run_item_typed(const Call& c, const WorkItem& it, const WorkItem* next_item, float* scratch) {
  const Request& rq = c.requests[it.req];
  const int G = c.group_size, d = c.head_dim;
  const int nq = it.q_end - it.q_begin;
  const int nh = it.head_end - it.head_begin;
  const int rows = nq * G;  // per kv head
  const int64_t head_rows = static_cast<int64_t>(rows) * d;
  // Prefill blocks re-read each tile once per block of 4 rows: widen it once
  // into a contiguous fp32 copy (for fp32 caches too: cache rows a power of
  // two of bytes apart, 4 KiB for 8 heads x 128, fall into the same L1 sets
  // and would evict each other between re-reads).
  const bool widen = rows > 8;
  const int64_t token_bytes = static_cast<int64_t>(nh) * d * sizeof(T);  // of K for this item's heads
  // A long decode item over wide rows streams: tiles of at most 32 KiB, and the next tile's lines asked for
  // from inside the loops, for fp32 too (below). Measured with benchmarks/host_kernel_ab.py on a 2-core AVX2 VM
  // (Llama-3-8B layer, cold and warm, two runs): fp32 decode 1.11-1.45x and bf16 0.96-1.17x (mostly 1.04-1.16x)
  // where items have >= 512 keys and >= 2 KiB per token; on shorter items (129-256 keys, e.g. fp32 B=4 ctx 512
  // split in two) the same change measured 0.79-0.96x, so they keep the defaults.
  const bool wide_rows = !widen && token_bytes >= 2048;  // a decode item reading >= 2 KiB of each token's K
  const bool streaming = wide_rows && it.k_end - it.k_begin >= 512;
  // What a decode item's loops ask for: Q K^T of a tile the same tile's V rows, P V the next tile's K rows,
  // so that each request runs about half a tile ahead of its use (the first tile's K up front). Against
  // asking for the next tile's K and V a whole tile ahead, on a 2-core Zen 4 from memory: bf16 decode of 8 q /
  // 2 kv heads of 64 1.10-1.14x from B=4 on on the AVX2 path (with its 16 KiB tiles, below), 1.03-1.09x on
  // the AVX-512 paths where outside noise; Llama-3-8B's heads (wide rows) 1.02-1.18x in fp32 and bf16
  // (docs/kernels.md, "Half a tile ahead"). Narrow fp32 items, whose arithmetic per byte is half bf16's, read
  // 0.93x and 0.97x that way at B=8 ctx 4096 on the AVX2 and AVX-512 BF16 paths, and, like items whose K and
  // V rows lie differently apart (strides of other tensors), keep asking from Q K^T for the next K tile and
  // from P V for the next V tile, a whole tile ahead.
  const bool half_tile_ahead = !widen && (sizeof(T) < sizeof(float) || wide_rows) &&
                               c.k_cache.strides[1] == c.v_cache.strides[1] &&
                               c.k_cache.strides[2] == c.v_cache.strides[2];
  // A decode item over narrower rows (its K/V come from memory: the request rule below) takes 16 KiB tiles on
  // 8-float vectors, so that the lines its loops request ahead (above) sit in L1 or L2 beside it, or 32 KiB
  // where a token takes at most 256 B and the requests run a whole tile ahead. Against 64 KiB, alone:
  // 1.04-1.21x on fp32 and bf16 decode of 4 q / 2 kv heads of 128 (1 KiB and 512 B per token; 4-16 requests
  // of 256-512 tokens, K/V from memory) in an in-process sweep on a 2-core AVX2 VM. Tokens of at most 256 B
  // (8 q / 2 kv heads of 64 in bf16) took 32 KiB while every item's requests ran a whole tile ahead (16 KiB
  // had read 0.94-0.96x c355c6f's 64 KiB there and 32 KiB 1.00-1.02x, on a 2-core Zen 4 forced to the AVX2
  // path); with the requests half a tile ahead, 16 KiB read 1.09-1.11x as fast as 32 KiB from memory on that
  // Zen 4 (B=1 ctx 2048 level) and 0.96-1.02x warm, 8 KiB 1.05-1.15x and 0.93-0.96x (docs/kernels.md, "Half a
  // tile ahead"). On 16-float vectors the tiles stay at 64 KiB: against 32 KiB, fp32 decode of 8 q / 2 kv
  // heads of 64 at B=8 ctx 4096 and of 4 q / 2 kv heads of 128 at B=8 ctx 2048 ran 1.02-1.06x as fast, the
  // other decode points 0.99-1.02x (within noise); 16 KiB with the requests half a tile ahead read 0.96-1.08x
  // from memory and 0.96-0.98x warm on bf16 decode of 8 q / 2 kv heads of 64 there. All:
  // benchmarks/host_kernel_ab.py, one thread, medians of per-round ratios (docs/kernels.md).
  const bool cold_narrow = W < 16 && !widen && !wide_rows;
  const int64_t cold_narrow_bytes = int64_t{token_bytes <= 256 && !half_tile_ahead ? 32 : 16} << 10;
  const int64_t tile =
      key_tile(rows, token_bytes, streaming ? int64_t{32} << 10 : cold_narrow ? cold_narrow_bytes : int64_t{64} << 10);

  float* q = align64(scratch);                // [nh][rows][d], pre-scaled
  float* acc = align64(q + nh * head_rows);   // [nh][rows][d]
  const int rows_pad = (rows + 15) / 16 * 16;  // whole 16-row tiles (AMX) may write past `rows`
  // scores, row stride kMaxKeyTile (not tile: softmax_tile pads each row to a whole vector past
  // tile): a decode item's [nh][rows] (all heads' scores of a tile come first), else one head's
  // [rows_pad] (whole 16-row tiles)
  float* s_all = align64(acc + nh * head_rows);
  // Blocks of many rows (prefill, more than 8 rows a kv head) outside the AMX tiles put the rows across
  // the lanes (kernel_lanes.h): scores st[t][r], Q transposed, m, l and alpha per head padded to whole
  // vectors of rows; the others keep a row per score row, m, l and alpha `rows` apart.
  const int lane_vecs = (rows + W - 1) / W;
  const int ld_rows = widen ? lane_vecs * W : rows;  // m, l, alpha: rows per head; qt, st: row stride
  float* m = align64(s_all + imax(nh * rows, rows_pad) * kMaxKeyTile); // [nh][ld_rows]
  float* l = m + nh * ld_rows;
  float* alpha = l + nh * ld_rows;
  float* k_wide = align64(alpha + nh * ld_rows); // [tile][d]
  float* v_wide = align64(k_wide + kMaxKeyTile * d);
  float* qt = align64(v_wide + kMaxKeyTile * d);  // lanes: [nh][d][ld_rows]

  const int64_t first_token = rq.query_start + it.q_begin;
#ifdef VATTN_AMX_BF16
  const bool tiles = UsesTiles<T>::value && widen && nh == 1;  // (below)
#else
  constexpr bool tiles = false;
#endif
  const bool lanes = widen && !tiles;
  // Decode over a bf16 cache widens K and V 2 W elements at a time (load_values, Vec::load_bf16_pairs): on
  // AVX-512 a shift and a mask (even and odd elements), on AVX2 one in-lane shuffle a vector, where
  // load(bf16) takes a lane-crossing widen and a shift per W. The queries (Q K^T) and the accumulators
  // (P V) hold each chunk in that order; the accumulators are put back once at the item's end (pair_rows).
  // P V's sums are the same, element by element; a score adds the same products in other lanes, so its
  // tree of partial sums differs (fp32 rounding). On a 2-core Zen 4: P V in pairs on AVX-512, where P V's
  // 16 FMAs a key and kv head of 64 bound it, ran bf16 decode of 8 q / 2 kv heads of 64 1.02-1.06x as fast
  // with its K/V in L3 and 1.03-1.09x from memory from B=8 on (host_kernel_ab_zen4_v_pairs_*); Q K^T and
  // P V in pairs on AVX2, and Q K^T on AVX-512: docs/kernels.md, "bf16 widened in pairs for Q K^T too".
  // Decode items only (!widen: rows that are neither in the lanes nor in AMX tiles); Q K^T by VDPBF16PS
  // (dot) takes the queries as they are.
  constexpr bool kCanPair = IsBf16<T>::value && HasBf16Pairs<Vec>::value;
  const bool pairs = kCanPair && !widen && d % (2 * W) == 0;
#ifdef VATTN_BF16_DOT
  // bf16 queries over a bf16 cache, outside the AMX tiles: Q K^T by VDPBF16PS on the queries as they are
  const bool dot = kDot && IsBf16<T>::value && !tiles && c.q.dtype == DType::kBF16 && d % 32 == 0;
  bf16* q_bf16 = reinterpret_cast<bf16*>(q);  // [nh][rows][d], unscaled
#else
  constexpr bool dot = false;
#endif
  for (int h = 0; h < nh; ++h)
    for (int j = 0; j < nq; ++j)
      for (int g = 0; g < G; ++g) {
        const int64_t head = static_cast<int64_t>(it.head_begin + h) * G + g, row = h * head_rows + (j * G + g) * d;
#ifdef VATTN_BF16_DOT
        if (dot) {
          __builtin_memcpy(q_bf16 + row, element(c.q, first_token + j, head), d * sizeof(bf16));
          continue;
        }
#endif
        load_query_row(c.q, first_token + j, head, c.scale, d, q + row);
      }
  if constexpr (kCanPair)
    if (pairs && !dot) pair_rows<true>(q, static_cast<int64_t>(nh) * rows, d);
  for (int64_t i = 0; i < nh * head_rows; ++i) acc[i] = 0.0f;
  for (int64_t r = 0; r < static_cast<int64_t>(nh) * ld_rows; ++r) {
    m[r] = kNegInf;
    l[r] = 0.0f;
  }

  const TensorRef& kc = c.k_cache;
  const TensorRef& vc = c.v_cache;
  const T* k_req = reinterpret_cast<const T*>(kc.data) + rq.reqid * kc.strides[0];
  const T* v_req = reinterpret_cast<const T*>(vc.data) + rq.reqid * vc.strides[0];
  const int64_t ldk = kc.strides[1], ldv = vc.strides[1];
  // bytes of one token's rows for this item's heads, from its first head's start
  const int64_t k_span = ((nh - 1) * kc.strides[2] + d) * static_cast<int64_t>(sizeof(T));
  const int64_t v_span = ((nh - 1) * vc.strides[2] + d) * static_cast<int64_t>(sizeof(T));
  const T* k_heads = k_req + it.head_begin * kc.strides[2];
  const T* v_heads = v_req + it.head_begin * vc.strides[2];
  const int64_t first_pos = rq.cached_len + it.q_begin;  // position of the item's first query
  // Every decode item (!widen) asks for lines ahead from inside the Q K^T and P V loops (spread over the work; which
  // lines: half_tile_ahead, above); prefill blocks ask for each head's share of the next tile in one burst per head.
  // Against bursts, spreading made bf16 decode 1.18-1.30x faster from 512 tokens of context on (a 2-core AVX2 VM; a
  // burst stalls the core before any work on the tile starts). In a forward a layer's K and V were last read a whole
  // forward earlier, with every other layer's K/V and weights read since, so they come from memory whatever their
  // size: a decode item that asked for nothing (leaving the lines to the hardware prefetchers) was faster only where
  // its call's K/V sat in L2 or L3, as in back-to-back calls of a benchmark (1.03-1.09x faster for bf16 items of 1-4
  // heads on that VM, 1.04-1.12x on a 2-core Zen 4). Against that rule, with the K/V from memory (64 MiB written
  // between calls; benchmarks/host_kernel_ab.py, two threads, a 2-core Zen 4, 8 q / 2 kv heads of 64, calls under
  // 2 MiB): bf16 1.11-1.32x and fp32 1.19-1.36x on AVX-512 BF16, bf16 1.12-1.34x and fp32 1.07-1.57x on the AVX2
  // path (its tiles above too), one bf16 point of each path within noise; 4 q / 2 kv heads of 128 within noise;
  // where they sat in L3 (4 MiB written) 0.89-0.96x (docs/kernels.md, "Small decode calls from memory"). The rule it
  // replaced (only items over wide rows, and calls whose K/V outgrew their threads' L2) had measured 1.25-2.0x
  // (bf16) and 1.05-1.6x (fp32) against asking for nothing on AVX-512 from 2 MiB on.
  // Where a decode item's requests go (Call::prefetch_to_l2). Measured with benchmarks/host_kernel_ab.py, one thread,
  // decode from memory (small-8q2kv, short-4q2kv, Llama-3-8B heads): on a 2-core AMD EPYC Zen 4 (32 KiB
  // L1D) into L2 ran 1.0-2.0x as fast as into L1 on both x86 paths; on the other EPYC measured (a Zen 5,
  // 48 KiB, by its results) it was level or slower (docs/kernels.md, "Zen 4: the decode's requests go to L2").
  const bool to_l2 = c.prefetch_to_l2;
  // bytes from a K row to the V row of the same token and head (as integers: K and V are two allocations)
  const int64_t k_to_v =
      static_cast<int64_t>(reinterpret_cast<uintptr_t>(v_heads) - reinterpret_cast<uintptr_t>(k_heads));
  // A prefill block's P V re-reads the V tile once per 4 rows. An fp32 V tile is read where it lies, not
  // copied, unless its tokens are a multiple of 1 KiB apart (8 kv heads of 128: 4 KiB), where the rows
  // would share L1 sets and evict each other between re-reads. Against the copy, fp32 prefill of 8 q / 2 kv
  // heads of 64 ran 1.03x as fast on a 2-core AVX-512 EPYC (medians of per-round ratios, intervals 1.01-1.06),
  // an A/A pair of equal builds 0.98-1.01x (benchmarks/host_kernel_ab.py, results host_kernel_ab_v_in_place*).
  const bool v_in_place = lanes && !values_copied(vc.dtype, ldv * static_cast<int64_t>(sizeof(T)));
  // Where a prompt makes several blocks, the call packs its values once instead (Call::packed_values) and
  // the tile is read there in place: against copying each tile in every block, fp32 prefill of a 2048-token
  // prompt with 8 kv heads of 128 ran 1.03-1.05x as fast, its A/A pair 0.99x (host_kernel_ab_packed_values*,
  // docs/kernels.md).
  const PackedValues* packed = lanes && c.packed_values ? &c.packed_values[it.req] : nullptr;
  const float* v_packed = packed ? packed->data : nullptr;  // token packed->first_token of kv head 0
#ifdef VATTN_AMX_BF16
  // Prefill blocks of a bf16 cache (one kv head) go through the tiles: K and V
  // tiles packed into the widening buffers, Q (once) and P (per tile) in bf16.
  const int d_pad = (d + 31) / 32 * 32;
  bf16* q_hi = reinterpret_cast<bf16*>(align64(v_wide + kMaxKeyTile * d));  // [rows_pad][d_pad], twice (for qt)
  bf16* q_lo = q_hi + rows_pad * d_pad;
  bf16* p_hi = reinterpret_cast<bf16*>(align64(reinterpret_cast<float*>(q_lo + rows_pad * d_pad)));  // [rows_pad][64], twice
  bf16* p_lo = p_hi + rows_pad * kMaxKeyTile;
  float* product = align64(reinterpret_cast<float*>(p_lo + rows_pad * kMaxKeyTile));  // [rows_pad][d]
  const TileConfig tile_config;
  if (tiles) {
    _tile_loadconfig(&tile_config);
    to_bf16_terms(q, d, rows, rows_pad, d, d_pad, q_hi, q_lo);
  }
#endif
  if (lanes)
    for (int h = 0; h < nh; ++h) {
#ifdef VATTN_BF16_DOT
      if (dot) {
        pair_transpose(q_bf16 + h * head_rows, rows, d, reinterpret_cast<uint32_t*>(qt) + h * d * ld_rows, ld_rows);
        continue;
      }
#endif
      transpose_rows(q + h * head_rows, d, rows, d, qt + h * d * ld_rows, ld_rows);
    }

  // The first tile, up front (its V: from its Q K^T where the requests run half a tile ahead), into L1
  // (docs/kernels.md, "Small warm calls": asked for into L2, or as one range, small calls from memory lost).
  prefetch_tokens(k_heads + it.k_begin * ldk, ldk, imin(tile, it.k_end - it.k_begin), k_span);
  if (!half_tile_ahead) prefetch_tokens(v_heads + it.k_begin * ldv, ldv, imin(tile, it.k_end - it.k_begin), v_span);
  // The thread's next item (the pool claimed it before this one started), where it is a decode item over as
  // many heads: this item's last tile asks for that item's first tile as it would for a tile of its own, so
  // that the requests do not stop between items. Against stopping there, on a 2-core Zen 4 with the K/V from
  // memory (8 q / 2 kv heads of 64, one thread, 100 rounds): 1.02-1.08x on the AVX2 path and 1.03-1.13x on
  // AVX-512 BF16 from B=4 on in bf16, 1.02-1.07x in fp32 from B=16 (AVX2) and B=4 (AVX-512 BF16), the A/A
  // pairs 0.99-1.02x (docs/kernels.md, "The next item's first tile").
  const T* next_k = nullptr;
  const T* next_v = nullptr;
  int64_t next_n = 0;  // keys of the next item's first tile that this item's last tile requests
  if (!widen && next_item && next_item->q_end - next_item->q_begin == it.q_end - it.q_begin &&
      next_item->head_end - next_item->head_begin == nh) {
    const Request& rn = c.requests[next_item->req];
    next_k = reinterpret_cast<const T*>(kc.data) + rn.reqid * kc.strides[0] + next_item->head_begin * kc.strides[2] +
             next_item->k_begin * ldk;
    next_v = reinterpret_cast<const T*>(vc.data) + rn.reqid * vc.strides[0] + next_item->head_begin * vc.strides[2] +
             next_item->k_begin * ldv;
    next_n = imin(tile, next_item->k_end - next_item->k_begin);
  }
  for (int64_t k0 = it.k_begin; k0 < it.k_end; k0 += tile) {
    const int64_t n = imin(tile, it.k_end - k0);
    const int64_t next = k0 + n, n_next = imin(tile, it.k_end - next);
    // the decode loops' requests: Q K^T asks, for its first qk_pf_n keys, for the line qk_pf_bytes on from each
    // K line it reads; P V, for its first pv_pf_n keys, pv_pf_bytes on from each V line
    const int64_t k_tile_bytes = n * ldk * static_cast<int64_t>(sizeof(T));
    const int64_t v_tile_bytes = n * ldv * static_cast<int64_t>(sizeof(T));
    int64_t qk_pf_bytes = half_tile_ahead ? k_to_v : k_tile_bytes, qk_pf_n = half_tile_ahead ? n : n_next;
    int64_t pv_pf_bytes = half_tile_ahead ? k_tile_bytes - k_to_v : v_tile_bytes, pv_pf_n = n_next;
    if (n_next == 0 && next_n > 0) {  // the last tile: the same requests, for the thread's next item's first tile
      const auto from = [](const void* row, const void* to) {
        return static_cast<int64_t>(reinterpret_cast<uintptr_t>(to) - reinterpret_cast<uintptr_t>(row));
      };
      const T* k_tile = k_heads + k0 * ldk;
      const T* v_tile = v_heads + k0 * ldv;
      if (half_tile_ahead) {
        pv_pf_bytes = from(v_tile, next_k);
      } else {
        qk_pf_bytes = from(k_tile, next_k);
        qk_pf_n = imin(n, next_n);
        pv_pf_bytes = from(v_tile, next_v);
      }
      pv_pf_n = imin(n, next_n);
    }
    const int64_t per_head = (n_next + nh - 1) / nh;  // next-tile tokens prefetched under each head
    if (!widen)  // decode: every head's scores first, so the K tile is read in one pass, then the V tile
      for (int h = 0; h < nh; ++h) {
#ifdef VATTN_BF16_DOT
        if (dot) {  // decode
          with_prefetch_hint(to_l2, [&](auto hint) {
            qk_dot<decltype(hint)::value>(q_bf16 + h * head_rows, d, rows,
                                          reinterpret_cast<const bf16*>(k_heads + k0 * ldk + h * kc.strides[2]), ldk,
                                          n, d, c.scale, s_all + h * rows * kMaxKeyTile, kMaxKeyTile, qk_pf_bytes,
                                          qk_pf_n);
          });
          continue;
        }
#endif
        with_prefetch_hint(to_l2, [&](auto hint) {
          with_pairs<kCanPair>(pairs, [&](auto in_pairs) {
            qk<T, decltype(hint)::value, decltype(in_pairs)::value>(q + h * head_rows, d, rows,
                                                                    k_heads + k0 * ldk + h * kc.strides[2], ldk, n, d,
                                                                    s_all + h * rows * kMaxKeyTile, kMaxKeyTile,
                                                                    qk_pf_bytes, qk_pf_n);
          });
        });
      }
    for (int h = 0; h < nh; ++h) {
      const int64_t p0 = imin(n_next, h * per_head), p1 = imin(n_next, p0 + per_head);
      // this head's packed values (nh is 1 where the call packs: blocks of several query blocks take one kv head)
      const float* vp = v_packed ? v_packed + (it.head_begin + h) * packed->head_stride + (k0 - packed->first_token) * d
                                 : nullptr;  // token k0
      if (widen && p1 > p0) {  // a prefill block's burst
        prefetch_tokens(k_heads + (next + p0) * ldk, ldk, p1 - p0, k_span);
        if (vp)
          prefetch_tokens(vp + (n + p0) * d, d, p1 - p0, d * static_cast<int64_t>(sizeof(float)));
        else
          prefetch_tokens(v_heads + (next + p0) * ldv, ldv, p1 - p0, v_span);
      }
      const T* kt = k_heads + k0 * ldk + h * kc.strides[2];
      const T* vt = v_heads + k0 * ldv + h * vc.strides[2];
      float* ah = acc + h * head_rows;
      float* mh = m + h * ld_rows;
      float* lh = l + h * ld_rows;
      float* alh = alpha + h * ld_rows;
      float* s = widen ? s_all : s_all + h * rows * kMaxKeyTile;  // this head's scores
      if (lanes) {
        // a tile that every row sees whole, uncapped: Q K^T leaves each row's max in alh (softmax_lanes)
        const bool tile_max = !dot && c.softcap == 0.0f && !tile_masked(n, k0, rows, G, first_pos, c.window);
#ifdef VATTN_BF16_DOT
        if (dot)
          qk_lanes_dot(reinterpret_cast<const uint32_t*>(qt) + h * d * ld_rows, ld_rows, lane_vecs,
                       reinterpret_cast<const bf16*>(kt), ldk, n, d, c.scale, s, ld_rows);
        else
#endif
        if (IsFloat<T>::value && lane_vecs <= kLaneVecs) {  // each K element is read once: no copy
          qk_lanes(qt + h * d * ld_rows, ld_rows, lane_vecs, reinterpret_cast<const float*>(kt), ldk, n, d, s,
                   ld_rows, tile_max ? alh : nullptr);
        } else {
          widen_rows(kt, ldk, n, d, k_wide);
          qk_lanes(qt + h * d * ld_rows, ld_rows, lane_vecs, k_wide, d, n, d, s, ld_rows, tile_max ? alh : nullptr);
        }
        if (c.softcap > 0.0f) softcap_lanes(s, ld_rows, n, lane_vecs, c.softcap);
        mask_lanes(s, ld_rows, n, k0, rows, G, first_pos, c.window);
        softmax_lanes(s, ld_rows, n, lane_vecs, mh, lh, alh, tile_max);
      } else {
#ifdef VATTN_AMX_BF16
        if (tiles) {
          pack_b_tiles(reinterpret_cast<const bf16*>(kt), 1, ldk, d, n, d_pad / 32,
                       reinterpret_cast<uint32_t*>(k_wide));
          qk_tiles(q_hi, q_lo, d_pad, rows_pad, reinterpret_cast<const uint32_t*>(k_wide), n, s, kMaxKeyTile);
        }
#endif
        softmax_tile_rows(s, kMaxKeyTile, rows, n, [&](int r, int64_t& lo, int64_t& hi) {
          const int64_t pos = first_pos + r / G;
          hi = imin(n, pos + 1 - k0);
          lo = c.window > 0 ? imax(0, pos - c.window + 1 - k0) : 0;
        }, c.softcap, mh, lh, alh);
      }
#ifdef VATTN_AMX_BF16
      if (tiles) {
        const int64_t n_pad = round_up(n, 32);
        to_bf16_terms(s, kMaxKeyTile, rows, rows_pad, round_up(n, W), n_pad, p_hi, p_lo);
        pack_b_tiles(reinterpret_cast<const bf16*>(vt), ldv, 1, n, d, (n + 31) / 32,
                     reinterpret_cast<uint32_t*>(v_wide));
        pv_tiles(p_hi, p_lo, n_pad, alh, rows, rows_pad, reinterpret_cast<const uint32_t*>(v_wide), d, product, ah);
      } else
#endif
      if (lanes) {
        if (vp) {
          pv<float>(s, 1, ld_rows, alh, rows, vp, d, n, d, ah, d);
        } else if (v_in_place) {
          pv<float>(s, 1, ld_rows, alh, rows, reinterpret_cast<const float*>(vt), ldv, n, d, ah, d);
        } else {
          widen_rows(vt, ldv, n, d, v_wide);
          pv<float>(s, 1, ld_rows, alh, rows, v_wide, d, n, d, ah, d);
        }
      } else {
        with_prefetch_hint(to_l2, [&](auto hint) {
          with_pairs<kCanPair>(pairs, [&](auto in_pairs) {
            pv<T, decltype(hint)::value, decltype(in_pairs)::value>(s, kMaxKeyTile, 1, alh, rows, vt, ldv, n, d, ah,
                                                                    d, pv_pf_bytes, pv_pf_n);
          });
        });
      }
    }
  }

#ifdef VATTN_AMX_BF16
  if (tiles) _tile_release();
#endif
  if constexpr (kCanPair)
    if (pairs) pair_rows<false>(acc, static_cast<int64_t>(nh) * rows, d);
  if (it.group >= 0) {  // a split: keep the unnormalized accumulator for the merge
    const int64_t base = static_cast<int64_t>(it.partial) * c.rows_per_partial;
    float* pacc = c.partial_acc + base * d;
    for (int64_t i = 0; i < nh * head_rows; ++i) pacc[i] = acc[i];
    for (int h = 0; h < nh; ++h)
      for (int r = 0; r < rows; ++r) {
        c.partial_max[base + h * rows + r] = m[h * ld_rows + r];
        c.partial_sum[base + h * rows + r] = l[h * ld_rows + r];
      }
    return;
  }
  for (int h = 0; h < nh; ++h) {
    for (int r = 0; r < rows; ++r) {
      const int64_t hr = static_cast<int64_t>(h) * rows + r, hm = static_cast<int64_t>(h) * ld_rows + r;
      const int64_t token = first_token + r / G, head = static_cast<int64_t>(it.head_begin + h) * G + r % G;
      // l == 0: the row saw no key (output 0, LSE -inf); a NaN l stays NaN in both
      store_output_row(c.out, token, head, acc + hr * d, l[hm] == 0.0f ? 0.0f : 1.0f / l[hm], d);
      if (c.lse.data)
        *reinterpret_cast<float*>(const_cast<char*>(element(c.lse, token, head))) =
            l[hm] == 0.0f ? kNegInf : m[hm] + ::logf(l[hm]);
    }
  }
}

template <bool kDot>
void run_item(const Call& c, const WorkItem& it, const WorkItem* next, float* scratch) {
  with_storage_type(c.k_cache.dtype, [&](auto tag) { run_item_typed<decltype(tag), kDot>(c, it, next, scratch); });
}
