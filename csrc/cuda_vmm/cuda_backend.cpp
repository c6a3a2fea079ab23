// CUDA backend: the driver's virtual memory management API.
//   reserve = cuMemAddressReserve      create  = cuMemCreate (one handle per page)
//   map     = cuMemMap + cuMemSetAccess unmap  = cuMemUnmap (one page per call,
//             since an unmap must cover a whole earlier cuMemMap range)
// Every entry point first makes the device's primary context current on the
// calling thread: the driver needs one, and a mapper thread has none of its own.
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "errors.h"
#include "vmm_backend.h"

namespace vattn {

namespace {

using namespace cu;

class CudaBackend final : public VmmBackend {
 public:
  CudaBackend(const DriverApi& api, int device, size_t page_size, size_t num_pages)
      : api_(api), device_(device), page_size_(page_size), handles_(num_pages, 0) {
    check("cuDeviceGet", api_.cuDeviceGet(&dev_, device));
    check("cuDevicePrimaryCtxRetain", api_.cuDevicePrimaryCtxRetain(&ctx_, dev_));
    prop_ = CUmemAllocationProp{};
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = dev_;
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    try {
      ensure_context();
      check("cuMemGetAllocationGranularity",
            api_.cuMemGetAllocationGranularity(&granularity_, &prop_,
                                               CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    } catch (...) {
      api_.cuDevicePrimaryCtxRelease(dev_);
      throw;
    }
    if (page_size_ == 0 || page_size_ % granularity_ != 0) {
      api_.cuDevicePrimaryCtxRelease(dev_);
      throw std::invalid_argument("page_size must be a positive multiple of the CUDA granularity " +
                                  std::to_string(granularity_) + " bytes, got " +
                                  std::to_string(page_size_));
    }
  }

  ~CudaBackend() override {
    if (forked_) return;  // the parent's handles and context
    // Pages still created here were never handed out or the manager is being
    // torn down after an error; release them so nothing leaks. Errors are
    // ignored: destructors never throw, and at process exit the driver may
    // already be deinitialised.
    bool have_ctx = set_context_noexcept();
    for (auto& h : handles_)
      if (h && have_ctx) api_.cuMemRelease(h);
    api_.cuDevicePrimaryCtxRelease(dev_);
  }

  std::string name() const override { return "cuda"; }
  size_t granularity() const override { return granularity_; }
  size_t page_size() const override { return page_size_; }
  size_t num_pages() const override { return handles_.size(); }
  DLDevice dl_device() const override { return DLDevice{kDLCUDA, device_}; }

  uintptr_t reserve(size_t bytes) override {
    ensure_context();
    CUdeviceptr ptr = 0;
    check("cuMemAddressReserve", api_.cuMemAddressReserve(&ptr, bytes, page_size_, 0, 0));
    return static_cast<uintptr_t>(ptr);
  }

  bool free_reservation(uintptr_t base, size_t bytes) noexcept override {
    if (forked_ || !set_context_noexcept()) return false;
    return api_.cuMemAddressFree(static_cast<CUdeviceptr>(base), bytes) == CUDA_SUCCESS;
  }

  void create_pages(const uint32_t* ids, size_t count) override {
    ensure_context();
    for (size_t i = 0; i < count; ++i) {
      CUresult rc = api_.cuMemCreate(&handles_[ids[i]], page_size_, &prop_, 0);
      if (rc != CUDA_SUCCESS) {
        handles_[ids[i]] = 0;
        release_pages(ids, i);
        throw DriverError("cuMemCreate", error_name(api_, rc));
      }
    }
  }

  void release_pages(const uint32_t* ids, size_t count) noexcept override {
    if (forked_ || !set_context_noexcept()) return;
    for (size_t i = 0; i < count; ++i) {
      if (handles_[ids[i]]) api_.cuMemRelease(handles_[ids[i]]);
      handles_[ids[i]] = 0;
    }
  }

  void map(const PageMapping* mappings, size_t count, size_t* done) override {
    *done = 0;
    ensure_context();
    // Map a run of address-contiguous pages, then grant access to the whole
    // run with one cuMemSetAccess (a new mapping has no access rights). A page
    // counts as done once its run has access: on a failure the pages of the
    // unfinished run are unmapped here (their cuMemMap succeeded, they have no
    // access yet), and what cannot be unmapped is reported as done so the
    // caller's page table keeps it.
    size_t run_start = 0;
    for (size_t i = 0; i < count; ++i) {
      const PageMapping& m = mappings[i];
      CUresult rc = api_.cuMemMap(static_cast<CUdeviceptr>(m.addr), page_size_, 0, handles_[m.page], 0);
      if (rc != CUDA_SUCCESS) fail_run(mappings, run_start, i, done, "cuMemMap", rc);
      bool run_ends = i + 1 == count || mappings[i + 1].addr != m.addr + page_size_;
      if (run_ends) {
        uintptr_t start = mappings[run_start].addr;
        rc = api_.cuMemSetAccess(static_cast<CUdeviceptr>(start), (i + 1 - run_start) * page_size_,
                                 &access_, 1);
        if (rc != CUDA_SUCCESS) fail_run(mappings, run_start, i + 1, done, "cuMemSetAccess", rc);
        run_start = i + 1;
        *done = i + 1;
      }
    }
  }

  void unmap(const uintptr_t* addrs, size_t count, size_t* done) override {
    *done = 0;
    ensure_context();
    for (size_t i = 0; i < count; ++i) {
      check("cuMemUnmap", api_.cuMemUnmap(static_cast<CUdeviceptr>(addrs[i]), page_size_));
      *done = i + 1;
    }
  }

  void copy(uintptr_t dst, uintptr_t src, size_t bytes) override {
    ensure_context();
    check("cuMemcpyDtoD", api_.cuMemcpyDtoD(static_cast<CUdeviceptr>(dst), static_cast<CUdeviceptr>(src), bytes));
    check("cuCtxSynchronize", api_.cuCtxSynchronize());  // device-to-device copies are asynchronous
  }

  void detach_after_fork(uintptr_t, size_t) noexcept override {
    // The parent's context cannot be used here: forget every handle so no
    // destructor calls the driver in the child.
    forked_ = true;
  }

  void close_pool() noexcept override {
    if (forked_ || !set_context_noexcept()) return;
    for (auto& h : handles_) {
      if (h) api_.cuMemRelease(h);
      h = 0;
    }
  }

  void synchronize() override {
    ensure_context();
    check("cuCtxSynchronize", api_.cuCtxSynchronize());
  }

 private:
  // Undoes the cuMemMap of pages [run_start, end) of an unfinished run and
  // throws. Pages whose undo fails stay mapped: *done then covers them.
  [[noreturn]] void fail_run(const PageMapping* mappings, size_t run_start, size_t end, size_t* done,
                             const char* call, CUresult rc) {
    size_t undone = end;
    while (undone > run_start &&
           api_.cuMemUnmap(static_cast<CUdeviceptr>(mappings[undone - 1].addr), page_size_) == CUDA_SUCCESS)
      --undone;
    *done = undone;
    throw DriverError(call, error_name(api_, rc));
  }

  void check(const char* call, CUresult rc) const {
    if (rc != CUDA_SUCCESS) throw DriverError(call, error_name(api_, rc));
  }

  void ensure_context() {
    CUcontext current = nullptr;
    check("cuCtxGetCurrent", api_.cuCtxGetCurrent(&current));
    if (current != ctx_) check("cuCtxSetCurrent", api_.cuCtxSetCurrent(ctx_));
  }

  bool set_context_noexcept() noexcept {
    CUcontext current = nullptr;
    if (api_.cuCtxGetCurrent(&current) != CUDA_SUCCESS) return false;
    return current == ctx_ || api_.cuCtxSetCurrent(ctx_) == CUDA_SUCCESS;
  }

  const DriverApi& api_;
  int device_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  size_t page_size_;
  size_t granularity_ = 0;
  CUmemAllocationProp prop_;
  CUmemAccessDesc access_;
  std::vector<CUmemGenericAllocationHandle> handles_;  // 0 = page not created
  bool forked_ = false;  // in a fork() child: never call the driver
};

void check_device(const DriverApi& api, int device) {
  int count = 0;
  CUresult rc = api.cuDeviceGetCount(&count);
  if (rc != CUDA_SUCCESS) throw DriverError("cuDeviceGetCount", error_name(api, rc));
  if (device < 0 || device >= count)
    throw BackendUnavailable("CUDA device " + std::to_string(device) + " does not exist (" +
                             std::to_string(count) + " device(s) visible)");
}

}  // namespace

std::shared_ptr<VmmBackend> make_cuda_backend(const std::string& driver_path, int device,
                                              size_t page_size, size_t num_pages) {
  const DriverApi& api = load_driver(driver_path);
  check_device(api, device);
  if (num_pages == 0 || num_pages > UINT32_MAX)
    throw std::invalid_argument("num_pages must be in [1, 2^32), got " + std::to_string(num_pages));
  return std::make_shared<CudaBackend>(api, device, page_size, num_pages);
}

CudaDeviceInfo cuda_device_info(const std::string& driver_path, int device) {
  const DriverApi& api = load_driver(driver_path);
  check_device(api, device);
  CudaDeviceInfo info;
  auto check = [&](const char* call, CUresult rc) {
    if (rc != CUDA_SUCCESS) throw DriverError(call, error_name(api, rc));
  };
  check("cuDeviceGetCount", api.cuDeviceGetCount(&info.device_count));
  check("cuDriverGetVersion", api.cuDriverGetVersion(&info.driver_version));
  CUdevice dev = 0;
  check("cuDeviceGet", api.cuDeviceGet(&dev, device));
  char name[256] = {0};
  check("cuDeviceGetName", api.cuDeviceGetName(name, sizeof(name) - 1, dev));
  info.name = name;
  CUcontext ctx = nullptr, previous = nullptr;
  check("cuDevicePrimaryCtxRetain", api.cuDevicePrimaryCtxRetain(&ctx, dev));
  api.cuCtxGetCurrent(&previous);
  CUresult rc = api.cuCtxSetCurrent(ctx);
  if (rc == CUDA_SUCCESS) {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    rc = api.cuMemGetAllocationGranularity(&info.granularity, &prop,
                                           CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (rc == CUDA_SUCCESS) rc = api.cuMemGetInfo(&info.free_bytes, &info.total_bytes);
    api.cuCtxSetCurrent(previous);
  }
  api.cuDevicePrimaryCtxRelease(dev);
  check("cuda_device_info", rc);
  return info;
}

}  // namespace vattn
