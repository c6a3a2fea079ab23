// Exceptions thrown by the C++ core. The bindings translate each to the
// Python class of the same role in vattn.common.errors; nothing here ever exits.
#pragma once

#include <cstring>
#include <stdexcept>
#include <string>

namespace vattn {

// A driver or OS call failed. `call` names it ("cuMemMap", "mmap"), `detail`
// holds the CUresult name or errno text.
class DriverError : public std::runtime_error {
 public:
  DriverError(const std::string& call, const std::string& detail)
      : std::runtime_error(call + " failed: " + detail), call_(call), detail_(detail) {}
  const std::string& call() const { return call_; }
  const std::string& detail() const { return detail_; }

 private:
  std::string call_;
  std::string detail_;
};

// A page could not be created because the device or the host has no memory
// left for it (CUDA_ERROR_OUT_OF_MEMORY from cuMemCreate, ENOSPC / ENOMEM when
// the host commits a page). Someone else may give memory back later, so the
// page manager treats it as a full pool, not as a failure (docs/elastic.md).
class OutOfMemory : public DriverError {
 public:
  using DriverError::DriverError;
};

// The requested backend cannot run here (no driver, no device).
class BackendUnavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// alloc_reqid found every reqid in use.
class OutOfReqids : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A call on a manager after cleanup().
class ClosedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The physical page pool cannot supply what a call needs (fork).
class OutOfPages : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A call on a manager inherited through fork(): it belongs to the parent.
class ForkedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// errno as text with the call name: DriverError("mmap", "ENOMEM: Cannot allocate memory").
[[noreturn]] inline void throw_errno(const std::string& call, int err) {
  throw DriverError(call, "errno " + std::to_string(err) + " (" + std::strerror(err) + ")");
}

}  // namespace vattn
