#include "testing/testing.h"

PYBIND11_MODULE(_testing, m) {
  m.doc() = "vattn's test hooks and benchmark probes (not part of the library's API)";
  // vattn._C registers the translation of vattn's C++ exceptions (DriverError,
  // ...) into Python ones; importing it first makes them apply here too.
  pybind11::module_::import("vattn._C");
  vattn::bind_bench_probes(m);
}
