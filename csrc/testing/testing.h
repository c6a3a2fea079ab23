// vattn._testing: test hooks and benchmark probes, kept out of the production
// extension vattn._C. Each file of csrc/testing binds its part of the module
// with one bind_* function, called from module.cpp; registered_backend.cpp
// registers a backend in the library's registry instead.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace vattn {

namespace py = pybind11;

void bind_bench_probes(py::module_& m);
void bind_fault_injection(py::module_& m);  // fault_injection.cpp
void bind_budget_hooks(py::module_& m);     // budget_hooks.cpp
void bind_page_table(py::module_& m);       // page_table_probe.cpp: the page table and the policy alone
void bind_finalization_hooks(py::module_& m);  // finalization_hooks.cpp

}  // namespace vattn
