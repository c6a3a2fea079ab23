// One interface over the virtual-memory backends (host memfd + mmap, the CUDA
// driver's VMM, the patched nvidia-uvm). A backend knows address ranges and
// physical pages, nothing about requests, layers or tensors. Each backend is
// one source file that registers its factory by name (backend_registry.h);
// backends on a CUDA device share cuda_sync.h (context, fences, graph capture).
//
// Physical pages form one pool of `num_pages` pages of `page_size` bytes, named
// by index 0..num_pages-1. A page must be created before it is mapped; one
// page may be mapped at several addresses at once (shared pages).
//
// Failure contract: map and unmap work through their list in order and report
// how far they got, so the caller's page table can describe exactly what is
// mapped after any failure. A backend never exits and never leaves an address
// half-mapped without saying so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/dlpack.h"

namespace vattn {

// One page-sized mapping: physical page `page` at virtual address `addr`.
struct PageMapping {
  uintptr_t addr;
  uint32_t page;
};

class VmmBackend {
 public:
  virtual ~VmmBackend() = default;

  virtual std::string name() const = 0;
  // Smallest page size in bytes the backend can map; page sizes are multiples of it.
  virtual size_t granularity() const = 0;
  virtual size_t page_size() const = 0;
  virtual size_t num_pages() const = 0;
  virtual DLDevice dl_device() const = 0;

  // Reserves `bytes` (a multiple of page_size) of address space; commits nothing.
  virtual uintptr_t reserve(size_t bytes) = 0;
  // Returns a reservation. Every page in it should be unmapped first (the host
  // backend tolerates leftovers, the CUDA driver refuses and the range leaks).
  // Returns false when the range could not be freed. Never throws.
  virtual bool free_reservation(uintptr_t base, size_t bytes) noexcept = 0;

  // Creates (commits) the physical pages `ids`; a page still held after a
  // failed release is kept as it is. On failure the pages created by this
  // call are released again, then it throws.
  virtual void create_pages(const uint32_t* ids, size_t count) = 0;
  // Releases created physical pages (mappings that remain keep the memory
  // until they go). Returns how many pages' memory did not go back (the
  // driver or the OS refused the release: host, the hole punch; CUDA,
  // cuMemRelease; cuda_uvm, VATTN_UVM_RELEASE); with `failed` not null,
  // failed[i] is 1 for each such page and 0 for the others. A page whose
  // release failed is still created: a later create_pages of it keeps that
  // memory (no second allocation), and close_pool tries again. Never throws.
  virtual size_t release_pages(const uint32_t* ids, size_t count, uint8_t* failed = nullptr) noexcept = 0;

  // Maps each page at its address (unmapped before), readable and writable, in
  // order. Sets *done to the number of leading entries now mapped: count on
  // success; on failure it throws and entries [*done, count) are unmapped, the
  // caller undoes [0, *done).
  virtual void map(const PageMapping* mappings, size_t count, size_t* done) = 0;
  // Makes the page-table entries of the mapped pages at `addrs` now, writable,
  // so that the first write into them takes no fault (the host leaves them to
  // first touch otherwise: a fault per OS page). A hint: where it cannot
  // (another backend, whose map makes them; an old kernel; memory short) the
  // pages fault in at first touch as without it. Never throws.
  virtual void populate(const uintptr_t* addrs, size_t count) noexcept {
    (void)addrs;
    (void)count;
  }
  // Unmaps the page-sized mappings at `addrs`, in order. Sets *done to the
  // number of leading entries now unmapped; on failure it throws and entries
  // [*done, count) are still mapped. Callers first make sure no device work
  // still reads them (see synchronize).
  virtual void unmap(const uintptr_t* addrs, size_t count, size_t* done) = 0;
  // Copies `bytes` between two mapped ranges; complete when it returns.
  virtual void copy(uintptr_t dst, uintptr_t src, size_t bytes) = 0;
  // Waits until device work that may read mapped pages has finished.
  virtual void synchronize() = 0;

  // Read fences: the caller records one when it knows that every read of some
  // pages has been queued (a request was freed), and waits on it before it
  // unmaps those pages, instead of waiting for whatever is queued by then.
  // kNoReads: nothing ever read the pages, no wait; kReadsNow: wait like
  // synchronize(). A later ticket covers every earlier one.
  static constexpr uint64_t kNoReads = 0;
  static constexpr uint64_t kReadsNow = UINT64_MAX;
  // The work queued so far on the streams that may read the cache (see
  // set_sync_streams); kReadsNow when the backend cannot name it. Never throws.
  virtual uint64_t record_reads() noexcept { return kReadsNow; }
  // Waits until the work `ticket` names has finished.
  virtual void wait_reads(uint64_t ticket) {
    if (ticket != kNoReads) synchronize();
  }
  // Whether the work `ticket` names has finished, without waiting for it
  // (false when only a wait can tell). Never throws.
  virtual bool reads_done(uint64_t ticket) noexcept { return ticket == kNoReads; }
  // Releases every physical page and the pool's own handles. Afterwards the
  // backend only frees reservations. Never throws.
  virtual void close_pool() noexcept = 0;

  // The streams whose work may read mapped pages (raw stream handles):
  // synchronize() then waits for the work queued on them so far, and read
  // fences are events on them, instead of waits for the whole device. Empty:
  // the whole device (the default). Backends without streams accept only an
  // empty list.
  virtual void set_sync_streams(const std::vector<uintptr_t>& streams) {
    if (!streams.empty())
      throw std::invalid_argument("sync_streams: the " + name() + " backend has no streams (pass none)");
  }
  // While a CUDA graph is captured: every driver call that maps, unmaps,
  // creates or waits throws DriverError (from any thread: none may block
  // while it holds the page manager's lock), until resume_driver_calls().
  // Releases and teardown never fail there: they wait for the gate to open
  // (defer_until_open). Waits for the calls under way.
  // No-ops on backends without a device; every CUDA backend gets them from
  // cuda_sync.h.
  virtual void suspend_driver_calls() {}
  virtual void resume_driver_calls() {}
  // A CUDA graph capture began (or ended) somewhere in this process, outside
  // graph_capture() (vattn's hook on torch.cuda.CUDAGraph): the same gate as
  // suspend_driver_calls, counted, so captures may nest and overlap
  // graph_capture(). Begin waits for the calls under way.
  virtual void capture_begin() {}
  virtual void capture_end() noexcept {}
  // While driver calls are closed for a capture (either way above): keeps
  // `work` (moved from), which calls this backend to release or tear down,
  // and runs it when they open again, never during the capture; returns
  // true. Otherwise returns false and leaves `work` to the caller, who runs
  // it now. `work` must not throw. Backends without a device never keep any.
  virtual bool defer_until_open(std::function<void()>& work) noexcept {
    (void)work;
    return false;
  }
  // What the backend learned about its driver at run time, as (name, value)
  // pairs, for diagnostics and benchmark records.
  virtual std::vector<std::pair<std::string, std::string>> facts() const { return {}; }

  // In the child of a fork(): the pages belong to the parent. Makes [base,
  // base + bytes) inaccessible in this process (host: the shared mappings are
  // replaced, so the child can never write the parent's pages), drops the
  // pool's handles without touching the driver, and makes every later call a
  // no-op or an error. Only async-signal-safe calls. Never throws.
  virtual void detach_after_fork(uintptr_t base, size_t bytes) noexcept = 0;
};

// Bumped in the child of every fork(). An object created under another
// generation belongs to an ancestor process and must not act.
uint64_t fork_generation();
// The child-side fork handler (registered with pthread_atfork on first use).
void fork_child_detach_all() noexcept;

// The memory of one KV cache: its address range and, once its manager has
// closed, the mappings still in it. Owned jointly by the page manager and every
// tensor view (DLPack capsules hold a shared_ptr), like a torch storage: the
// pages stay mapped and the range reserved until the last owner goes, so a
// view that outlives cleanup() still reads what it read before.
class CacheMemory {
 public:
  CacheMemory(std::shared_ptr<VmmBackend> backend, size_t bytes);
  ~CacheMemory();  // teardown, errors swallowed; nothing at all in a forked child
  CacheMemory(const CacheMemory&) = delete;
  CacheMemory& operator=(const CacheMemory&) = delete;

  uintptr_t base() const { return base_; }
  size_t bytes() const { return bytes_; }
  DLDevice dl_device() const { return backend_->dl_device(); }
  VmmBackend& backend() const { return *backend_; }
  const std::shared_ptr<VmmBackend>& backend_ptr() const { return backend_; }
  bool in_creator_process() const { return fork_generation() == generation_; }

  // The manager closes: `mapped` lists every address still mapped. They are
  // unmapped at teardown, when the last owner is gone.
  void hand_over(std::vector<uintptr_t> mapped);
  // `fn` runs once the pool is released (at teardown, or now if that ran):
  // what accounts for the pages (a budget share) ends with them, also when a
  // tensor view kept them past the manager's close. `fn` must not throw.
  void on_teardown(std::function<void()> fn);
  // Unmaps what was handed over, releases the pool and the range. Throws the
  // first driver error after doing all it can. Idempotent.
  void teardown();

 private:
  friend void fork_child_detach_all() noexcept;
  std::shared_ptr<VmmBackend> backend_;
  uintptr_t base_ = 0;
  size_t bytes_ = 0;
  uint64_t generation_ = 0;
  std::mutex mu_;  // guards the two below
  std::vector<uintptr_t> handed_over_;
  std::vector<std::function<void()>> on_teardown_;
  bool torn_down_ = false;
};

}  // namespace vattn
