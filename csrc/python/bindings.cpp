// Python bindings of the core (module vattn._C). Every call that maps, unmaps,
// creates pages or waits on the device releases the GIL: those calls can take
// milliseconds, and a thread holding the GIL across them would stall the
// serving loop (and deadlock a background thread that needs the GIL).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "backends/backend_registry.h"
#include "backends/vmm_backend.h"
#include "common/dlpack.h"
#include "common/errors.h"
#include "common/released_gil.h"
#include "core/page_manager.h"
#include "python/budget_bindings.h"
#include "python/policy_bindings.h"

namespace py = pybind11;
using namespace vattn;

namespace {

// ---- DLPack ---------------------------------------------------------------

struct CapsuleContext {
  std::shared_ptr<CacheMemory> memory;  // keeps the pages mapped and the range reserved while a view lives
  int64_t shape[1];
  int64_t strides[1];
};

void delete_managed(DLManagedTensor* self) {
  delete static_cast<CapsuleContext*>(self->manager_ctx);
  delete self;
}

void capsule_destructor(PyObject* capsule) {
  // A consumer renames the capsule to "used_dltensor" and owns the deleter;
  // an unconsumed one still holds "dltensor" and is freed here.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    if (managed && managed->deleter) managed->deleter(managed);
  }
}

// A 1-D uint8 DLPack tensor over bytes [offset, offset + nbytes) of the
// cache memory. The Python layer views it with the cache's dtype and strides.
py::object memory_dlpack(const std::shared_ptr<CacheMemory>& memory, size_t offset, size_t nbytes) {
  if (offset > memory->bytes() || nbytes > memory->bytes() - offset)
    throw std::invalid_argument("dlpack: byte range [" + std::to_string(offset) + ", " + std::to_string(offset) +
                                " + " + std::to_string(nbytes) + ") exceeds the reservation of " +
                                std::to_string(memory->bytes()) + " bytes");
  auto* ctx = new CapsuleContext{memory, {static_cast<int64_t>(nbytes)}, {1}};
  auto* managed = new DLManagedTensor{};
  managed->dl_tensor.data = reinterpret_cast<void*>(memory->base() + offset);
  managed->dl_tensor.device = memory->dl_device();
  managed->dl_tensor.ndim = 1;
  managed->dl_tensor.dtype = DLDataType{kDLUInt, 8, 1};
  managed->dl_tensor.shape = ctx->shape;
  managed->dl_tensor.strides = ctx->strides;
  managed->dl_tensor.byte_offset = 0;
  managed->manager_ctx = ctx;
  managed->deleter = delete_managed;
  PyObject* capsule = PyCapsule_New(managed, "dltensor", capsule_destructor);
  if (!capsule) {
    delete_managed(managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}

// ---- integer arrays ---------------------------------------------------------

// Copies a 1-D array of integers into `out` while the GIL is held: a sequence
// of Python ints (or integer scalars: anything with __index__ except bool), or
// any 1-D integer buffer of any stride (numpy arrays and views). Bools,
// floats, mappings and strings are refused with a message naming `name`.
void read_ints(py::handle obj, const char* name, std::vector<int64_t>& out) {
  PyObject* o = obj.ptr();
  if (PyUnicode_Check(o) || PyBytes_Check(o) || PyDict_Check(o) || PyAnySet_Check(o) ||
      (!PyList_Check(o) && !PyTuple_Check(o) && PyMapping_Check(o) && !PyObject_CheckBuffer(o) &&
       PyObject_HasAttrString(o, "keys")))
    throw py::type_error(std::string(name) + " must be a sequence or 1-D array of ints (indexed by position), got " +
                         Py_TYPE(o)->tp_name);
  if (PyObject_CheckBuffer(o)) {
    Py_buffer view;
    if (PyObject_GetBuffer(o, &view, PyBUF_FORMAT | PyBUF_STRIDES) != 0) {
      PyErr_Clear();
      throw py::type_error(std::string(name) + " must be a readable 1-D integer array");
    }
    std::string fmt = view.format ? view.format : "B";
    if (!fmt.empty() && (fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@' || fmt[0] == '!' || fmt[0] == '>'))
      fmt = fmt.substr(1);
    const bool is_signed = fmt == "b" || fmt == "h" || fmt == "i" || fmt == "l" || fmt == "q" || fmt == "n";
    const bool is_unsigned = fmt == "B" || fmt == "H" || fmt == "I" || fmt == "L" || fmt == "Q" || fmt == "N";
    if (view.ndim != 1 || !(is_signed || is_unsigned)) {
      int ndim = view.ndim;
      PyBuffer_Release(&view);
      throw py::type_error(std::string(name) + " must be a 1-D integer array (not bool or float), got format '" +
                           fmt + "' with " + std::to_string(ndim) + " dimension(s)");
    }
    const size_t n = static_cast<size_t>(view.shape[0]);
    const Py_ssize_t stride = view.strides ? view.strides[0] : view.itemsize;
    out.resize(n);
    const char* base = static_cast<const char*>(view.buf);
    for (size_t i = 0; i < n; ++i) {
      const char* p = base + static_cast<Py_ssize_t>(i) * stride;
      int64_t v = 0;
      uint64_t u = 0;
      switch (view.itemsize) {
        case 1: if (is_signed) v = *reinterpret_cast<const int8_t*>(p); else u = *reinterpret_cast<const uint8_t*>(p); break;
        case 2: if (is_signed) v = *reinterpret_cast<const int16_t*>(p); else u = *reinterpret_cast<const uint16_t*>(p); break;
        case 4: if (is_signed) v = *reinterpret_cast<const int32_t*>(p); else u = *reinterpret_cast<const uint32_t*>(p); break;
        default: if (is_signed) v = *reinterpret_cast<const int64_t*>(p); else u = *reinterpret_cast<const uint64_t*>(p); break;
      }
      if (is_unsigned) {
        if (u > static_cast<uint64_t>(INT64_MAX)) {
          PyBuffer_Release(&view);
          throw std::invalid_argument(std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(u) +
                                      " is beyond int64");
        }
        v = static_cast<int64_t>(u);
      }
      out[i] = v;
    }
    PyBuffer_Release(&view);
    return;
  }
  PyObject* seq = PySequence_Fast(o, "");
  if (!seq) {
    PyErr_Clear();
    throw py::type_error(std::string(name) + " must be a sequence or 1-D array of ints, got " + Py_TYPE(o)->tp_name);
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    // Index protocol: ints and integer scalars (numpy, torch) but not floats or bools.
    bool is_bool = PyBool_Check(item) || std::string(Py_TYPE(item)->tp_name).find("bool") != std::string::npos;
    PyObject* idx = is_bool ? nullptr : PyNumber_Index(item);
    int overflow = 0;
    long long v = idx ? PyLong_AsLongLongAndOverflow(idx, &overflow) : -1;
    Py_XDECREF(idx);
    if (!idx || overflow || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      std::string type = Py_TYPE(item)->tp_name;
      Py_DECREF(seq);
      if (overflow)
        throw std::invalid_argument(std::string(name) + "[" + std::to_string(i) + "] is beyond int64");
      throw py::type_error(std::string(name) + "[" + std::to_string(i) + "] must be an int, got " + type);
    }
    out[i] = v;
  }
  Py_DECREF(seq);
}

std::vector<uint32_t> page_range(const VmmBackend& b, uint32_t first, uint32_t count) {
  if (static_cast<size_t>(first) + count > b.num_pages())
    throw std::invalid_argument("pages [" + std::to_string(first) + ", " +
                                std::to_string(static_cast<size_t>(first) + count) +
                                ") exceed the pool of " + std::to_string(b.num_pages()) + " pages");
  std::vector<uint32_t> ids(count);
  for (uint32_t i = 0; i < count; ++i) ids[i] = first + i;
  return ids;
}

// A binding taking (first, count) for a backend call on page ids [first, first + count).
template <typename Op>
auto on_page_range(Op op) {
  return [op](VmmBackend& b, uint32_t first, uint32_t count) {
    auto ids = page_range(b, first, count);
    without_gil([&] { (b.*op)(ids.data(), ids.size()); });
  };
}

// Page ids as the core takes them (uint32). A value no uint32 holds is
// refused here with the range the core checks the others against (num_ids is
// below 2^32 - 1); the core validates the rest under its lock.
std::vector<uint32_t> to_ids(const std::vector<int64_t>& values, const char* what, const char* name,
                             size_t num_ids) {
  std::vector<uint32_t> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] < 0 || values[i] >= static_cast<int64_t>(UINT32_MAX))
      throw std::invalid_argument(std::string(what) + ": " + name + "[" + std::to_string(i) + "] must be in [0, " +
                                  std::to_string(num_ids - 1) + "] (num_page_ids), got " +
                                  std::to_string(values[i]));
    out[i] = static_cast<uint32_t>(values[i]);
  }
  return out;
}

// A page-table call per reqid: reqids[i] with values[i] (equal lengths), run without the GIL (unmapping
// waits for the device and the driver). ``api`` and ``values_name`` name the Python call and argument.
template <class Method>
auto per_reqid_call(Method method, const char* api, const char* values_name) {
  return [=](PageManager& pm, py::handle reqids_obj, py::handle values_obj) {
    std::vector<int64_t> reqids, values;
    read_ints(reqids_obj, "reqids", reqids);
    read_ints(values_obj, values_name, values);
    if (values.size() != reqids.size())
      throw std::invalid_argument(std::string(api) + ": reqids and " + values_name + " must have equal lengths");
    without_gil([&] { (pm.*method)(reqids.data(), values.data(), reqids.size()); });
  };
}

// The counters, taken under the manager's lock without the GIL (a step mapping pages may hold the lock).
PageStats stats_without_gil(const PageManager& pm) {
  return without_gil([&] { return pm.stats(); });
}

py::dict stats_dict(const PageStats& s, size_t page_size) {
  py::dict d;
  d["pages_total"] = s.pages_total;
  d["pages_created"] = s.pages_created;
  d["pages_mapped"] = s.pages_mapped;
  d["pages_in_use"] = s.pages_in_use;
  d["page_mappings"] = s.page_mappings;
  d["pages_free"] = s.pages_total - s.pages_in_use;
  d["pages_orphaned"] = s.pages_orphaned;
  d["bytes_saved_by_sharing"] = (s.page_mappings - std::min(s.page_mappings, s.pages_mapped)) * page_size;
  d["prefix_handles"] = s.prefix_handles;
  d["forks"] = s.forks;
  d["pages_copied"] = s.pages_copied;
  d["pages_mapped_peak"] = s.pages_mapped_peak;
  d["bytes_mapped"] = s.pages_mapped * page_size;
  d["pages_in_requests"] = s.pages_in_requests;
  d["bytes_in_requests"] = s.pages_in_requests * page_size;
  d["bytes_mapped_peak"] = s.pages_mapped_peak * page_size;
  d["reqids_allocated"] = s.reqids_allocated;
  d["tokens_active"] = s.tokens_active;
  d["step_calls"] = s.step_calls;
  d["failed_steps"] = s.failed_steps;
  d["sync_page_maps"] = s.sync_page_maps;
  d["page_unmaps"] = s.page_unmaps;
  d["reclaimed_pages"] = s.reclaimed_pages;
  d["background_page_maps"] = s.background_page_maps;
  d["background_reclaimed_pages"] = s.background_reclaimed_pages;
  d["mapper_wakeups"] = s.mapper_wakeups;
  d["mapper_rounds"] = s.mapper_rounds;
  d["mapper_errors"] = s.mapper_errors;
  d["step_wait_us"] = static_cast<double>(s.step_wait_ns) / 1e3;
  d["pages_free_low"] = s.pages_free_low;
  d["pages_released"] = s.pages_released;
  d["pages_release_failed"] = s.pages_release_failed;
  d["pages_unreleased"] = s.pages_unreleased;
  d["creations_refused"] = s.creations_refused;
  return d;
}

// `o` as a Python int when it is an integer scalar (int, numpy or torch
// integer scalars), else null: an array's __index__ fails, so arrays go on to
// be read as sequences.
py::object scalar_index(PyObject* o) {
  PyObject* index = PyIndex_Check(o) ? PyNumber_Index(o) : nullptr;
  if (!index) PyErr_Clear();
  return py::reinterpret_steal<py::object>(index);
}

// A probe's keyword arguments as the registry takes them, each by its Python
// type: bool (before int: True is an int too), float, str, int (a scalar with
// __index__), or a sequence or 1-D array of ints. Others are refused naming
// the argument.
ProbeData probe_args(const std::string& what, const py::kwargs& kwargs) {
  ProbeData out;
  for (const auto& [key, value] : kwargs) {
    const std::string arg = py::cast<std::string>(key), name = what + ": " + arg;
    PyObject* o = value.ptr();
    if (PyBool_Check(o)) {
      out.emplace_back(arg, o == Py_True);
    } else if (PyFloat_Check(o)) {
      out.emplace_back(arg, PyFloat_AsDouble(o));
    } else if (PyUnicode_Check(o)) {
      out.emplace_back(arg, py::cast<std::string>(value));
    } else if (py::object index = scalar_index(o)) {
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
      if (overflow) throw std::invalid_argument(name + " is beyond int64");
      out.emplace_back(arg, int64_t{v});
    } else if (PySequence_Check(o) || PyObject_CheckBuffer(o)) {
      std::vector<int64_t> ints;
      read_ints(value, name.c_str(), ints);
      out.emplace_back(arg, std::move(ints));
    } else {
      throw py::type_error(name + " must be a bool, int, float, str or a sequence of ints, got " +
                           Py_TYPE(o)->tp_name);
    }
  }
  return out;
}

void register_errors() {
  py::module_ errors = py::module_::import("vattn.common.errors");
  // Strong references kept for the life of the process on purpose: a static
  // py::object would be decref'd after the interpreter is gone.
  static PyObject* driver_error = py::object(errors.attr("DriverError")).release().ptr();
  static PyObject* unavailable = py::object(errors.attr("BackendUnavailable")).release().ptr();
  static PyObject* out_of_reqids = py::object(errors.attr("OutOfReqids")).release().ptr();
  static PyObject* closed = py::object(errors.attr("ClosedError")).release().ptr();
  static PyObject* out_of_pages = py::object(errors.attr("OutOfPages")).release().ptr();
  static PyObject* forked = py::object(errors.attr("ForkedError")).release().ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const DriverError& e) {
      py::object exc = py::reinterpret_borrow<py::object>(driver_error)(e.what(), e.call(), e.detail());
      PyErr_SetObject(driver_error, exc.ptr());
    } catch (const BackendUnavailable& e) {
      PyErr_SetString(unavailable, e.what());
    } catch (const OutOfReqids& e) {
      PyErr_SetString(out_of_reqids, e.what());
    } catch (const ClosedError& e) {
      PyErr_SetString(closed, e.what());
    } catch (const OutOfPages& e) {
      PyErr_SetString(out_of_pages, e.what());
    } catch (const ForkedError& e) {
      PyErr_SetString(forked, e.what());
    }
  });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "vattn core: VMM backends and page bookkeeping (no torch dependency)";
  register_errors();
  bind_budget(m);
  bind_policy(m);

  py::class_<VmmBackend, std::shared_ptr<VmmBackend>>(m, "VmmBackend")
      .def_property_readonly("name", &VmmBackend::name)
      .def_property_readonly("granularity", &VmmBackend::granularity)
      .def_property_readonly("page_size", &VmmBackend::page_size)
      .def_property_readonly("num_pages", &VmmBackend::num_pages)
      .def("reserve", gil_released(&VmmBackend::reserve), py::arg("nbytes"))
      .def("free_reservation", gil_released(&VmmBackend::free_reservation), py::arg("base"), py::arg("nbytes"))
      .def("create_pages", on_page_range(&VmmBackend::create_pages), py::arg("first"),
           py::arg("count"), "Create pages [first, first + count).")
      .def(
          "release_pages",
          [](VmmBackend& b, uint32_t first, uint32_t count) {
            auto ids = page_range(b, first, count);
            return without_gil([&] { return b.release_pages(ids.data(), ids.size()); });
          },
          py::arg("first"), py::arg("count"),
          "Release pages [first, first + count); returns how many kept their memory (the release failed).")
      .def(
          "map",
          [](VmmBackend& b, const std::vector<std::pair<uintptr_t, uint32_t>>& pairs) {
            std::vector<PageMapping> maps;
            maps.reserve(pairs.size());
            for (auto& [addr, page] : pairs) {
              if (page >= b.num_pages())
                throw std::invalid_argument("map: page " + std::to_string(page) +
                                            " is outside the pool of " +
                                            std::to_string(b.num_pages()) + " pages");
              maps.push_back(PageMapping{addr, page});
            }
            without_gil([&] {
              size_t done = 0;
              b.map(maps.data(), maps.size(), &done);
            });
          },
          py::arg("mappings"), "Map [(address, page), ...] in one call.")
      .def(
          "unmap",
          [](VmmBackend& b, const std::vector<uintptr_t>& addrs) {
            without_gil([&] {
              size_t done = 0;
              b.unmap(addrs.data(), addrs.size(), &done);
            });
          },
          py::arg("addresses"))
      .def(
          "populate",
          [](VmmBackend& b, const std::vector<uintptr_t>& addrs) {
            without_gil([&] { b.populate(addrs.data(), addrs.size()); });
          },
          py::arg("addresses"),
          "Make the page-table entries of the mapped pages at these addresses now (host: "
          "MADV_POPULATE_READ; a hint, no error).")
      .def("synchronize", gil_released(&VmmBackend::synchronize))
      .def("set_sync_streams", gil_released(&VmmBackend::set_sync_streams), py::arg("streams"),
           "Raw stream handles whose work may read mapped pages: read fences and synchronize() "
           "wait for events on those instead of the whole device. Empty: the whole device.")
      // Blocks until the other threads' driver calls under way are done.
      .def("suspend_driver_calls", gil_released(&VmmBackend::suspend_driver_calls))
      .def("resume_driver_calls", &VmmBackend::resume_driver_calls)
      .def("capture_begin", gil_released(&VmmBackend::capture_begin),
           "A CUDA graph capture began in this process: calls that reach the driver fail until "
           "capture_end (counted). Waits for the calls under way.")
      .def("capture_end", &VmmBackend::capture_end)
      .def_property_readonly(
          "facts",
          [](const VmmBackend& b) {
            py::dict d;
            for (auto& [key, value] : b.facts()) d[py::str(key)] = value;
            return d;
          },
          "What the backend learned about its driver at run time (CUDA: unmap mode and probe, "
          "reservation alignment, synchronization).");

  m.def(
      "make_backend",
      [](const std::string& name, int device_index, size_t page_size, size_t num_pages,
         const std::string& driver_path) {
        return without_gil(
            [&] { return make_backend(name, BackendParams{device_index, page_size, num_pages, driver_path}); });
      },
      py::arg("name"), py::arg("device_index"), py::arg("page_size"), py::arg("num_pages"),
      py::arg("driver_path") = "",
      "The C++ backend registered as `name` (see backend_registry.h) for one cache: pages of "
      "page_size bytes, a pool of num_pages pages, on device `device_index` of its kind; "
      "driver_path: the driver library, for backends that load one (\"\": their default).");
  m.def("backend_factories", &backend_factory_names, "Names of the C++ backends this build registered.");
  m.def(
      "backend_probe",
      [](const std::string& backend, const std::string& probe, const py::kwargs& kwargs) {
        ProbeData args = probe_args(backend + "." + probe, kwargs);
        // probes call drivers and open devices
        ProbeData answer = without_gil([&] { return run_backend_probe(backend, probe, args); });
        py::dict d;
        for (const auto& [key, value] : answer) d[py::str(key)] = py::cast(value);
        return d;
      },
      py::arg("backend"), py::arg("probe"),
      "Probe `probe` of the C++ backend registered as `backend` (backend_registry.h), with its arguments as "
      "keywords (bool, int, float, str or a list of ints); returns its answer as a dict. backend_probes() "
      "lists them.");
  m.def(
      "backend_probes",
      [] {
        py::dict out;
        for (const auto& [backend, probes] : backend_probes()) {
          py::dict each;
          for (const BackendProbe& p : probes)
            each[py::str(p.name)] = py::dict(py::arg("doc") = p.doc, py::arg("args") = p.args);
          out[py::str(backend)] = each;
        }
        return out;
      },
      "Every C++ backend's probes: {backend: {probe: {doc, args}}}.");

  py::class_<CacheMemory, std::shared_ptr<CacheMemory>>(m, "CacheMemory")
      .def_property_readonly("base", &CacheMemory::base)
      .def_property_readonly("nbytes", &CacheMemory::bytes)
      .def_property_readonly(
          "backend", [](const CacheMemory& m) { return m.backend_ptr(); },
          "The VMM backend the memory lives on (streams, graph capture, driver facts).")
      .def("dlpack", &memory_dlpack, py::arg("offset"), py::arg("nbytes"),
           "A DLPack capsule (1-D uint8) over bytes [offset, offset + nbytes).");

  py::class_<PageManager>(m, "PageManager")
      .def(py::init([](std::shared_ptr<VmmBackend> backend, size_t num_buffers, size_t num_reqids,
                       size_t slice_bytes, size_t bytes_per_token, size_t max_tokens, bool external_ids,
                       const PolicyConfig& policy, bool preallocate, std::shared_ptr<BudgetMember> budget,
                       double idle_release_s) {
             PageManagerConfig c{num_buffers, num_reqids, slice_bytes, bytes_per_token, max_tokens, external_ids,
                                 preallocate};
             // preallocation creates pages; a budget's lock may be slow
             return without_gil([&] {
               return new PageManager(std::move(backend), c, policy, BudgetLink{std::move(budget), idle_release_s});
             });
           }),
           py::arg("backend"), py::arg("num_buffers"), py::arg("num_reqids"),
           py::arg("slice_bytes"), py::arg("bytes_per_token"), py::arg("max_tokens"),
           py::arg("external_ids") = false, py::arg("policy") = PolicyConfig{},
           py::arg("preallocate") = false, py::arg("budget") = nullptr, py::arg("idle_release_s") = 0.0)
      .def_property_readonly(
          "policy", [](const PageManager& pm) { return pm.policy(); },
          "The policy the manager runs with (a copy: it is fixed at construction).")
      // waits for the round in flight
      .def("pause_mapper", gil_released(&PageManager::pause_mapper), py::arg("paused"))
      .def("pause_for_capture", gil_released(&PageManager::pause_for_capture), py::arg("begin"),
           "A CUDA graph capture in this process began (True; waits for the round in flight) or ended "
           "(False): counted; meanwhile the mapper and the keeper start no driver work.")
      .def("wait_idle", gil_released(&PageManager::wait_idle),
           "Block until the background mapper has nothing left to do.")
      .def("alloc_reqid", gil_released(&PageManager::alloc_reqid), py::arg("prompt_tokens") = -1,
           py::arg("wanted_reqid") = -1)
      .def("free_reqid", gil_released(&PageManager::free_reqid), py::arg("reqid"))
      .def(
          "step",
          [](PageManager& pm, py::handle seq_lens) {
            thread_local std::vector<int64_t> lens;
            read_ints(seq_lens, "seq_lens", lens);
            return without_gil([&] { return pm.step(lens.data(), lens.size()); });
          },
          py::arg("seq_lens"))
      .def(
          "reclaim",
          [](PageManager& pm, size_t max_pages) {
            size_t nb = pm.config().num_buffers;
            size_t ids = max_pages / nb + (max_pages % nb != 0);  // every buffer's page of an id goes together
            return without_gil([&] { return pm.reclaim(ids); });
          },
          py::arg("max_pages"))
      .def(
          "release_free",
          [](PageManager& pm, size_t max_pages) {
            size_t nb = pm.config().num_buffers;
            size_t ids = max_pages / nb + (max_pages % nb != 0);
            return without_gil([&] { return pm.release_free(ids); });
          },
          py::arg("max_pages"), "Release up to max_pages free pages (whole page ids); returns the pages released.")
      .def(
          "release_external",
          [](PageManager& pm, py::handle page_ids) {
            std::vector<int64_t> raw;
            read_ints(page_ids, "page_ids", raw);
            std::vector<uint32_t> ids = to_ids(raw, "release_pages", "page_ids", pm.num_ids());
            return without_gil([&] { return pm.release_external(ids.data(), ids.size()); });
          },
          py::arg("page_ids"),
          "External ids: release the pages of the given created, unreferenced ids; returns the ids released.")
      .def("wait_for_budget", gil_released(&PageManager::wait_for_budget), py::arg("timeout_s"),
           "After a step the budget refused: block until memory may have come free there, or timeout_s.")
      .def("budget_share",
           [](const PageManager& pm) {
             BudgetShare share = without_gil([&] { return pm.budget_share(); });
             py::dict d;
             d["budget"] = share.budget;
             d["held_bytes"] = share.held_bytes;
             d["in_use_bytes"] = share.in_use_bytes;
             d["free_held_bytes"] = share.free_held_bytes;
             d["detached"] = share.detached;
             return d;
           })
      .def("reclaim_freed", gil_released(&PageManager::reclaim_freed), py::arg("wait"))
      .def("fork", gil_released(&PageManager::fork), py::arg("src"), py::arg("num_tokens"))
      .def("retain_prefix", gil_released(&PageManager::retain_prefix), py::arg("reqid"), py::arg("num_tokens"))
      .def("attach_prefix", gil_released(&PageManager::attach_prefix), py::arg("handle"), py::arg("reqid"))
      .def("release_prefix", gil_released(&PageManager::release_prefix), py::arg("handle"))
      .def("prefix_ids", gil_released(&PageManager::prefix_ids), py::arg("handle"))
      .def(
          "map_pages",
          [](PageManager& pm, py::handle reqids_obj, py::handle starts_obj, py::handle counts_obj,
             py::handle ids_obj) {
            std::vector<int64_t> reqids, starts, counts, raw_ids;
            read_ints(reqids_obj, "reqids", reqids);
            read_ints(starts_obj, "starts", starts);
            read_ints(counts_obj, "counts", counts);
            read_ints(ids_obj, "page_ids", raw_ids);
            if (starts.size() != reqids.size() || counts.size() != reqids.size())
              throw std::invalid_argument("map_pages: reqids, starts and counts must have equal lengths, got " +
                                          std::to_string(reqids.size()) + ", " + std::to_string(starts.size()) +
                                          ", " + std::to_string(counts.size()));
            std::vector<int64_t> offsets(reqids.size() + 1, 0);
            for (size_t i = 0; i < counts.size(); ++i) {
              if (counts[i] < 0)
                throw std::invalid_argument("map_pages: counts[" + std::to_string(i) + "] must be >= 0, got " +
                                            std::to_string(counts[i]));
              if (__builtin_add_overflow(offsets[i], counts[i], &offsets[i + 1]))
                throw std::invalid_argument("map_pages: counts overflow");
            }
            std::vector<uint32_t> ids = to_ids(raw_ids, "map_pages", "page_ids", pm.num_ids());
            without_gil([&] {
              pm.map_pages(reqids.data(), starts.data(), offsets.data(), reqids.size(), ids.data(), ids.size());
            });
          },
          py::arg("reqids"), py::arg("starts"), py::arg("counts"), py::arg("page_ids"))
      .def("unmap_pages", per_reqid_call(&PageManager::unmap_pages, "unmap_pages", "keep"), py::arg("reqids"),
           py::arg("keep"))
      .def("unmap_pages_below", per_reqid_call(&PageManager::unmap_pages_below, "unmap_pages_below", "first"), py::arg("reqids"),
           py::arg("first"))
      .def("reqid_page_ids", gil_released(&PageManager::reqid_page_ids), py::arg("reqid"))
      .def(
          "table",
          [](const PageManager& pm) {
            std::vector<std::pair<uintptr_t, uint32_t>> out;
            for (const TableEntry& e : without_gil([&] { return pm.table(); })) out.emplace_back(e.addr, e.page);
            return out;
          },
          "Every (address, physical page) the page table holds, orphans included.")
      .def("check_usable", gil_released(&PageManager::check_usable))
      .def("check_invariants", gil_released(&PageManager::check_invariants))
      .def("close", gil_released(&PageManager::close))
      .def_property_readonly("closed", gil_released(&PageManager::closed))
      .def("mapped_pages", gil_released(&PageManager::mapped_pages), py::arg("reqid"))
      .def("backed_pages", gil_released(&PageManager::backed_pages), py::arg("reqid"))
      .def("reqid_allocated", gil_released(&PageManager::reqid_allocated), py::arg("reqid"))
      .def("reads_done", gil_released(&PageManager::reads_done), py::arg("reqid"))
      .def(
          "check_mapped",
          [](const PageManager& pm, py::handle reqids_obj, py::handle tokens_obj, const std::string& what,
             py::handle firsts_obj) {
            std::vector<int64_t> reqids, tokens, firsts;
            read_ints(reqids_obj, "reqids", reqids);
            read_ints(tokens_obj, "seq_lens", tokens);
            if (!firsts_obj.is_none()) read_ints(firsts_obj, "first_rows", firsts);
            if (tokens.size() != reqids.size() || (!firsts_obj.is_none() && firsts.size() != reqids.size()))
              throw std::invalid_argument(what + ": reqids, seq_lens and first_rows must have equal lengths, got " +
                                          std::to_string(reqids.size()) + ", " + std::to_string(tokens.size()) +
                                          " and " + std::to_string(firsts.size()));
            without_gil([&] {
              pm.check_mapped(reqids.data(), tokens.data(), reqids.size(), what,
                              firsts_obj.is_none() ? nullptr : firsts.data());
            });
          },
          py::arg("reqids"), py::arg("seq_lens"), py::arg("what"), py::arg("first_rows") = py::none(),
          "Raises ValueError unless each reqid's rows [first_rows[i] (default 0), seq_lens[i]) are mapped.")
      .def("stats", [](const PageManager& pm) { return stats_dict(stats_without_gil(pm), pm.page_size()); })
      // Read once per forward by the vLLM worker: one number, without building the stats dict.
      .def_property_readonly("bytes_mapped",
                             [](const PageManager& pm) { return stats_without_gil(pm).pages_mapped * pm.page_size(); })
      .def_property_readonly("bytes_in_requests",
                             [](const PageManager& pm) {
                               return stats_without_gil(pm).pages_in_requests * pm.page_size();
                             })
      // Read per layer by the kernels' mapping check: unchanged since a check passed, the check holds. No lock.
      .def_property_readonly("shrinks", &PageManager::shrinks)
      .def_property_readonly("page_size", &PageManager::page_size)
      .def_property_readonly("num_ids", &PageManager::num_ids)
      .def_property_readonly("buffer_bytes", &PageManager::buffer_bytes)
      .def_property_readonly("memory", gil_released(&PageManager::memory))
      .def_property_readonly("backend_name", [](const PageManager& pm) { return pm.backend().name(); });

  m.attr("build_info") = py::dict(
      py::arg("compiler") = std::string(__VERSION__), py::arg("cplusplus") = __cplusplus,
      py::arg("pybind11") = std::to_string(PYBIND11_VERSION_MAJOR) + "." +
                            std::to_string(PYBIND11_VERSION_MINOR) + "." +
                            std::to_string(PYBIND11_VERSION_PATCH),
      py::arg("dlpack_capsule") = "dltensor (v0.8 ABI)");
}
