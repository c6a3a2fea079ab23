// Every call that takes the budget's lock releases the GIL: the lock is shared
// with other processes, and a holder may be slow (or stopped, until the lock
// timeout), so waiting for it must not stall this process's other Python
// threads.
#include "python/budget_bindings.h"

#include <pybind11/stl.h>

#include "budget/budget.h"
#include "common/released_gil.h"

namespace py = pybind11;

namespace vattn {

namespace {

void register_budget_error() {
  // A strong reference kept for the life of the process on purpose: a static
  // py::object would be decref'd after the interpreter is gone.
  static PyObject* budget_error =
      py::object(py::module_::import("vattn.common.errors").attr("BudgetError")).release().ptr();
  static PyObject* lock_timeout =
      py::object(py::module_::import("vattn.common.errors").attr("BudgetLockTimeout")).release().ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const BudgetLockTimeout& e) {  // a subclass: caught first
      PyErr_SetString(lock_timeout, e.what());
    } catch (const BudgetError& e) {
      PyErr_SetString(budget_error, e.what());
    }
  });
}

py::dict usage_dict(const BudgetUsage& u) {
  py::dict d;
  d["name"] = u.name;
  d["device"] = u.device;
  d["limit_bytes"] = u.limit_bytes;
  d["held_bytes"] = u.held_bytes;
  d["in_use_bytes"] = u.in_use_bytes;
  d["free_held_bytes"] = u.free_held_bytes;
  d["waiting_bytes"] = u.waiting_bytes;
  d["max_members"] = u.max_members;
  d["created_unix_seconds"] = u.created_unix_seconds;
  py::list members;
  for (const BudgetMemberUsage& m : u.members) {
    py::dict row;
    row["id"] = m.id;
    row["pid"] = m.pid;
    row["label"] = m.label;
    row["held_bytes"] = m.held_bytes;
    row["in_use_bytes"] = m.in_use_bytes;
    row["free_held_bytes"] = m.free_held_bytes;
    row["waiting_bytes"] = m.waiting_bytes;
    row["waiting_seconds"] = m.waiting_seconds;
    row["joined_unix_seconds"] = m.joined_unix_seconds;
    members.append(row);
  }
  d["members"] = members;
  return d;
}

}  // namespace

void bind_budget(py::module_& m) {
  register_budget_error();

  py::class_<Budget, std::shared_ptr<Budget>>(m, "Budget",
                                              "A machine-wide memory budget in shared memory (see vattn.Budget).")
      .def_static("create", gil_released(&Budget::create), py::arg("name"), py::arg("limit_bytes"), py::arg("device"),
                  py::arg("max_members") = budget::kDefaultMaxMembers,
                  py::arg("lock_timeout_s") = Budget::kDefaultLockTimeoutSeconds)
      .def_static("attach", gil_released(&Budget::attach), py::arg("name"),
                  py::arg("lock_timeout_s") = Budget::kDefaultLockTimeoutSeconds)
      .def_static("remove", gil_released(&Budget::remove), py::arg("name"), py::arg("force") = false)
      .def_static("names", gil_released(&Budget::names))
      .def_static("remove_leftovers", gil_released(&Budget::remove_leftovers))
      .def_property_readonly("name", &Budget::name)
      .def_property_readonly("device", &Budget::device)
      .def_property_readonly("max_members", &Budget::max_members)
      .def_property_readonly("lock_timeout_s", &Budget::lock_timeout_s)
      // Lock-free reads; a truncated segment reads as zeros, so say so instead.
      .def_property_readonly("limit_bytes", [](const Budget& b) { return b.check_intact(), b.limit_bytes(); })
      .def_property_readonly("held_bytes", [](const Budget& b) { return b.check_intact(), b.held_bytes(); })
      .def_property_readonly("available_bytes", [](const Budget& b) { return b.check_intact(), b.available_bytes(); })
      .def("set_limit", gil_released(&Budget::set_limit), py::arg("limit_bytes"))
      .def("usage",
           [](Budget& b) {
             return usage_dict(without_gil([&] { return b.usage(); }));
           })
      .def("join", gil_released(&Budget::join), py::arg("label"));

  py::class_<BudgetMember, std::shared_ptr<BudgetMember>>(m, "BudgetMember", "One KV cache manager's share of a budget.")
      .def("try_grant", gil_released(&BudgetMember::try_grant), py::arg("nbytes"), py::arg("record_wait") = true)
      .def("release", gil_released(&BudgetMember::release), py::arg("nbytes"))
      .def("report", gil_released(&BudgetMember::report), py::arg("in_use_bytes"), py::arg("free_held_bytes"))
      .def("pressure", gil_released(&BudgetMember::pressure))
      .def("clear_wait", gil_released(&BudgetMember::clear_wait))
      .def("wait_for_memory", gil_released(&BudgetMember::wait_for_memory), py::arg("timeout_s"))
      .def("leave", gil_released(&BudgetMember::leave))
      .def_property_readonly("held_bytes", &BudgetMember::held_bytes)
      .def_property_readonly("id", &BudgetMember::id)
      .def_property_readonly("label", &BudgetMember::label)
      .def_property_readonly("budget", &BudgetMember::budget);
}

}  // namespace vattn
