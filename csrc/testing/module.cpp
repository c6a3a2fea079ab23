#include "testing/testing.h"

PYBIND11_MODULE(_testing, m) {
  m.doc() = "vattn's test hooks and benchmark probes (not part of the library's API)";
  // vattn._C registers the translation of vattn's C++ exceptions (DriverError,
  // ...) into Python ones, and the VmmBackend type the fault injection takes
  // and returns; importing it first makes both apply here too.
  pybind11::module_::import("vattn._C");
  vattn::bind_bench_probes(m);
  vattn::bind_fault_injection(m);
  vattn::bind_budget_hooks(m);
  vattn::bind_page_table(m);
  vattn::bind_finalization_hooks(m);
}
