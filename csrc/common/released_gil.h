// The GIL released for a scope: every binding that can block (maps, waits,
// attention) uses this instead of pybind11's gil_scoped_release.
//
// Taking the GIL back is where Python 3.11-3.13 ends a thread once the
// interpreter is finalizing: PyEval_RestoreThread calls pthread_exit, which
// unwinds the thread's stack. A daemon thread (a framework's keeper, a
// waiter on a budget, a worker thread) that returns from a vattn call after
// the main thread began to exit meets it there. gil_scoped_release takes the
// GIL back in an implicitly noexcept destructor, where that unwinding calls
// std::terminate: the process aborted ("terminate called without an active
// exception") instead of exiting (docs/design.md, "Threads at exit"). This
// destructor lets the unwinding through, and pybind11's dispatcher rethrows
// it (abi::__forced_unwind), so the thread ends as a pure-Python thread does.
#pragma once

#include <Python.h>

namespace vattn {

class ReleasedGil {
 public:
  ReleasedGil() : state_(PyEval_SaveThread()) {}
  ReleasedGil(const ReleasedGil&) = delete;
  ReleasedGil& operator=(const ReleasedGil&) = delete;
  // noexcept(false): the unwinding passes through. Not while the call's own exception unwinds: a
  // second unwinding begun in a destructor that the first runs ends in std::terminate whatever this
  // declares (tests/core/test_threads_at_exit.py, "raising", aborts now and then; docs/design.md)
  ~ReleasedGil() noexcept(false) { PyEval_RestoreThread(state_); }

 private:
  PyThreadState* state_;
};

}  // namespace vattn
