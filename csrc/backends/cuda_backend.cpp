// CUDA backend: the driver's virtual memory management API.
//   reserve = cuMemAddressReserve       create = cuMemCreate (one handle per page)
//   map     = cuMemMap + cuMemSetAccess  unmap  = cuMemUnmap (per page, or per run
//             of adjacent pages where the driver accepts that: see probe_unmap_runs)
//
// Context scope, read fences and the graph-capture gate: cuda_sync.h, shared
// with the cuda_uvm backend (CudaDeviceBackend). Every entry point that may
// throw opens a CudaSync::Call (gate, then our context); releases and
// teardown a QuietCall, or wait for the gate to open when a capture closed it.
#include <algorithm>
#include <climits>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backends/backend_registry.h"
#include "backends/cuda_context.h"
#include "backends/cuda_driver.h"
#include "backends/cuda_sync.h"
#include "backends/vmm_backend.h"
#include "common/errors.h"

namespace vattn {

namespace {

using namespace cu;

class CudaBackend final : public CudaDeviceBackend {
 public:
  CudaBackend(const DriverApi& api, int device, size_t page_size, size_t num_pages)
      : CudaDeviceBackend(api, device),
        device_(device),
        page_size_(page_size),
        handles_(num_pages, 0) {
    prop_ = CUmemAllocationProp{};
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = context_.device();
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    {
      ScopedContext context(api_, context_.get());
      context.check();
      check("cuMemGetAllocationGranularity",
            api_.cuMemGetAllocationGranularity(&granularity_, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    }
    if (page_size_ == 0 || page_size_ % granularity_ != 0)
      throw std::invalid_argument("page_size must be a positive multiple of the CUDA granularity " +
                                  std::to_string(granularity_) + " bytes, got " + std::to_string(page_size_));
    probe_unmap_runs();
  }

  ~CudaBackend() override {
    if (forked_) return;  // the parent's handles and context
    // What waited for a capture's end runs now: nothing can open our gate
    // after this. Pages still created here were never handed out or the
    // manager is being torn down after an error; release them so nothing
    // leaks. Errors are ignored: destructors never throw, and at process exit
    // the driver may already be deinitialised. The fences' events go with
    // sync_, then the context reference with context_ (base members, in that order).
    sync_.run_deferred_now();
    CudaSync::QuietCall call(sync_);
    if (call.ok())
      for (auto& h : handles_)
        if (h) api_.cuMemRelease(h);
  }

  std::string name() const override { return "cuda"; }
  size_t granularity() const override { return granularity_; }
  size_t page_size() const override { return page_size_; }
  size_t num_pages() const override { return handles_.size(); }
  DLDevice dl_device() const override { return DLDevice{kDLCUDA, device_}; }

  uintptr_t reserve(size_t bytes) override {
    CudaSync::Call call(sync_);
    CUdeviceptr ptr = 0;
    check("cuMemAddressReserve", api_.cuMemAddressReserve(&ptr, bytes, reservation_alignment(), 0, 0));
    return static_cast<uintptr_t>(ptr);
  }

  // During a capture the range is freed once it ends: true then.
  bool free_reservation(uintptr_t base, size_t bytes) noexcept override {
    if (forked_) return false;
    const DriverApi& api = api_;
    std::function<void()> free_range = [&api, base, bytes] { api.cuMemAddressFree(static_cast<CUdeviceptr>(base), bytes); };
    if (sync_.defer_until_open(free_range)) return true;
    CudaSync::QuietCall call(sync_);
    return call.ok() && api_.cuMemAddressFree(static_cast<CUdeviceptr>(base), bytes) == CUDA_SUCCESS;
  }

  void create_pages(const uint32_t* ids, size_t count) override {
    CudaSync::Call call(sync_);
    std::vector<uint32_t> made;  // the pages this call created (not those kept after a failed release)
    for (size_t i = 0; i < count; ++i) {
      if (handles_[ids[i]]) continue;  // its cuMemRelease failed: the memory is still ours
      CUresult rc = api_.cuMemCreate(&handles_[ids[i]], page_size_, &prop_, 0);
      if (rc != CUDA_SUCCESS) {
        handles_[ids[i]] = 0;
        release_handles(made.data(), made.size(), nullptr);
        if (rc == CUDA_ERROR_OUT_OF_MEMORY) throw OutOfMemory("cuMemCreate", error_name(api_, rc));
        throw DriverError("cuMemCreate", error_name(api_, rc));
      }
      made.push_back(ids[i]);
    }
  }

  size_t release_pages(const uint32_t* ids, size_t count, uint8_t* failed = nullptr) noexcept override {
    if (failed) std::fill(failed, failed + count, uint8_t{0});
    if (forked_) return 0;  // the parent's pages: nothing of ours to give back
    size_t held = 0;
    if (release_after_capture(ids, count, failed, &held)) return held;
    CudaSync::QuietCall call(sync_);
    if (!call.ok()) {  // no context: nothing was released
      size_t kept = 0;
      for (size_t i = 0; i < count; ++i)
        if (handles_[ids[i]]) {
          ++kept;
          if (failed) failed[i] = 1;
        }
      return kept;
    }
    return release_handles(ids, count, failed);
  }

  void map(const PageMapping* mappings, size_t count, size_t* done) override {
    *done = 0;
    CudaSync::Call call(sync_);
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
    CudaSync::Call call(sync_);
    size_t i = 0;
    while (i < count) {
      size_t end = i + 1;  // [i, end): a run of adjacent pages
      if (unmap_runs_)
        while (end < count && addrs[end] == addrs[end - 1] + page_size_) ++end;
      if (end - i > 1 &&
          api_.cuMemUnmap(static_cast<CUdeviceptr>(addrs[i]), (end - i) * page_size_) == CUDA_SUCCESS) {
        i = end;
        *done = i;
        continue;
      }
      // One page per call; also the retry of a run whose call failed, which
      // is taken to have unmapped nothing (the fake driver's calls are all or
      // nothing; the real driver's behaviour on a failed call is unmeasured).
      for (; i < end; ++i) {
        check("cuMemUnmap", api_.cuMemUnmap(static_cast<CUdeviceptr>(addrs[i]), page_size_));
        *done = i + 1;
      }
    }
  }

  void copy(uintptr_t dst, uintptr_t src, size_t bytes) override {
    CudaSync::Call call(sync_);
    check("cuMemcpyDtoD", api_.cuMemcpyDtoD(static_cast<CUdeviceptr>(dst), static_cast<CUdeviceptr>(src), bytes));
    // A device-to-device copy is asynchronous on the legacy default stream:
    // wait for that stream, not for the whole device.
    check("cuStreamSynchronize", api_.cuStreamSynchronize(nullptr));
  }

  void detach_after_fork(uintptr_t, size_t) noexcept override {
    // The parent's context cannot be used here: forget every handle so no
    // destructor calls the driver in the child.
    detach_sync_after_fork();
  }

  void close_pool() noexcept override {
    if (forked_) return;
    std::vector<uint32_t> all(handles_.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint32_t>(i);
    size_t held = 0;
    if (release_after_capture(all.data(), all.size(), nullptr, &held)) return;
    CudaSync::QuietCall call(sync_);
    if (!call.ok()) return;
    for (auto& h : handles_) {
      if (h) api_.cuMemRelease(h);
      h = 0;
    }
  }

  std::vector<std::pair<std::string, std::string>> backend_facts() const override {
    return {
        {"unmap", unmap_runs_ ? "runs" : "per_page"},
        {"unmap_probe", unmap_probe_},
        {"reserve_alignment", std::to_string(reservation_alignment())},
    };
  }

 private:
  // While a capture closes the gate: the created pages among `ids` leave
  // handles_ and their cuMemRelease waits for the gate to open; each is
  // reported held (failed[i] = 1, counted in *held): its memory is still
  // allocated until then, so the caller keeps it charged. False when the
  // gate is open (or there is nothing to release).
  bool release_after_capture(const uint32_t* ids, size_t count, uint8_t* failed, size_t* held_pages) noexcept {
    std::vector<CUmemGenericAllocationHandle> held;
    try {
      for (size_t i = 0; i < count; ++i)
        if (handles_[ids[i]]) held.push_back(handles_[ids[i]]);
    } catch (...) {
      return false;  // no memory for the list: released now
    }
    if (held.empty()) return false;
    const DriverApi& api = api_;
    std::function<void()> release = [&api, held] {
      for (CUmemGenericAllocationHandle h : held) api.cuMemRelease(h);
    };
    if (!sync_.defer_until_open(release)) return false;
    for (size_t i = 0; i < count; ++i)
      if (handles_[ids[i]]) {
        handles_[ids[i]] = 0;
        ++*held_pages;
        if (failed) failed[i] = 1;
      }
    return true;
  }

  // cuMemAddressReserve takes an alignment of 0 or a power of two, and pages
  // of several granules (an all-layers page, 3 x 2 MiB say) are often
  // neither: ask for the granularity (itself a power of two), which is all
  // cuMemMap needs, since every page starts at base + k * page_size.
  size_t reservation_alignment() const { return granularity_; }

  // Whether cuMemUnmap accepts one call over adjacent pages that were mapped
  // by separate cuMemMap calls. The documentation says an unmap must cover
  // "the entire contiguous address range that was mapped to", and not
  // whether several adjacent mappings count as one. So ask the driver once:
  // map two adjacent granules with one call each, unmap both with one call,
  // then map both again (which proves the call really unmapped both) and
  // unmap them one by one. Any error: one page per call from then on, after
  // undoing what the probe did. The real driver's answer is unmeasured here
  // until the GPU suite (benchmarks/gpu_suite.sh) records it, with the driver
  // version, in gpu_suite.json.
  void probe_unmap_runs() {
    ScopedContext context(api_, context_.get());
    if (!context.ok()) {
      unmap_probe_ = "not run: no context";
      return;
    }
    const size_t g = granularity_;
    CUdeviceptr base = 0;
    CUmemGenericAllocationHandle h[2] = {0, 0};
    bool mapped[2] = {false, false};
    std::string outcome;
    auto step = [&](const char* call, CUresult rc) {
      if (rc != CUDA_SUCCESS && outcome.empty()) outcome = std::string(call) + " failed: " + error_name(api_, rc);
      return rc == CUDA_SUCCESS && outcome.empty();
    };
    auto map_both = [&] {  // one cuMemMap per granule, one cuMemSetAccess for both
      for (int i = 0; i < 2; ++i) {
        if (!step("cuMemMap", api_.cuMemMap(base + i * g, g, 0, h[i], 0))) return false;
        mapped[i] = true;
      }
      return step("cuMemSetAccess", api_.cuMemSetAccess(base, 2 * g, &access_, 1));
    };
    // Alignment 0 is the driver's choice, which cuda.h does not promise to be
    // the granularity that cuMemMap needs: ask for it.
    if (step("cuMemAddressReserve", api_.cuMemAddressReserve(&base, 2 * g, reservation_alignment(), 0, 0)) &&
        step("cuMemCreate", api_.cuMemCreate(&h[0], g, &prop_, 0)) &&
        step("cuMemCreate", api_.cuMemCreate(&h[1], g, &prop_, 0)) && map_both()) {
      CUresult rc = api_.cuMemUnmap(base, 2 * g);
      if (rc != CUDA_SUCCESS) {
        unmap_probe_ = "refused: cuMemUnmap over 2 mappings failed: " + error_name(api_, rc);
      } else {
        mapped[0] = mapped[1] = false;
        if (map_both()) {
          unmap_runs_ = true;
          unmap_probe_ = "accepted";
        } else {
          unmap_probe_ = "refused: cuMemUnmap over 2 mappings succeeded, but mapping them again then " + outcome;
        }
      }
    }
    if (unmap_probe_.empty()) unmap_probe_ = "not run: " + outcome;
    // Undo: one page per call, which any driver accepts.
    for (int i = 0; i < 2; ++i)
      if (mapped[i] && api_.cuMemUnmap(base + i * g, g) != CUDA_SUCCESS) unmap_probe_ += " (a probe page stayed mapped)";
    for (auto handle : h)
      if (handle) api_.cuMemRelease(handle);
    if (base && api_.cuMemAddressFree(base, 2 * g) != CUDA_SUCCESS) unmap_probe_ += " (the probe's range leaked)";
  }

  // A handle whose cuMemRelease fails is kept (the memory is still allocated):
  // create_pages reuses it, close_pool and the destructor try again.
  size_t release_handles(const uint32_t* ids, size_t count, uint8_t* failed) noexcept {
    size_t kept = 0;
    for (size_t i = 0; i < count; ++i) {
      CUmemGenericAllocationHandle& h = handles_[ids[i]];
      if (!h) continue;
      if (api_.cuMemRelease(h) == CUDA_SUCCESS) {
        h = 0;
      } else {
        ++kept;
        if (failed) failed[i] = 1;
      }
    }
    return kept;
  }

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

  int device_;
  size_t page_size_;
  size_t granularity_ = 0;
  CUmemAllocationProp prop_;
  CUmemAccessDesc access_;
  std::vector<CUmemGenericAllocationHandle> handles_;  // 0 = page not created
  bool unmap_runs_ = false;   // cuMemUnmap may cover a run of adjacent pages (probed)
  std::string unmap_probe_;   // what the probe found
};

std::shared_ptr<VmmBackend> make_cuda_backend(const BackendParams& p) {
  const DriverApi& api = load_driver(p.driver_path.empty() ? default_driver_path() : p.driver_path);
  check_device_exists(api, p.device_index);
  if (p.num_pages == 0 || p.num_pages > UINT32_MAX)
    throw std::invalid_argument("num_pages must be in [1, 2^32), got " + std::to_string(p.num_pages));
  return std::make_shared<CudaBackend>(api, p.device_index, p.page_size, p.num_pages);
}

// Device facts the Python layer needs before it builds a backend.
ProbeData probe_device_info(const ProbeData& args) {
  const std::string path = probe_arg<std::string>(args, "cuda.device_info", "driver_path", "");
  const int64_t index = probe_arg<int64_t>(args, "cuda.device_info", "device", 0);
  if (index < 0 || index > INT_MAX)
    throw std::invalid_argument("cuda.device_info: device must be in [0, " + std::to_string(INT_MAX) + "], got " +
                                std::to_string(index));
  const DriverApi& api = load_driver(path.empty() ? default_driver_path() : path);
  const int device = static_cast<int>(index);
  check_device_exists(api, device);
  auto check = [&](const char* call, CUresult rc) {
    if (rc != CUDA_SUCCESS) throw DriverError(call, error_name(api, rc));
  };
  int device_count = 0, driver_version = 0;
  check("cuDeviceGetCount", api.cuDeviceGetCount(&device_count));
  check("cuDriverGetVersion", api.cuDriverGetVersion(&driver_version));
  CUdevice dev = 0;
  check("cuDeviceGet", api.cuDeviceGet(&dev, device));
  char name[256] = {0};
  check("cuDeviceGetName", api.cuDeviceGetName(name, sizeof(name) - 1, dev));
  // Granularity and free memory need a context. The primary context is
  // retained for these two queries: a framework's reference keeps it alive
  // and ours is released after them. If nobody held one, the retain created
  // it: with keep_context the reference is parked for the next backend on
  // this device (park_primary_context: one context for "info, then a
  // manager"), otherwise released, which destroys that same context again
  // (the only one vattn may destroy). Either way the caller's context stack
  // is restored: no context is left current on this thread.
  const bool keep = probe_arg<bool>(args, "cuda.device_info", "keep_context", false);
  unsigned int flags = 0;
  int active = 0;
  check("cuDevicePrimaryCtxGetState", api.cuDevicePrimaryCtxGetState(dev, &flags, &active));
  CUcontext ctx = nullptr;
  check("cuDevicePrimaryCtxRetain", api.cuDevicePrimaryCtxRetain(&ctx, dev));
  size_t granularity = 0, free_bytes = 0, total_bytes = 0;
  CUresult rc = CUDA_SUCCESS;
  const char* call = "cuMemGetAllocationGranularity";
  {
    ScopedContext context(api, ctx);
    if (!context.ok()) {
      rc = context.result();
      call = context.failed_call();
    } else {
      CUmemAllocationProp prop{};
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      prop.location.id = dev;
      rc = api.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
      if (rc == CUDA_SUCCESS) {
        call = "cuMemGetInfo";
        rc = api.cuMemGetInfo(&free_bytes, &total_bytes);
      }
    }
  }
  const bool parked = keep && active == 0 && rc == CUDA_SUCCESS;
  if (parked)
    park_primary_context(api, dev);
  else
    api.cuDevicePrimaryCtxRelease(dev);
  check(call, rc);
  return {{"device_count", int64_t{device_count}},
          {"driver_version", int64_t{driver_version}},
          {"name", std::string(name)},
          {"granularity", static_cast<int64_t>(granularity)},
          {"free_bytes", static_cast<int64_t>(free_bytes)},
          {"total_bytes", static_cast<int64_t>(total_bytes)},
          {"primary_context_active", active != 0},  // before the query: someone held the primary context
          {"context_kept", parked}};
}

// Gives back the reference device_info(keep_context=True) parked, when no
// backend on that device took it over.
ProbeData probe_release_context(const ProbeData& args) {
  const std::string path = probe_arg<std::string>(args, "cuda.release_context", "driver_path", "");
  const int64_t index = probe_arg<int64_t>(args, "cuda.release_context", "device", 0);
  if (index < 0 || index > INT_MAX)
    throw std::invalid_argument("cuda.release_context: device must be in [0, " + std::to_string(INT_MAX) +
                                "], got " + std::to_string(index));
  const DriverApi& api = load_driver(path.empty() ? default_driver_path() : path);
  CUdevice dev = 0;
  if (api.cuDeviceGet(&dev, static_cast<int>(index)) != CUDA_SUCCESS) return {{"released", false}};
  return {{"released", release_parked_context(api, dev)}};
}

ProbeData probe_driver_path(const ProbeData&) { return {{"driver_path", default_driver_path()}}; }

}  // namespace

VATTN_REGISTER_BACKEND(
    cuda, make_cuda_backend,
    {"device_info", probe_device_info,
     "device_count, driver_version, name, granularity (bytes), free_bytes, total_bytes, primary_context_active of "
     "CUDA device `device` (default 0) through the driver library `driver_path` (default: driver_path's); "
     "keep_context: a primary context this query created is kept (context_kept) for the next backend made on "
     "the device, or until release_context, instead of being destroyed again",
     {"driver_path", "device", "keep_context"}},
    {"release_context", probe_release_context,
     "released: whether a reference that device_info(keep_context=True) kept for device `device` was given "
     "back (no backend took it over)",
     {"driver_path", "device"}},
    {"driver_path", probe_driver_path,
     "driver_path: the CUDA driver library loaded at run time ($VATTN_CUDA_DRIVER_LIB, else libcuda.so.1)", {}});

}  // namespace vattn
