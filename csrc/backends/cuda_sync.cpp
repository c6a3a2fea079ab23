#include "backends/cuda_sync.h"

#include <algorithm>
#include <stdexcept>

#include "backends/vmm_backend.h"
#include "common/errors.h"

namespace vattn {
namespace cu {

void check_device_exists(const DriverApi& api, int device) {
  int count = 0;
  CUresult rc = api.cuDeviceGetCount(&count);
  if (rc != CUDA_SUCCESS) throw DriverError("cuDeviceGetCount", error_name(api, rc));
  if (device < 0 || device >= count)
    throw BackendUnavailable("CUDA device " + std::to_string(device) + " does not exist (" +
                             std::to_string(count) + " device(s) visible)");
}

// ---- parked references ------------------------------------------------------------

namespace {

struct Parked {
  const DriverApi* api;
  CUdevice dev;
  uint64_t generation;  // fork_generation() when parked
};
std::mutex parked_mu;
std::vector<Parked> parked;

}  // namespace

void park_primary_context(const DriverApi& api, CUdevice dev) noexcept {
  {
    std::lock_guard<std::mutex> lock(parked_mu);
    bool mine = false;
    for (auto it = parked.begin(); it != parked.end();) {
      if (it->api == &api && it->dev == dev) {
        if (it->generation == fork_generation()) mine = true;
        if (it->generation != fork_generation()) {
          it = parked.erase(it);  // the parent's: forgotten, never released here
          continue;
        }
      }
      ++it;
    }
    if (!mine) {
      try {
        parked.push_back(Parked{&api, dev, fork_generation()});
        return;
      } catch (...) {
        // no memory for the entry: release below
      }
    }
  }
  api.cuDevicePrimaryCtxRelease(dev);  // one is parked already: the context stays alive by it
}

bool release_parked_context(const DriverApi& api, CUdevice dev) noexcept {
  bool release = false;
  {
    std::lock_guard<std::mutex> lock(parked_mu);
    for (auto it = parked.begin(); it != parked.end(); ++it)
      if (it->api == &api && it->dev == dev) {
        release = it->generation == fork_generation();
        parked.erase(it);
        break;
      }
  }
  if (release) api.cuDevicePrimaryCtxRelease(dev);
  return release;
}

// ---- PrimaryContext --------------------------------------------------------------

PrimaryContext::PrimaryContext(const DriverApi& api, int device) : api_(api) {
  CUresult rc = api_.cuDeviceGet(&dev_, device);
  if (rc != CUDA_SUCCESS) throw DriverError("cuDeviceGet", error_name(api_, rc));
  rc = api_.cuDevicePrimaryCtxRetain(&ctx_, dev_);
  if (rc != CUDA_SUCCESS) throw DriverError("cuDevicePrimaryCtxRetain", error_name(api_, rc));
  release_parked_context(api_, dev_);  // ours keeps the context now
}

PrimaryContext::~PrimaryContext() {
  // If ours was the last reference the context is destroyed: its owner has
  // popped it everywhere by now (every ScopedContext is gone).
  if (!forgotten_) api_.cuDevicePrimaryCtxRelease(dev_);
}

// ---- DriverGate ------------------------------------------------------------------

void DriverGate::enter(bool may_throw) {
  std::lock_guard<std::mutex> lock(mu_);
  if (may_throw && captures_ > 0 && !suspended_)
    throw DriverError("CUDA graph capture",
                      "a CUDA graph is being captured in this process (torch.cuda.CUDAGraph.capture_begin); "
                      "vattn calls that reach the CUDA driver fail until capture_end: map what the capture "
                      "reads before it (step first)");
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

void DriverGate::leave() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  --active_;
  idle_.notify_all();
}

bool DriverGate::suspended() {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_locked();
}

void DriverGate::capture_begin() {
  std::unique_lock<std::mutex> lock(mu_);
  ++captures_;
  idle_.wait(lock, [&] { return active_ == 0; });
}

void DriverGate::capture_end() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (captures_ > 0) --captures_;
  idle_.notify_all();
}

void DriverGate::suspend() {
  std::unique_lock<std::mutex> lock(mu_);
  if (suspended_) throw std::logic_error("driver calls are already suspended (graph_capture is not reentrant)");
  suspended_ = true;
  owner_ = std::this_thread::get_id();
  idle_.wait(lock, [&] { return active_ == 0; });
}

void DriverGate::resume() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  suspended_ = false;
  idle_.notify_all();
}

bool DriverGate::defer(std::function<void()>& work) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!closed_locked()) return false;
  deferred_.push_back(std::move(work));
  return true;
}

std::vector<std::function<void()>> DriverGate::take_deferred(bool even_if_closed) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::function<void()>> out;
  if (even_if_closed || !closed_locked()) out.swap(deferred_);
  return out;
}

// ---- entry points ----------------------------------------------------------------

CudaSync::Call::Call(CudaSync& sync, Scope scope) : gate_(sync.gate_) {
  gate_.enter(true);
  if (scope == Scope::kGateOnly) return;
  context_.emplace(sync.api_, sync.ctx_);
  try {
    context_->check();
  } catch (...) {
    context_.reset();
    gate_.leave();
    throw;
  }
}

CudaSync::Call::~Call() {
  context_.reset();  // pop before leaving the gate
  gate_.leave();
}

CudaSync::QuietCall::QuietCall(CudaSync& sync, Scope scope) : gate_(sync.gate_) {
  gate_.enter(false);
  if (scope == Scope::kContext) context_.emplace(sync.api_, sync.ctx_);
}

CudaSync::QuietCall::~QuietCall() {
  context_.reset();
  gate_.leave();
}

// ---- releases deferred past a capture ---------------------------------------------

void CudaSync::resume() noexcept {
  gate_.resume();
  run_deferred(false);
}

void CudaSync::capture_end() noexcept {
  gate_.capture_end();
  run_deferred(false);
}

bool CudaSync::defer_until_open(std::function<void()>& work) noexcept {
  if (forked_) return false;
  try {
    if (!gate_.defer(work)) return false;
  } catch (...) {
    return false;  // no memory to keep it: the caller runs it now
  }
  ++deferred_releases_;
  return true;
}

void CudaSync::run_deferred(bool even_if_closed) noexcept {
  std::vector<std::function<void()>> work;
  try {
    work = gate_.take_deferred(even_if_closed);
  } catch (...) {
    return;
  }
  if (work.empty() || forked_) return;
  // Our context for the releases that call the driver directly; teardown
  // work opens its own calls (nested: the context is current already).
  QuietCall call(*this);
  for (auto& w : work) {
    try {
      w();
    } catch (...) {
      // Releases report nothing: what the driver refused stays held.
    }
  }
}

// ---- read fences -----------------------------------------------------------------

CudaSync::~CudaSync() {
  if (forked_) return;
  run_deferred(true);  // the owner ran its own already; nothing can open the gate after this
  if (live_.empty() && spare_.empty()) return;
  // Errors are ignored: destructors never throw, and at process exit the
  // driver may already be deinitialised.
  ScopedContext context(api_, ctx_);
  if (context.ok()) destroy_fences_locked();
}

void CudaSync::synchronize() {
  Call call(*this);
  std::shared_lock<std::shared_mutex> streams(streams_mu_);
  wait_now_locked();
}

uint64_t CudaSync::record_reads() noexcept {
  // While a graph is captured an event recorded on the capturing stream
  // would join the graph: name no fence then (the wait is "now").
  if (forked_ || gate_.suspended()) return VmmBackend::kReadsNow;
  try {
    Call call(*this);
    std::shared_lock<std::shared_mutex> streams(streams_mu_);
    if (streams_.empty()) return VmmBackend::kReadsNow;
    return record_fence_locked();
  } catch (...) {
    return VmmBackend::kReadsNow;  // a later wait covers the reads all the same
  }
}

void CudaSync::wait_reads(uint64_t ticket) {
  if (ticket == VmmBackend::kNoReads) return;
  Call call(*this);
  std::shared_lock<std::shared_mutex> streams(streams_mu_);
  std::vector<CUevent> events;
  {
    std::lock_guard<std::mutex> lock(fence_mu_);
    if (ticket != VmmBackend::kReadsNow && ticket <= done_seq_) {
      ++fence_waits_skipped_;  // an earlier wait covered it
      return;
    }
    // A fence after done_seq_ is live, with its own events.
    if (ticket != VmmBackend::kReadsNow && ticket < next_seq_ && !streams_.empty())
      events = live_[ticket - live_.front().seq].events;
  }
  if (events.empty()) {
    wait_now_locked();
    return;
  }
  // A wait or query on another thread may retire this fence meanwhile and
  // its events be recorded for a later one: this wait then covers more, never less.
  for (CUevent e : events) {
    ++event_waits_;
    check("cuEventSynchronize", api_.cuEventSynchronize(e));
  }
  std::lock_guard<std::mutex> lock(fence_mu_);
  done_seq_ = std::max(done_seq_, ticket);
}

bool CudaSync::reads_done(uint64_t ticket) noexcept {
  if (ticket == VmmBackend::kNoReads) return true;
  if (ticket == VmmBackend::kReadsNow || forked_ || gate_.suspended()) return false;  // only a wait can tell
  try {
    Call call(*this);
    std::shared_lock<std::shared_mutex> streams(streams_mu_);
    return fence_finished(ticket);
  } catch (...) {
    return false;
  }
}

// Whether fence `ticket` finished, asking the driver about its own events.
// The caller holds streams_mu_ (shared) and a Call.
bool CudaSync::fence_finished(uint64_t ticket) noexcept {
  std::vector<CUevent> events;
  {
    std::lock_guard<std::mutex> lock(fence_mu_);
    if (ticket <= done_seq_) return true;
    if (ticket >= next_seq_ || streams_.empty()) return false;
    events = live_[ticket - live_.front().seq].events;
  }
  ++fence_queries_;
  bool finished = true;
  for (CUevent e : events)
    if (api_.cuEventQuery(e) != CUDA_SUCCESS) finished = false;  // CUDA_ERROR_NOT_READY, or an error a wait reports
  std::lock_guard<std::mutex> lock(fence_mu_);
  // Not finished by these events: they may have been retired and recorded
  // for a later fence meanwhile, which happens only once this one is known done.
  if (!finished) return ticket <= done_seq_;
  done_seq_ = std::max(done_seq_, ticket);  // later waits and queries of it answer at once
  return true;
}

void CudaSync::set_streams(const std::vector<uintptr_t>& streams) {
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
  done_seq_ = next_seq_ - 1;
}

void CudaSync::add_facts(std::vector<std::pair<std::string, std::string>>& out) const {
  size_t num_streams = 0;
  {
    std::shared_lock<std::shared_mutex> lock(streams_mu_);
    num_streams = streams_.size();
  }
  out.emplace_back("sync", num_streams == 0 ? std::string("cuCtxSynchronize")
                                            : "events on " + std::to_string(num_streams) + " stream(s)");
  out.emplace_back("device_syncs", std::to_string(device_syncs_.load()));
  out.emplace_back("event_waits", std::to_string(event_waits_.load()));
  out.emplace_back("fence_waits_skipped", std::to_string(fence_waits_skipped_.load()));
  out.emplace_back("fence_queries", std::to_string(fence_queries_.load()));
  size_t event_sets = 0;
  {
    std::lock_guard<std::mutex> lock(fence_mu_);
    event_sets = event_sets_;
  }
  out.emplace_back("fence_event_sets", std::to_string(event_sets));
  out.emplace_back("deferred_releases", std::to_string(deferred_releases_.load()));
}

// The caller holds streams_mu_ (shared) and a Call.
uint64_t CudaSync::record_fence_locked() {
  std::lock_guard<std::mutex> lock(fence_mu_);
  std::vector<CUevent> events = take_event_set_locked();
  for (size_t i = 0; i < streams_.size(); ++i) {
    CUresult rc = api_.cuEventRecord(events[i], streams_[i]);
    if (rc != CUDA_SUCCESS) {
      spare_.push_back(std::move(events));  // recorded again, whole, by the next fence
      throw DriverError("cuEventRecord", error_name(api_, rc));
    }
  }
  const uint64_t seq = next_seq_++;
  live_.push_back(Fence{seq, std::move(events)});
  return seq;
}

// An event set for a new fence: a retired fence's, else a new one. The
// caller holds fence_mu_, streams_mu_ and a Call.
std::vector<CUevent> CudaSync::take_event_set_locked() {
  retire_fences_locked();
  if (spare_.empty() && !live_.empty()) {
    // Ask the oldest fence before making events: the device is usually past it.
    bool finished = true;
    for (CUevent e : live_.front().events)
      if (api_.cuEventQuery(e) != CUDA_SUCCESS) finished = false;
    if (finished) {
      done_seq_ = std::max(done_seq_, live_.front().seq);
      retire_fences_locked();
    }
  }
  if (!spare_.empty()) {
    std::vector<CUevent> events = std::move(spare_.back());
    spare_.pop_back();
    return events;
  }
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
  ++event_sets_;
  return made;
}

// Fences up to done_seq_ give their events back. The caller holds fence_mu_.
void CudaSync::retire_fences_locked() {
  while (!live_.empty() && live_.front().seq <= done_seq_) {
    spare_.push_back(std::move(live_.front().events));
    live_.pop_front();
  }
}

// Waits for the work queued so far on the named streams, or the device.
// The caller holds streams_mu_ (either way) and a Call.
void CudaSync::wait_now_locked() {
  if (streams_.empty()) {
    ++device_syncs_;
    check("cuCtxSynchronize", api_.cuCtxSynchronize());
    return;
  }
  uint64_t seq = record_fence_locked();
  std::vector<CUevent> events;
  {
    std::lock_guard<std::mutex> lock(fence_mu_);
    if (seq > done_seq_) events = live_[seq - live_.front().seq].events;
  }
  for (CUevent e : events) {
    ++event_waits_;
    check("cuEventSynchronize", api_.cuEventSynchronize(e));
  }
  std::lock_guard<std::mutex> lock(fence_mu_);
  done_seq_ = std::max(done_seq_, seq);
}

// The caller holds streams_mu_ (unique) or is the destructor, in our context.
void CudaSync::destroy_fences_locked() noexcept {
  for (Fence& f : live_)
    for (CUevent e : f.events) api_.cuEventDestroy(e);
  for (auto& set : spare_)
    for (CUevent e : set) api_.cuEventDestroy(e);
  live_.clear();
  spare_.clear();
  event_sets_ = 0;
}

void CudaSync::check(const char* call, CUresult rc) const {
  if (rc != CUDA_SUCCESS) throw DriverError(call, error_name(api_, rc));
}

}  // namespace cu
}  // namespace vattn
