// A call that raises exactly as the interpreter begins to finalize, for
// tests/core/test_threads_at_exit.py: the GIL is taken back while the call's
// exception is pending, the moment where a daemon thread is ended
// (docs/design.md, "Threads at exit").
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

#include "common/released_gil.h"
#include "testing/testing.h"

namespace vattn {

namespace {

bool interpreter_finalizing() {
  // Reads one runtime field: safe without the GIL.
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Polls every millisecond for up to wait_s seconds (0-60) for the interpreter to begin finalizing,
// without the GIL, then raises RuntimeError either way.
void raise_when_finalizing(double wait_s) {
  if (!(wait_s >= 0 && wait_s <= 60))
    throw std::invalid_argument("raise_when_finalizing: wait_s must be in [0, 60] seconds, got " +
                                std::to_string(wait_s));
  without_gil([wait_s] {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
    while (!interpreter_finalizing() && std::chrono::steady_clock::now() < end)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    // thrown where the GIL is released: the GIL is taken back while it is pending
    if (interpreter_finalizing()) throw std::runtime_error("the interpreter is finalizing");
  });
  throw std::runtime_error("the interpreter did not begin finalizing within wait_s");
}

}  // namespace

void bind_finalization_hooks(py::module_& m) {
  m.def("raise_when_finalizing", &raise_when_finalizing, py::arg("wait_s"),
        "Waits without the GIL up to wait_s seconds (0-60) for the interpreter to begin finalizing, then raises "
        "RuntimeError (from inside the GIL-released region where it began finalizing).");
}

}  // namespace vattn
