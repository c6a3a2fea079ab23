// Python bindings of the host attention (module vattn._cpu_attn).
//
// Tensors arrive as DLPack capsules (torch.utils.dlpack.to_dlpack(t)) and
// are read in place: the capsule is borrowed for the call, never consumed,
// so the producer's deleter still runs when Python drops it. The compute
// runs with the GIL released: a layer's attention takes from microseconds
// to seconds, and other Python threads (a scheduler, a tokenizer) must not
// stall behind it.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "attention.h"
#include "common/dlpack.h"
#include "common/released_gil.h"

namespace py = pybind11;
using namespace vattn::cpu_attn;
using vattn::without_gil;

namespace {

TensorRef from_dlpack(py::handle obj, const char* name) {
  py::object capsule = py::reinterpret_borrow<py::object>(obj);
  if (!PyCapsule_CheckExact(obj.ptr()) && py::hasattr(obj, "__dlpack__")) capsule = obj.attr("__dlpack__")();
  if (!PyCapsule_IsValid(capsule.ptr(), "dltensor"))
    throw py::type_error(std::string(name) +
                         " must be an unconsumed DLPack capsule (torch.utils.dlpack.to_dlpack(tensor)) or a tensor");
  const auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  const DLTensor& t = managed->dl_tensor;
  if (t.device.device_type != kDLCPU)
    throw std::invalid_argument(std::string(name) + " must be a CPU tensor (DLPack device type " +
                                std::to_string(static_cast<int>(t.device.device_type)) + ")");
  TensorRef ref;
  if (t.dtype.lanes != 1) throw py::type_error(std::string(name) + " must have scalar (1-lane) elements");
  if (t.dtype.code == kDLFloat && t.dtype.bits == 32) {
    ref.dtype = DType::kF32;
  } else if (t.dtype.code == kDLBfloat && t.dtype.bits == 16) {
    ref.dtype = DType::kBF16;
  } else if (t.dtype.code == kDLFloat && t.dtype.bits == 16) {
    ref.dtype = DType::kF16;
  } else {
    throw py::type_error(std::string(name) + " must be float32, bfloat16 or float16 (DLPack type code " +
                         std::to_string(t.dtype.code) + ", " + std::to_string(t.dtype.bits) + " bits)");
  }
  if (t.ndim < 1 || t.ndim > 4)
    throw std::invalid_argument(std::string(name) + " must have 1 to 4 dimensions, got " + std::to_string(t.ndim));
  ref.ndim = t.ndim;
  int64_t compact = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    ref.shape[i] = t.shape[i];
    ref.strides[i] = t.strides ? t.strides[i] : compact;
    compact *= t.shape[i];
  }
  ref.data = static_cast<char*>(t.data) + t.byte_offset;
  return ref;
}

std::vector<int64_t> int_list(py::handle obj, const char* name) {
  std::vector<int64_t> out;
  for (py::handle x : py::iter(obj)) {
    if (PyBool_Check(x.ptr()) || !PyLong_Check(x.ptr()))
      throw py::type_error(std::string(name) + " must hold ints, got " + std::string(py::str(py::type::handle_of(x).attr("__name__"))));
    out.push_back(x.cast<int64_t>());
  }
  return out;
}

Isa isa_arg(const py::object& isa) {
  if (isa.is_none()) return default_isa();
  Isa out;
  if (!parse_isa(isa.cast<std::string>(), &out))
    throw std::invalid_argument("isa must be one of " + isa_names() + ", got '" + isa.cast<std::string>() + "'");
  return out;
}

std::string attention_binding(const BatchPlan& plan, py::handle q, py::handle k_cache, py::handle v_cache,
                              py::handle out, py::object k, py::object v, py::object lse, double scale,
                              double softcap, int64_t window, py::object isa) {
  Call call;
  call.q = from_dlpack(q, "q");
  call.k_cache = from_dlpack(k_cache, "k_cache");
  call.v_cache = from_dlpack(v_cache, "v_cache");
  call.out = from_dlpack(out, "out");
  TensorRef k_ref, v_ref;
  if (!k.is_none()) k_ref = from_dlpack(k, "k");
  if (!v.is_none()) v_ref = from_dlpack(v, "v");
  if (!lse.is_none()) call.lse = from_dlpack(lse, "lse");
  call.scale = static_cast<float>(scale);
  call.softcap = static_cast<float>(softcap);
  call.window = window;
  const Isa wanted = isa_arg(isa);
  const TensorRef* k_in = k.is_none() ? nullptr : &k_ref;
  const TensorRef* v_in = v.is_none() ? nullptr : &v_ref;
  const Isa used = without_gil([&] { return attention(plan, call, k_in, v_in, wanted); });
  return isa_name(used);
}

py::dict info() {
  py::dict d;
  std::string note;
  d["isa"] = isa_name(default_isa(&note));
  d["best_isa"] = isa_name(best_isa());
  py::list supported, compiled;
  for (int i = 0; i < kNumIsas; ++i) {
    const Isa isa = static_cast<Isa>(i);
    if (isa_compiled(isa)) compiled.append(isa_name(isa));
    if (isa_supported(isa)) supported.append(isa_name(isa));
  }
  d["supported"] = supported;
  d["compiled"] = compiled;
  py::dict counts;
  for (int i = 0; i < kNumIsas; ++i) counts[isa_name(static_cast<Isa>(i))] = calls(static_cast<Isa>(i));
  d["calls"] = counts;
  d["packed_value_bytes"] = packed_bytes();
  d["threads"] = pool_threads();
  d["decode_prefetch"] = decode_prefetch_to_l2() ? "l2" : "l1";
  d["pool"] = pool_kind();
  d["note"] = note;
  return d;
}

}  // namespace

PYBIND11_MODULE(_cpu_attn, m) {
  m.doc() = "Batched attention on vattn's contiguous KV cache, on the host (see vattn.attention.host_attention).";

  py::register_exception<TypeError>(m, "DTypeError", PyExc_TypeError);

  py::class_<BatchPlan>(m, "Plan", "One forward's requests, validated once and reused by every layer.")
      .def(py::init([](py::handle reqids, py::handle cached_lens, py::handle query_lens) {
             return new BatchPlan(int_list(reqids, "reqids"), int_list(cached_lens, "cached_lens"),
                                  int_list(query_lens, "query_lens"));
           }),
           py::arg("reqids"), py::arg("cached_lens"), py::arg("query_lens"))
      .def_property_readonly("num_tokens", &BatchPlan::num_tokens)
      .def_property_readonly("num_requests", [](const BatchPlan& p) { return p.requests().size(); })
      .def("num_items",
           [](const BatchPlan& p, int32_t group_size, int32_t heads_kv, int64_t window, int32_t head_dim) {
             auto s = p.schedule(group_size, heads_kv, window, pool_threads(), head_dim);
             return py::make_tuple(s->items.size(), s->groups.size());
           },
           py::arg("group_size"), py::arg("heads_kv"), py::arg("window") = 0, py::arg("head_dim") = 128,
           "(work items, split groups) of a call with these heads on this pool.");

  m.def("attention", &attention_binding, py::arg("plan"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("out"), py::arg("k") = py::none(), py::arg("v") = py::none(), py::arg("lse") = py::none(),
        py::arg("scale"), py::arg("softcap") = 0.0, py::arg("window") = 0, py::arg("isa") = py::none(),
        "Attention of one layer over the cache (DLPack capsules); writes out (and lse). Returns the ISA used.");
  m.attr("MAX_HEAD_DIM") = kMaxHeadDim;
  py::tuple dtypes(kNumDTypes);
  for (int i = 0; i < kNumDTypes; ++i) dtypes[i] = torch_dtype_name(static_cast<DType>(i));
  m.attr("DTYPES") = dtypes;
  m.def("info", &info, "ISA chosen and supported, thread pool size, calls run per ISA, bytes of values packed, where decode's in-loop requests go (l1 or l2).");
}
