// The GIL released around a call: every binding that can block (maps, waits,
// attention) runs its work through without_gil (a body) or gil_released (a
// function or method bound as is), never pybind11's gil_scoped_release or a
// call_guard.
//
// Taking the GIL back is where Python 3.11-3.13 ends a thread once the
// interpreter is finalizing: PyEval_RestoreThread calls pthread_exit, which
// unwinds the thread's stack. A daemon thread (a framework's keeper, a waiter
// on a budget, a worker thread) that returns from a vattn call after the main
// thread began to exit meets it there. Two ways that unwinding aborts the
// process ("terminate called without an active exception") instead of ending
// the thread (docs/design.md, "Threads at exit"):
// - the GIL is taken back in a noexcept destructor (gil_scoped_release's);
// - the GIL is taken back in a destructor that runs while the call's own
//   exception unwinds (any scope guard, call_guard included): a second
//   unwinding begun there ends in std::terminate whatever the destructor
//   declares.
// So the body's exception is caught inside the released region, the GIL is
// taken back with nothing unwinding, in a destructor that lets pthread_exit's
// unwinding through, and the exception is thrown again after. pybind11's
// dispatcher rethrows the forced unwinding (abi::__forced_unwind), so the
// thread ends as a pure-Python thread does.
#pragma once

#include <Python.h>
#include <cxxabi.h>

#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

namespace vattn {

namespace detail {

class ReleasedGil {
 public:
  ReleasedGil() : state_(PyEval_SaveThread()) {}
  ReleasedGil(const ReleasedGil&) = delete;
  ReleasedGil& operator=(const ReleasedGil&) = delete;
  // noexcept(false): pthread_exit's unwinding passes through. Only ever destroyed with nothing
  // unwinding (without_gil holds the body's exception meanwhile).
  ~ReleasedGil() noexcept(false) { PyEval_RestoreThread(state_); }

 private:
  PyThreadState* state_;
};

}  // namespace detail

// Runs body() with the GIL released and returns its result (a value, not a reference). An exception
// body throws is thrown again once the GIL is back.
template <class Body>
auto without_gil(Body&& body) -> std::invoke_result_t<Body&> {
  using Result = std::invoke_result_t<Body&>;
  static_assert(!std::is_reference_v<Result>, "without_gil returns values: the GIL guards what a reference reads");
  std::exception_ptr error;
  if constexpr (std::is_void_v<Result>) {
    {
      detail::ReleasedGil released;
      try {
        body();
      } catch (abi::__forced_unwind&) {
        // A thread cancelled inside the body: let it end. (Should the interpreter begin to finalize
        // meanwhile, that unwinding takes the GIL back as a raised one did; vattn cancels no thread.)
        throw;
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
  } else {
    std::optional<Result> result;
    {
      detail::ReleasedGil released;
      try {
        result.emplace(body());
      } catch (abi::__forced_unwind&) {
        throw;
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
    return std::move(*result);
  }
}

// A function or method bound as is (.def("wait", gil_released(&Budget::wait))): the call runs through
// without_gil; the arguments are converted before, and the result after, with the GIL held.
template <class R, class... Args>
auto gil_released(R (*function)(Args...)) {
  return [function](Args... args) -> R {
    return without_gil([&]() -> R { return function(std::forward<Args>(args)...); });
  };
}

template <class R, class C, class... Args>
auto gil_released(R (C::*method)(Args...)) {
  return [method](C& self, Args... args) -> R {
    return without_gil([&]() -> R { return (self.*method)(std::forward<Args>(args)...); });
  };
}

template <class R, class C, class... Args>
auto gil_released(R (C::*method)(Args...) const) {
  return [method](const C& self, Args... args) -> R {
    return without_gil([&]() -> R { return (self.*method)(std::forward<Args>(args)...); });
  };
}

}  // namespace vattn
