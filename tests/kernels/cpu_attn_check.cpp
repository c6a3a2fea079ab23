// Checks every ISA path of the host attention kernel that this CPU (or
// emulator) can run against a double-precision reference, without Python:
// tests/kernels/test_cpu_attn_isas.py builds it natively and, with a cross compiler,
// for AArch64 to run under qemu-aarch64 (NEON, and SVE at a chosen vector
// length), so that paths this machine lacks are executed too.
//
//   cpu_attn_check [cases [max_cached [max_kv_heads]]]   exit 0: every path agrees; 1: a mismatch (printed)
//
// Each case is a random mixed batch (prefill chunks after cached tokens, and
// decodes) over a cache in the per_layer or the all_layers layout, with the
// step's K/V written by the call, GQA, head dims 64-256, fp32/bf16/fp16,
// optional sliding window and soft-cap, and the log-sum-exp.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "attention.h"
#include "convert.h"

using namespace vattn::cpu_attn;

namespace {

struct Store {  // a tensor's bytes in one dtype, addressed by element index
  DType dtype;
  std::vector<char> bytes;
  Store(DType d, size_t n) : dtype(d), bytes(n * (d == DType::kF32 ? 4 : 2)) {}
  char* data() { return bytes.data(); }
  void set(size_t i, float x) {  // stores x rounded to the dtype
    switch (dtype) {
      case DType::kF32: from_float(x, reinterpret_cast<float*>(bytes.data()) + i); break;
      case DType::kBF16: from_float(x, reinterpret_cast<bf16*>(bytes.data()) + i); break;
      case DType::kF16: from_float(x, reinterpret_cast<f16*>(bytes.data()) + i); break;
    }
  }
  double get(size_t i) const {
    switch (dtype) {
      case DType::kF32: return to_float(reinterpret_cast<const float*>(bytes.data())[i]);
      case DType::kBF16: return to_float(reinterpret_cast<const bf16*>(bytes.data())[i]);
      case DType::kF16: return to_float(reinterpret_cast<const f16*>(bytes.data())[i]);
    }
    return 0;
  }
};

TensorRef ref(Store& s, std::vector<int64_t> shape, std::vector<int64_t> strides) {
  TensorRef t;
  t.data = s.data();
  t.dtype = s.dtype;
  t.ndim = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    t.shape[i] = shape[i];
    t.strides[i] = strides[i];
  }
  return t;
}

const char* dtype_name(DType d) { return d == DType::kF32 ? "f32" : d == DType::kBF16 ? "bf16" : "f16"; }

int covered[3][2];  // cases per dtype and layout (per_layer, all_layers)

// One random case; returns the number of mismatching paths (and prints them).
int run_case(std::mt19937_64& rng, int index, int64_t max_cached, int64_t max_kv_heads) {
  auto pick = [&](std::initializer_list<int64_t> xs) { return *(xs.begin() + rng() % xs.size()); };
  auto uniform = [&](int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(rng() % (hi - lo + 1)); };
  const int64_t D = pick({64, 80, 96, 128, 256});
  // 16 kv heads (max_kv_heads >= 16): a decode item's token rows exceed 4 KiB in fp32, so key tiles shrink to 8
  const int64_t Hkv = max_kv_heads >= 16 && rng() % 2 ? 16 : pick({1, 2, 4});
  const int64_t G = pick({1, 4, 7, 8});  // 7: Qwen2-0.5B, prefill blocks of rows that are no whole number of vectors
  const int64_t Hq = Hkv * G;
  // dtype and layout cycle, so that any 6 consecutive cases cover every pair
  const DType dtype = static_cast<DType>(index % 3);
  const bool all_layers = (index / 3) % 2;
  ++covered[static_cast<int>(dtype)][all_layers ? 1 : 0];
  const int64_t layers = all_layers ? 3 : 1;  // all_layers: layer 1 of 3, so token rows are strided
  const int64_t window = rng() % 4 == 0 ? uniform(1, 300) : 0;
  const float softcap = rng() % 4 == 0 ? 30.0f : 0.0f;
  const int64_t nreq = uniform(1, 4);
  const int64_t num_reqids = nreq + 1;
  std::vector<int64_t> reqids, cached, qlens;
  int64_t L = 0;
  for (int64_t i = 0; i < nreq; ++i) {
    reqids.push_back((i * 7 + index) % num_reqids == 0 && i == 0 ? num_reqids - 1 : i);  // not always 0..n-1
    cached.push_back(rng() % 3 == 0 ? 0 : uniform(1, max_cached));
    qlens.push_back(rng() % 2 ? 1 : uniform(2, 70));
    L = std::max(L, cached.back() + qlens.back());
  }
  {  // reqids must be distinct
    std::vector<int64_t> sorted(reqids);
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      for (int64_t i = 0; i < nreq; ++i) reqids[i] = i;
  }
  int64_t T = 0;
  for (int64_t q : qlens) T += q;

  // cache [num_reqids, L, Hkv, D] inside a buffer of `layers` layers: token stride layers * Hkv * D
  const int64_t token_stride = layers * Hkv * D, slice_stride = L * token_stride;
  const int64_t layer_offset = all_layers ? Hkv * D : 0;
  // NaN wherever the call must not read: the other layers' rows, the rows past each request's new tokens and
  // the slice no request holds (under vattn such rows may be unmapped); a NaN read there reaches the output
  Store kbuf(dtype, num_reqids * slice_stride), vbuf(dtype, num_reqids * slice_stride);
  for (size_t i = 0; i < kbuf.bytes.size() / (dtype == DType::kF32 ? 4 : 2); ++i) {
    kbuf.set(i, NAN);
    vbuf.set(i, NAN);
  }
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < nreq; ++i)  // the cached history; the call writes the new rows
    for (int64_t t = 0; t < cached[i]; ++t)
      for (int64_t e = 0; e < Hkv * D; ++e) {
        const size_t at = static_cast<size_t>(reqids[i] * slice_stride + t * token_stride + layer_offset + e);
        kbuf.set(at, normal(rng));
        vbuf.set(at, normal(rng));
      }
  Store q(dtype, T * Hq * D), knew(dtype, T * Hkv * D), vnew(dtype, T * Hkv * D);
  for (int64_t i = 0; i < T * Hq * D; ++i) q.set(i, normal(rng));
  for (int64_t i = 0; i < T * Hkv * D; ++i) {
    knew.set(i, normal(rng));
    vnew.set(i, normal(rng));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));

  // reference: the new rows written, then attention in double precision
  auto cache_index = [&](int64_t reqid, int64_t token, int64_t h, int64_t x) {
    return static_cast<size_t>(reqid * slice_stride + token * token_stride + layer_offset + h * D + x);
  };
  // Every fourth case poisons one query element and one K element of a history key: the rows that read
  // them must come out NaN (the reference's arithmetic carries the NaN), every other row exact.
  int nans = 0;
  if (index % 4 == 3) {
    q.set(uniform(0, T * Hq * D - 1), NAN);
    ++nans;
    for (int64_t i = 0; i < nreq; ++i)
      if (cached[i] > 0) {
        kbuf.set(cache_index(reqids[i], uniform(0, cached[i] - 1), uniform(0, Hkv - 1), uniform(0, D - 1)), NAN);
        ++nans;
        break;
      }
  }
  std::vector<double> want(T * Hq * D), want_lse(T * Hq);
  {
    Store kref = kbuf, vref = vbuf;
    int64_t start = 0;
    for (int64_t i = 0; i < nreq; ++i) {
      for (int64_t j = 0; j < qlens[i]; ++j)
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t x = 0; x < D; ++x) {
            const size_t at = cache_index(reqids[i], cached[i] + j, h, x);
            std::memcpy(kref.data() + at * (dtype == DType::kF32 ? 4 : 2),
                        knew.data() + ((start + j) * Hkv * D + h * D + x) * (dtype == DType::kF32 ? 4 : 2),
                        dtype == DType::kF32 ? 4 : 2);
            std::memcpy(vref.data() + at * (dtype == DType::kF32 ? 4 : 2),
                        vnew.data() + ((start + j) * Hkv * D + h * D + x) * (dtype == DType::kF32 ? 4 : 2),
                        dtype == DType::kF32 ? 4 : 2);
          }
      // the request's K and V rows of each kv head in double, once (not converted again for every query)
      const int64_t seq = cached[i] + qlens[i];
      std::vector<double> kd(Hkv * seq * D), vd(Hkv * seq * D), qd(D), s(seq), o(D);
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t t = 0; t < seq; ++t)
          for (int64_t x = 0; x < D; ++x) {
            kd[(h * seq + t) * D + x] = kref.get(cache_index(reqids[i], t, h, x));
            vd[(h * seq + t) * D + x] = vref.get(cache_index(reqids[i], t, h, x));
          }
      for (int64_t j = 0; j < qlens[i]; ++j) {
        const int64_t pos = cached[i] + j;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const double* kh = kd.data() + hq / G * seq * D;
          const double* vh = vd.data() + hq / G * seq * D;
          for (int64_t x = 0; x < D; ++x)
            qd[x] = static_cast<double>(static_cast<float>(q.get((start + j) * Hq * D + hq * D + x)) * scale);
          double m = -INFINITY;
          for (int64_t t = lo; t <= pos; ++t) {
            double dot = 0;
            for (int64_t x = 0; x < D; ++x) dot += qd[x] * kh[t * D + x];
            if (softcap > 0) dot = softcap * std::tanh(dot / softcap);
            s[t] = dot;
            m = std::max(m, dot);
          }
          double l = 0;
          for (int64_t t = lo; t <= pos; ++t) l += (s[t] = std::exp(s[t] - m));
          std::fill(o.begin(), o.end(), 0.0);
          for (int64_t t = lo; t <= pos; ++t)  // each output element summed over t in order, as a dot product
            for (int64_t x = 0; x < D; ++x) o[x] += s[t] * vh[t * D + x];
          for (int64_t x = 0; x < D; ++x) want[(start + j) * Hq * D + hq * D + x] = o[x] / l;
          want_lse[(start + j) * Hq + hq] = m + std::log(l);
        }
      }
      start += qlens[i];
    }
  }

  const BatchPlan plan(reqids, cached, qlens);
  const double tol = dtype == DType::kF32 ? 2e-4 : dtype == DType::kBF16 ? 3e-2 : 4e-3;
  int failures = 0;
  for (int i = 0; i < kNumIsas; ++i) {
    const Isa isa = static_cast<Isa>(i);
    if (!isa_supported(isa)) continue;
    Store k = kbuf, v = vbuf, out(dtype, T * Hq * D);
    std::vector<float> lse(T * Hq);
    Call call;
    const std::vector<int64_t> cache_shape{num_reqids, L, Hkv, D}, cache_strides{slice_stride, token_stride, D, 1};
    call.q = ref(q, {T, Hq, D}, {Hq * D, D, 1});
    call.out = ref(out, {T, Hq, D}, {Hq * D, D, 1});
    call.k_cache = ref(k, cache_shape, cache_strides);
    call.v_cache = ref(v, cache_shape, cache_strides);
    call.k_cache.data += layer_offset * (dtype == DType::kF32 ? 4 : 2);
    call.v_cache.data += layer_offset * (dtype == DType::kF32 ? 4 : 2);
    call.lse.data = reinterpret_cast<char*>(lse.data());
    call.lse.dtype = DType::kF32;
    call.lse.ndim = 2;
    call.lse.shape[0] = T;
    call.lse.shape[1] = Hq;
    call.lse.strides[0] = Hq;
    call.lse.strides[1] = 1;
    call.scale = scale;
    call.softcap = softcap;
    call.window = window;
    const TensorRef kn = ref(knew, {T, Hkv, D}, {Hkv * D, D, 1}), vn = ref(vnew, {T, Hkv, D}, {Hkv * D, D, 1});
    const Isa used = attention(plan, call, &kn, &vn, isa);
    // NaN where the reference has NaN, and nowhere else (a NaN on one side only counts as an infinite error)
    auto error = [](double got, double expected) {
      if (std::isnan(got) || std::isnan(expected)) return std::isnan(got) == std::isnan(expected) ? 0.0 : INFINITY;
      return std::fabs(got - expected);
    };
    double worst = 0, worst_lse = 0;
    for (int64_t e = 0; e < T * Hq * D; ++e) worst = std::max(worst, error(out.get(e), want[e]));
    for (int64_t e = 0; e < T * Hq; ++e) worst_lse = std::max(worst_lse, error(lse[e], want_lse[e]));
    if (used != isa || !(worst <= tol) || !(worst_lse <= 1e-3)) {
      std::printf("case %d: %s (ran %s) D=%lld Hkv=%lld G=%lld %s %s window=%lld softcap=%g reqs=%lld T=%lld "
                  "NaNs=%d: max |out - ref| %.3g (tol %.3g), max |lse - ref| %.3g\n",
                  index, isa_name(isa), isa_name(used), static_cast<long long>(D), static_cast<long long>(Hkv),
                  static_cast<long long>(G), dtype_name(dtype), all_layers ? "all_layers" : "per_layer",
                  static_cast<long long>(window), softcap, static_cast<long long>(nreq), static_cast<long long>(T),
                  nans, worst, tol, worst_lse);
      ++failures;
    }
  }
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 40;
  const int64_t max_cached = argc > 2 ? std::atoll(argv[2]) : 700;  // > 256: split-KV decodes
  const int64_t max_kv_heads = argc > 3 ? std::atoll(argv[3]) : 4;
  if (cases < 1 || max_cached < 1 || max_kv_heads < 1) {
    std::fprintf(stderr, "usage: %s [cases >= 1 [max_cached >= 1 [max_kv_heads >= 1]]]\n", argv[0]);
    return 2;
  }
  std::printf("supported:");
  for (int i = 0; i < kNumIsas; ++i)
    if (isa_supported(static_cast<Isa>(i))) std::printf(" %s", isa_name(static_cast<Isa>(i)));
  std::printf("\n");
  std::mt19937_64 rng(12345);
  int failures = 0;
  for (int c = 0; c < cases; ++c) failures += run_case(rng, c, max_cached, max_kv_heads);
  std::printf("covered:");  // dtype/layout pairs, so a caller can see every combination ran
  for (int d = 0; d < 3; ++d)
    for (int l = 0; l < 2; ++l)
      if (covered[d][l]) std::printf(" %s/%s", dtype_name(static_cast<DType>(d)), l ? "all_layers" : "per_layer");
  std::printf("\n%d cases, %d mismatches\n", cases, failures);
  return failures ? 1 : 0;
}
