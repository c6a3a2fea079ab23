// What every backend on a CUDA device needs besides its own memory calls,
// in one place so that each such backend behaves the same way:
//
// - Context scope. The backend holds a reference to the device's primary
//   context (the one torch and every CUDA runtime use) for its whole life
//   (PrimaryContext). Every entry point pushes that context on the calling
//   thread's context stack and pops it before returning (CudaSync::Call), so
//   the caller finds its stack as it was: a framework that has not
//   initialised CUDA yet does not adopt our context (which it would not own:
//   our release could then destroy it under it), and a thread with a context
//   of its own keeps it. The reference is released after the last pop, so a
//   context we made is never left current anywhere.
//
// - Read fences. Before pages that device work may read are unmapped, the
//   page manager waits for a read fence it recorded when the request that
//   read them was freed (record_reads / wait_reads); fork's copy waits for
//   the work queued so far (synchronize). Once the caller named the streams
//   that may read the cache (set_streams), a fence is one event per stream,
//   and a wait synchronizes those events only, and only if no later wait
//   already covered them. Each fence keeps its own events until it is known
//   finished (a wait or a query saw it, or a later one): only then are they
//   recorded again for a later fence, so a ticket is never answered from
//   another fence's events; while more fences are unfinished than there are
//   event sets, new sets are made (the ring grows). Without named streams
//   every wait is cuCtxSynchronize (the whole device, other users' kernels
//   too): the only safe choice when the readers' streams are unknown.
//
// - The graph-capture gate. While a graph is captured in the default
//   (global) mode the driver refuses "potentially unsafe" calls from every
//   thread and invalidates the capture, a synchronization would invalidate
//   it too, and an event recorded on the capturing stream would become part
//   of the graph. suspend() (KVCacheManager.graph_capture(), which pauses
//   the mapper first) makes every entry point that maps, unmaps, creates or
//   waits throw DriverError until resume(), on every thread: a call never
//   blocks there, since its caller may hold the page manager's lock the
//   capturing thread needs. Releases (cuMemRelease, cuMemAddressFree,
//   cuEventDestroy) and teardown cannot fail that way: while the gate is
//   closed they are queued (defer_until_open) and issued, in our context,
//   when it opens, never during the capture. A capture that a framework
//   begins outside graph_capture() closes the same gate
//   (capture_begin/capture_end, counted: vattn's hook on
//   torch.cuda.CUDAGraph, which also keeps the page manager's background
//   threads from starting driver work meanwhile).
//
// CudaDeviceBackend is the part of VmmBackend that every CUDA backend
// answers the same way: it owns the context reference and the CudaSync, and
// forwards the fence and gate calls to it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backends/cuda_context.h"
#include "backends/cuda_driver.h"
#include "backends/vmm_backend.h"

namespace vattn {
namespace cu {

// Throws BackendUnavailable unless `device` is one of the devices the driver sees.
void check_device_exists(const DriverApi& api, int device);

// The device info probe's reference to a primary context that its retain
// created (nobody held one): parked here, instead of destroying the context
// again, for the next CUDA backend on that device, so that "device info, then
// a manager" creates one context. The backend retains its own reference (the
// parked one keeps the context alive, so that creates nothing) and then
// drops the parked one. At most one parked reference per device; a reference
// parked in a parent process is never released in a fork() child.
// park: keeps the caller's reference (releases it when one is parked already).
void park_primary_context(const DriverApi& api, CUdevice dev) noexcept;
// Releases the parked reference of `dev`, if any; whether there was one.
bool release_parked_context(const DriverApi& api, CUdevice dev) noexcept;

// A reference to `device`'s primary context for the owner's life.
class PrimaryContext {
 public:
  PrimaryContext(const DriverApi& api, int device);  // throws DriverError
  ~PrimaryContext();
  PrimaryContext(const PrimaryContext&) = delete;
  PrimaryContext& operator=(const PrimaryContext&) = delete;
  CUcontext get() const { return ctx_; }
  CUdevice device() const { return dev_; }
  // In a fork() child: the reference is the parent's; never release it here.
  void forget() noexcept { forgotten_ = true; }

 private:
  const DriverApi& api_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  bool forgotten_ = false;
};

// Driver calls pass here; a graph capture closes it (see the top of this file).
class DriverGate {
 public:
  // Enters a driver call. While suspended: throws when may_throw (a call that
  // maps, unmaps, creates or waits), from any thread; lets the rest through
  // (releases, teardown).
  void enter(bool may_throw);
  void leave() noexcept;
  bool suspended();
  // Waits for the calls under way to finish; later ones fail until resume().
  void suspend();
  void resume() noexcept;
  // A capture outside suspend()/resume() (a framework's, seen by vattn's
  // hook): counted, may nest and overlap a suspend(). Begin waits for the
  // calls under way.
  void capture_begin();
  void capture_end() noexcept;
  // While the gate is closed: keeps `work` (moved from) for take_deferred()
  // and returns true. Open: returns false, `work` untouched (the caller runs it now).
  bool defer(std::function<void()>& work);
  // The work kept so far, once the gate is open (none while it is closed).
  std::vector<std::function<void()>> take_deferred(bool even_if_closed = false);

 private:
  bool closed_locked() const { return suspended_ || captures_ > 0; }
  std::mutex mu_;
  std::condition_variable idle_;
  bool suspended_ = false;
  size_t captures_ = 0;
  std::thread::id owner_;
  size_t active_ = 0;
  std::vector<std::function<void()>> deferred_;  // releases kept while closed, in order
};

// The context scope, the gate and the read fences of one CUDA backend.
class CudaSync {
 public:
  // `context` must outlive this object (declare the PrimaryContext first).
  CudaSync(const DriverApi& api, CUcontext context) : api_(api), ctx_(context) {}
  ~CudaSync();  // destroys the fences' events, in our context
  CudaSync(const CudaSync&) = delete;
  CudaSync& operator=(const CudaSync&) = delete;

  // Whether an entry point needs our context current (driver API calls) or
  // not (nvidia-uvm ioctls pass the gate only).
  enum class Scope { kContext, kGateOnly };

  // An entry point that may throw: waits at the gate (DriverError while
  // driver calls are suspended), then makes our context current.
  class Call {
   public:
    explicit Call(CudaSync& sync, Scope scope = Scope::kContext);
    ~Call();
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;

   private:
    DriverGate& gate_;
    std::optional<ScopedContext> context_;
  };

  // A noexcept entry point (release, teardown): never refused at the gate
  // (a release that the driver would see during a capture is deferred
  // before it opens one: defer_until_open); ok() is false when our context
  // could not be made current.
  class QuietCall {
   public:
    explicit QuietCall(CudaSync& sync, Scope scope = Scope::kContext);
    ~QuietCall();
    QuietCall(const QuietCall&) = delete;
    QuietCall& operator=(const QuietCall&) = delete;
    bool ok() const { return !context_ || context_->ok(); }

   private:
    DriverGate& gate_;
    std::optional<ScopedContext> context_;
  };

  // VmmBackend's synchronize, record_reads, wait_reads, set_sync_streams,
  // suspend_driver_calls and resume_driver_calls, for a CUDA backend.
  void synchronize();
  uint64_t record_reads() noexcept;
  void wait_reads(uint64_t ticket);
  bool reads_done(uint64_t ticket) noexcept;
  void set_streams(const std::vector<uintptr_t>& streams);
  void suspend() { gate_.suspend(); }
  void resume() noexcept;       // opens the gate, then issues what waited for it
  void capture_begin() { gate_.capture_begin(); }
  void capture_end() noexcept;  // the same, once the last capture ended

  // A release, or teardown work, that must not reach the driver during a
  // capture: kept (true) while the gate is closed, to run in our context
  // when it opens; false when it is open (the caller runs it now).
  // `work` is moved from only when kept.
  bool defer_until_open(std::function<void()>& work) noexcept;
  // Runs what was kept, even with the gate closed: for the owner's
  // destructor, after which nothing could ever run it (nothing can open
  // this gate any more).
  void run_deferred_now() noexcept { run_deferred(true); }

  // (name, value) pairs: how waits are done and how often (for facts()).
  void add_facts(std::vector<std::pair<std::string, std::string>>& out) const;

  // In a fork() child: the events belong to the parent's context; never call
  // the driver for them.
  void detach_after_fork() noexcept { forked_ = true; }

 private:
  // One read fence: an event on each named stream, recorded together.
  struct Fence {
    uint64_t seq = 0;             // the fence these events were recorded for
    std::vector<CUevent> events;  // one per stream
  };

  void run_deferred(bool even_if_closed) noexcept;
  uint64_t record_fence_locked();
  std::vector<CUevent> take_event_set_locked();
  void retire_fences_locked();
  bool fence_finished(uint64_t ticket) noexcept;
  void wait_now_locked();
  void destroy_fences_locked() noexcept;
  void check(const char* call, CUresult rc) const;

  const DriverApi& api_;
  CUcontext ctx_;
  DriverGate gate_;
  bool forked_ = false;
  // streams_mu_: shared by record/wait (the mapper and callers at once),
  // unique to change the streams; fence_mu_ guards the ring.
  mutable std::shared_mutex streams_mu_;
  std::vector<CUstream> streams_;  // empty: synchronize the whole device
  mutable std::mutex fence_mu_;
  // The fences after done_seq_, oldest first: fence n is live_[n - live_.front().seq]
  // (numbers are consecutive). A fence leaves once known finished, and its
  // events join spare_ for a later fence: no event is recorded again while
  // the fence it stands for may still be asked about.
  std::deque<Fence> live_;
  std::vector<std::vector<CUevent>> spare_;
  size_t event_sets_ = 0;          // sets made since streams were named (live_ + spare_)
  uint64_t next_seq_ = 1;          // the next fence's number (0 is kNoReads)
  uint64_t done_seq_ = 0;          // every fence up to this one has finished
  std::atomic<uint64_t> device_syncs_{0}, event_waits_{0}, fence_waits_skipped_{0}, fence_queries_{0},
      deferred_releases_{0};
};

// A VmmBackend on a CUDA device: holds the device's primary context for its
// life and the CudaSync of that context, and answers the fence and gate
// calls from it. Derived backends open CudaSync::Call / QuietCall on sync_
// in their own entry points and defer their releases with
// sync_.defer_until_open while a capture closes the gate.
class CudaDeviceBackend : public VmmBackend {
 public:
  void synchronize() override { sync_.synchronize(); }
  uint64_t record_reads() noexcept override { return sync_.record_reads(); }
  void wait_reads(uint64_t ticket) override { sync_.wait_reads(ticket); }
  bool reads_done(uint64_t ticket) noexcept override { return sync_.reads_done(ticket); }
  void set_sync_streams(const std::vector<uintptr_t>& streams) override { sync_.set_streams(streams); }
  void suspend_driver_calls() override { sync_.suspend(); }
  void resume_driver_calls() override { sync_.resume(); }
  void capture_begin() override { sync_.capture_begin(); }
  void capture_end() noexcept override { sync_.capture_end(); }
  bool defer_until_open(std::function<void()>& work) noexcept override {
    return !forked_ && sync_.defer_until_open(work);
  }
  // The derived backend's facts, then the fences' (how waits are done).
  std::vector<std::pair<std::string, std::string>> facts() const override {
    std::vector<std::pair<std::string, std::string>> out = backend_facts();
    sync_.add_facts(out);
    return out;
  }

 protected:
  CudaDeviceBackend(const DriverApi& api, int device) : api_(api), context_(api, device), sync_(api, context_.get()) {}
  // The parent's context and events: never touched in a fork() child.
  void detach_sync_after_fork() noexcept {
    forked_ = true;
    sync_.detach_after_fork();
    context_.forget();
  }
  virtual std::vector<std::pair<std::string, std::string>> backend_facts() const { return {}; }

  const DriverApi& api_;
  PrimaryContext context_;  // first: released after everything below
  CudaSync sync_;           // context scope, read fences, graph-capture gate
  bool forked_ = false;     // in a fork() child: never call the driver
};

}  // namespace cu
}  // namespace vattn
