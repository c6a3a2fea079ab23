// CUDA backend: the driver's virtual memory management API.
//   reserve = cuMemAddressReserve       create = cuMemCreate (one handle per page)
//   map     = cuMemMap + cuMemSetAccess  unmap  = cuMemUnmap (per page, or per run
//             of adjacent pages where the driver accepts that: see probe_unmap_runs)
//
// Contexts. The backend holds a reference to the device's primary context (the
// one torch and every CUDA runtime use) for its whole life. Every entry point
// pushes that context on the calling thread's context stack and pops it before
// returning (ScopedContext), so the caller's thread finds its context stack as
// it was: a framework that has not initialised CUDA yet does not adopt our
// context (which it would not own: our release could then destroy it under
// it), and a thread with a context of its own keeps it. The mapper thread's
// calls go through the same entry points. The reference is released after the
// last pop, so a context we made is never left current anywhere.
//
// Synchronization. Before pages that device work may read are unmapped, the
// page manager waits for a read fence it recorded when the request that read
// them was freed (record_reads / wait_reads); fork's copy waits for the work
// queued so far (synchronize). Once the caller named the streams that may
// read the cache (set_sync_streams), a fence is one event per stream, taken
// from a ring of kFences, and a wait synchronizes those events only, and
// only if no later wait already covered them. Without named streams every
// wait is cuCtxSynchronize (the whole device, other users' kernels too): the
// only safe choice when the readers' streams are unknown.
//
// CUDA graphs. While a graph is captured in the default (global) mode the
// driver refuses "potentially unsafe" calls from every thread, a
// synchronization would invalidate the capture, and an event recorded on the
// capturing stream would become part of the graph. suspend_driver_calls()
// (KVCacheManager.graph_capture(), which pauses the mapper first) makes
// every call that maps, unmaps, creates or waits throw until
// resume_driver_calls(), on every thread: a call never blocks there, since
// its caller may hold the page manager's lock the capturing thread needs.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backends/cuda_context.h"
#include "backends/cuda_driver.h"
#include "common/errors.h"
#include "backends/vmm_backend.h"

namespace vattn {

namespace {

using namespace cu;

// Driver calls pass here; a graph capture closes it (see above).
class DriverGate {
 public:
  // Enters a driver call. While suspended: throws when may_throw (a call that
  // maps, unmaps, creates or waits), from any thread; lets the rest through
  // (releases, teardown).
  void enter(bool may_throw) {
    std::lock_guard<std::mutex> lock(mu_);
    if (suspended_ && may_throw) {
      if (owner_ == std::this_thread::get_id())
        throw DriverError("graph_capture",
                          "vattn may not call the CUDA driver while this thread captures a CUDA graph "
                          "(a step that maps pages, alloc_reqid, free_reqid, fork, reclaim, map_pages: "
                          "call them before graph_capture())");
      throw DriverError("graph_capture",
                        "another thread is capturing a CUDA graph (KVCacheManager.graph_capture()); vattn "
                        "calls that reach the CUDA driver fail until the capture ends");
    }
    ++active_;
  }
  bool suspended() {
    std::lock_guard<std::mutex> lock(mu_);
    return suspended_;
  }
  void leave() noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    --active_;
    idle_.notify_all();
  }
  // Waits for the calls under way to finish; later ones fail until resume().
  void suspend() {
    std::unique_lock<std::mutex> lock(mu_);
    if (suspended_) throw std::logic_error("driver calls are already suspended (graph_capture is not reentrant)");
    suspended_ = true;
    owner_ = std::this_thread::get_id();
    idle_.wait(lock, [&] { return active_ == 0; });
  }
  void resume() noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    suspended_ = false;
    idle_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable idle_;
  bool suspended_ = false;
  std::thread::id owner_;
  size_t active_ = 0;
};

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
      {
        ScopedContext context(api_, ctx_);
        context.check();
        check("cuMemGetAllocationGranularity",
              api_.cuMemGetAllocationGranularity(&granularity_, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
      }
      if (page_size_ == 0 || page_size_ % granularity_ != 0)
        throw std::invalid_argument("page_size must be a positive multiple of the CUDA granularity " +
                                    std::to_string(granularity_) + " bytes, got " + std::to_string(page_size_));
      probe_unmap_runs();
    } catch (...) {
      api_.cuDevicePrimaryCtxRelease(dev_);  // after the context was popped again
      throw;
    }
  }

  ~CudaBackend() override {
    if (forked_) return;  // the parent's handles and context
    // Pages still created here were never handed out or the manager is being
    // torn down after an error; release them so nothing leaks. Errors are
    // ignored: destructors never throw, and at process exit the driver may
    // already be deinitialised.
    {
      ScopedContext context(api_, ctx_);
      if (context.ok()) {
        for (auto& h : handles_)
          if (h) api_.cuMemRelease(h);
        destroy_fences_locked();
      }
    }
    // Only now, with the caller's context stack restored: if ours was the last
    // reference, the context is destroyed, and it is current nowhere.
    api_.cuDevicePrimaryCtxRelease(dev_);
  }

  std::string name() const override { return "cuda"; }
  size_t granularity() const override { return granularity_; }
  size_t page_size() const override { return page_size_; }
  size_t num_pages() const override { return handles_.size(); }
  DLDevice dl_device() const override { return DLDevice{kDLCUDA, device_}; }

  uintptr_t reserve(size_t bytes) override {
    Call call(*this);
    CUdeviceptr ptr = 0;
    check("cuMemAddressReserve", api_.cuMemAddressReserve(&ptr, bytes, reservation_alignment(), 0, 0));
    return static_cast<uintptr_t>(ptr);
  }

  bool free_reservation(uintptr_t base, size_t bytes) noexcept override {
    if (forked_) return false;
    QuietCall call(*this);
    return call.ok() && api_.cuMemAddressFree(static_cast<CUdeviceptr>(base), bytes) == CUDA_SUCCESS;
  }

  void create_pages(const uint32_t* ids, size_t count) override {
    Call call(*this);
    for (size_t i = 0; i < count; ++i) {
      CUresult rc = api_.cuMemCreate(&handles_[ids[i]], page_size_, &prop_, 0);
      if (rc != CUDA_SUCCESS) {
        handles_[ids[i]] = 0;
        release_handles(ids, i);
        throw DriverError("cuMemCreate", error_name(api_, rc));
      }
    }
  }

  void release_pages(const uint32_t* ids, size_t count) noexcept override {
    if (forked_) return;
    QuietCall call(*this);
    if (call.ok()) release_handles(ids, count);
  }

  void map(const PageMapping* mappings, size_t count, size_t* done) override {
    *done = 0;
    Call call(*this);
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
    Call call(*this);
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
    Call call(*this);
    check("cuMemcpyDtoD", api_.cuMemcpyDtoD(static_cast<CUdeviceptr>(dst), static_cast<CUdeviceptr>(src), bytes));
    // A device-to-device copy is asynchronous on the legacy default stream:
    // wait for that stream, not for the whole device.
    check("cuStreamSynchronize", api_.cuStreamSynchronize(nullptr));
  }

  void detach_after_fork(uintptr_t, size_t) noexcept override {
    // The parent's context cannot be used here: forget every handle so no
    // destructor calls the driver in the child.
    forked_ = true;
  }

  void close_pool() noexcept override {
    if (forked_) return;
    QuietCall call(*this);
    if (!call.ok()) return;
    for (auto& h : handles_) {
      if (h) api_.cuMemRelease(h);
      h = 0;
    }
  }

  void synchronize() override {
    Call call(*this);
    std::shared_lock<std::shared_mutex> streams(streams_mu_);
    wait_now_locked();
  }

  uint64_t record_reads() noexcept override {
    // While a graph is captured an event recorded on the capturing stream
    // would join the graph: name no fence then (the wait is "now").
    if (forked_ || gate_.suspended()) return kReadsNow;
    try {
      Call call(*this);
      std::shared_lock<std::shared_mutex> streams(streams_mu_);
      if (streams_.empty()) return kReadsNow;
      return record_fence_locked();
    } catch (...) {
      return kReadsNow;  // a later wait covers the reads all the same
    }
  }

  void wait_reads(uint64_t ticket) override {
    if (ticket == kNoReads) return;
    Call call(*this);
    std::shared_lock<std::shared_mutex> streams(streams_mu_);
    std::vector<CUevent> events;
    uint64_t seq = 0;
    {
      std::lock_guard<std::mutex> lock(fence_mu_);
      if (ticket != kReadsNow && ticket <= done_seq_) {
        ++fence_waits_skipped_;  // an earlier wait covered it
        return;
      }
      if (ticket != kReadsNow && ticket < next_seq_ && !streams_.empty()) {
        // The ring slot holds this fence or a later one (slots are only
        // re-recorded with later fences), which covers it too.
        const Fence& f = fences_[ticket % kFences];
        events = f.events;
        seq = f.seq;
      }
    }
    if (events.empty()) {
      wait_now_locked();
      return;
    }
    for (CUevent e : events) {
      ++event_waits_;
      check("cuEventSynchronize", api_.cuEventSynchronize(e));
    }
    std::lock_guard<std::mutex> lock(fence_mu_);
    done_seq_ = std::max(done_seq_, seq);
  }

  void set_sync_streams(const std::vector<uintptr_t>& streams) override {
    Call call(*this);
    std::vector<CUstream> unique;
    for (uintptr_t s : streams)
      if (std::find(unique.begin(), unique.end(), reinterpret_cast<CUstream>(s)) == unique.end())
        unique.push_back(reinterpret_cast<CUstream>(s));
    // An event recorded now proves each stream usable from our context (a
    // stream of another context refuses our events): an error here, with the
    // old setting kept, not at the first reclaim.
    if (!unique.empty()) {
      CUevent probe = nullptr;
      check("cuEventCreate", api_.cuEventCreate(&probe, CU_EVENT_DISABLE_TIMING));
      CUresult rc = CUDA_SUCCESS;
      for (CUstream s : unique)
        if (rc == CUDA_SUCCESS) rc = api_.cuEventRecord(probe, s);
      api_.cuEventDestroy(probe);
      check("cuEventRecord", rc);
    }
    std::unique_lock<std::shared_mutex> lock(streams_mu_);
    // Fences recorded so far name the old streams, or "now" without any: wait
    // for those readers once, here, and count every fence so far as done.
    wait_now_locked();
    std::lock_guard<std::mutex> fences(fence_mu_);
    destroy_fences_locked();
    streams_ = std::move(unique);
    fences_.assign(streams_.empty() ? 0 : kFences, Fence{});
    done_seq_ = next_seq_ - 1;
  }

  void suspend_driver_calls() override { gate_.suspend(); }
  void resume_driver_calls() override { gate_.resume(); }

  std::vector<std::pair<std::string, std::string>> facts() const override {
    size_t num_streams = 0;
    {
      std::shared_lock<std::shared_mutex> lock(streams_mu_);
      num_streams = streams_.size();
    }
    return {
        {"unmap", unmap_runs_ ? "runs" : "per_page"},
        {"unmap_probe", unmap_probe_},
        {"reserve_alignment", std::to_string(reservation_alignment())},
        {"sync", num_streams == 0 ? "cuCtxSynchronize" : "events on " + std::to_string(num_streams) + " stream(s)"},
        {"device_syncs", std::to_string(device_syncs_.load())},
        {"event_waits", std::to_string(event_waits_.load())},
        {"fence_waits_skipped", std::to_string(fence_waits_skipped_.load())},
    };
  }

 private:
  // One read fence: an event on each named stream, recorded together.
  struct Fence {
    uint64_t seq = 0;             // the fence these events were last recorded for
    std::vector<CUevent> events;  // one per stream, created at the slot's first use
  };
  static constexpr size_t kFences = 64;

  // The caller holds streams_mu_ (shared) and a Call.
  uint64_t record_fence_locked() {
    std::lock_guard<std::mutex> lock(fence_mu_);
    const uint64_t seq = next_seq_;
    Fence& f = fences_[seq % kFences];
    if (f.events.empty()) {
      std::vector<CUevent> made;
      for (size_t i = 0; i < streams_.size(); ++i) {
        CUevent e = nullptr;
        CUresult rc = api_.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING);
        if (rc != CUDA_SUCCESS) {
          for (CUevent m : made) api_.cuEventDestroy(m);
          throw DriverError("cuEventCreate", error_name(api_, rc));
        }
        made.push_back(e);
      }
      f.events = std::move(made);
    }
    // A failure part-way leaves some events re-recorded with later work:
    // waits on the slot's old fence then wait longer, never shorter.
    for (size_t i = 0; i < streams_.size(); ++i)
      check("cuEventRecord", api_.cuEventRecord(f.events[i], streams_[i]));
    f.seq = seq;
    ++next_seq_;
    return seq;
  }

  // Waits for the work queued so far on the named streams, or the device.
  // The caller holds streams_mu_ (either way) and a Call.
  void wait_now_locked() {
    if (streams_.empty()) {
      ++device_syncs_;
      check("cuCtxSynchronize", api_.cuCtxSynchronize());
      return;
    }
    uint64_t seq = record_fence_locked();
    std::vector<CUevent> events;
    {
      std::lock_guard<std::mutex> lock(fence_mu_);
      events = fences_[seq % kFences].events;
    }
    for (CUevent e : events) {
      ++event_waits_;
      check("cuEventSynchronize", api_.cuEventSynchronize(e));
    }
    std::lock_guard<std::mutex> lock(fence_mu_);
    done_seq_ = std::max(done_seq_, seq);
  }

  // The caller holds streams_mu_ (unique) or is the destructor.
  void destroy_fences_locked() noexcept {
    for (Fence& f : fences_)
      for (CUevent e : f.events) api_.cuEventDestroy(e);
    fences_.clear();
  }

  // An entry point that may throw: waits at the gate, makes our context current.
  class Call {
   public:
    explicit Call(CudaBackend& b) : gate_(b.gate_) {
      gate_.enter(true);
      context_.emplace(b.api_, b.ctx_);
      try {
        context_->check();
      } catch (...) {
        context_.reset();
        gate_.leave();
        throw;
      }
    }
    ~Call() {
      context_.reset();  // pop before leaving the gate
      gate_.leave();
    }

   private:
    DriverGate& gate_;
    std::optional<ScopedContext> context_;
  };

  // A noexcept entry point (release, teardown): never refused at the gate.
  class QuietCall {
   public:
    explicit QuietCall(CudaBackend& b) : gate_(b.gate_) {
      gate_.enter(false);
      context_.emplace(b.api_, b.ctx_);
    }
    ~QuietCall() {
      context_.reset();
      gate_.leave();
    }
    bool ok() const { return context_->ok(); }

   private:
    DriverGate& gate_;
    std::optional<ScopedContext> context_;
  };

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
    ScopedContext context(api_, ctx_);
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

  void release_handles(const uint32_t* ids, size_t count) noexcept {
    for (size_t i = 0; i < count; ++i) {
      if (handles_[ids[i]]) api_.cuMemRelease(handles_[ids[i]]);
      handles_[ids[i]] = 0;
    }
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

  const DriverApi& api_;
  int device_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  size_t page_size_;
  size_t granularity_ = 0;
  CUmemAllocationProp prop_;
  CUmemAccessDesc access_;
  std::vector<CUmemGenericAllocationHandle> handles_;  // 0 = page not created
  bool unmap_runs_ = false;   // cuMemUnmap may cover a run of adjacent pages (probed)
  std::string unmap_probe_;   // what the probe found
  // Read fences. streams_mu_: shared by record/wait (the mapper and callers
  // at once), unique to change the streams; fence_mu_ guards the ring.
  mutable std::shared_mutex streams_mu_;
  std::vector<CUstream> streams_;  // empty: synchronize the whole device
  std::mutex fence_mu_;
  std::vector<Fence> fences_;      // kFences slots once streams are named; fence n in slot n % kFences
  uint64_t next_seq_ = 1;          // the next fence's number (0 is kNoReads)
  uint64_t done_seq_ = 0;          // every fence up to this one has finished
  std::atomic<uint64_t> device_syncs_{0}, event_waits_{0}, fence_waits_skipped_{0};
  DriverGate gate_;
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
  // Granularity and free memory need a context. The primary context is
  // retained only for these two queries: a framework's reference keeps it
  // alive; if nobody held one, the retain created it and the release destroys
  // that same context again (the only one vattn may destroy). The caller's
  // context stack is restored before the release.
  unsigned int flags = 0;
  int active = 0;
  check("cuDevicePrimaryCtxGetState", api.cuDevicePrimaryCtxGetState(dev, &flags, &active));
  info.primary_context_active = active != 0;
  CUcontext ctx = nullptr;
  check("cuDevicePrimaryCtxRetain", api.cuDevicePrimaryCtxRetain(&ctx, dev));
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
      rc = api.cuMemGetAllocationGranularity(&info.granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
      if (rc == CUDA_SUCCESS) {
        call = "cuMemGetInfo";
        rc = api.cuMemGetInfo(&info.free_bytes, &info.total_bytes);
      }
    }
  }
  api.cuDevicePrimaryCtxRelease(dev);
  check(call, rc);
  return info;
}

}  // namespace vattn
