// The CUDA context an entry point works in, without disturbing the caller's.
#pragma once

#include "backends/cuda_driver.h"
#include "common/errors.h"

namespace vattn {
namespace cu {

// Pushes `ctx` on this thread's context stack for the object's life and pops
// it after, leaving the caller's stack (and its current context) as it was.
class ScopedContext {
 public:
  ScopedContext(const DriverApi& api, CUcontext ctx) noexcept : api_(api) {
    CUcontext current = nullptr;
    rc_ = api_.cuCtxGetCurrent(&current);
    if (rc_ != CUDA_SUCCESS) {
      call_ = "cuCtxGetCurrent";
      return;
    }
    if (current == ctx) return;  // already ours: nothing to undo
    rc_ = api_.cuCtxPushCurrent(ctx);
    if (rc_ != CUDA_SUCCESS) {
      call_ = "cuCtxPushCurrent";
      return;
    }
    pushed_ = true;
  }
  ~ScopedContext() {
    if (pushed_) {
      CUcontext popped = nullptr;
      api_.cuCtxPopCurrent(&popped);
    }
  }
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;
  bool ok() const { return rc_ == CUDA_SUCCESS; }
  CUresult result() const { return rc_; }
  const char* failed_call() const { return call_; }
  void check() const {
    if (!ok()) throw DriverError(call_, error_name(api_, rc_));
  }

 private:
  const DriverApi& api_;
  CUresult rc_ = CUDA_SUCCESS;
  const char* call_ = "";
  bool pushed_ = false;
};


}  // namespace cu
}  // namespace vattn
