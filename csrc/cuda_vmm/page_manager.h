// Page bookkeeping for one KV cache: which physical pages back which slot
// (request id) of which buffer, the pool of free pages, and the background
// mapper that hides the driver's latency. Knows slots and pages only; the
// Python manager above it knows layers, dtypes and tensors.
//
// Address layout (DESIGN.md section 1). One reservation holds every buffer:
//
//   base + b * buffer_bytes + s * slot_bytes + p * page_size
//          ^ buffer b         ^ slot s         ^ page p of that slot
//
// A slot's mapping is always a prefix: pages [0, mapped) of the slot are mapped
// in every buffer, so one count per slot describes it, and a request of n
// tokens needs ceil(n * bytes_per_token / page_size) of them.
//
// Locking discipline
// ------------------
// One mutex, mu_, guards every member below it in the class. Driver calls made
// by step(), free_slot(), reclaim() and close() run with mu_ held. The mapper thread
// plans under mu_, then runs its driver calls WITHOUT mu_ (so a step on the
// fast path never waits for the driver), then commits under mu_. Between plan
// and commit the batch is "in flight" (inflight_ is true):
//   * Its pages were taken out of free_pages_ / uncreated_ under mu_, so no
//     other thread can map them: a page is never mapped twice.
//   * Its target addresses lie past the committed prefix of their slots, and
//     a reclaim batch's pages were already cut from their slot's prefix. Any
//     call that would map or unmap addresses (step with new pages to map,
//     free_slot without deferral, reclaim, close) first waits on batch_done_
//     until inflight_ is false, so no two threads touch one address.
//   * The mapper only ever unmaps pages of free (unallocated) slots, and a
//     slot's pages are unmapped only after the device has finished the work
//     queued before (backend synchronize), so a page in use is never unmapped.
//   * A failed batch is rolled back at commit (pages back to the pool, nothing
//     committed) and its error is kept in mapper_error_ until the next step()
//     raises it: no page is lost and no error is dropped.
// There is one mapper thread per manager, started in the constructor and
// joined by close(); it sleeps on wake_ until step/alloc/free/reclaim give it work.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "vmm_backend.h"

namespace vattn {

struct PageManagerConfig {
  size_t num_buffers = 0;      // K and V buffers: 2 * layers (per_layer) or 2 (all_layers)
  size_t num_slots = 0;        // max concurrent requests (B)
  size_t slot_bytes = 0;       // bytes per slot per buffer, a multiple of page_size (S_req)
  size_t bytes_per_token = 0;  // bytes one token takes in one buffer (S_tok)
  size_t max_tokens = 0;       // max context length in tokens (L)
};

struct PolicyConfig {
  bool background = false;        // run the mapper thread
  bool deferred_reclaim = true;   // free_slot keeps pages; false: unmapped at once
  bool eager = false;             // mapper pre-maps the slot alloc_slot returns next (needs background)
  size_t lookahead_tokens = 1;    // mapper maps each active slot this many tokens ahead
  size_t eager_tokens = 0;        // tokens the next slot is pre-mapped for
  double reclaim_threshold = 0.1; // mapper reclaims free slots' pages below this fraction of the pool free
  size_t max_batch_pages = 1024;  // pages per mapper batch: bounds how long a step may wait for one
};

struct PageStats {
  size_t pages_total = 0;      // pool capacity
  size_t pages_created = 0;    // physical pages committed so far (never shrinks)
  size_t pages_mapped = 0;     // pages mapped in some slot of some buffer
  size_t pages_mapped_peak = 0;
  size_t pages_free_low = 0;   // low-water mark of free pages (pool capacity minus mapped)
  size_t slots_allocated = 0;
  size_t tokens_active = 0;    // sum of the last step's lengths of allocated slots
  uint64_t step_calls = 0;
  uint64_t failed_steps = 0;   // steps that returned false (not enough pages)
  uint64_t sync_page_maps = 0; // pages mapped inside step, on the critical path
  uint64_t background_page_maps = 0;
  uint64_t page_unmaps = 0;
  uint64_t reclaimed_pages = 0;  // pages unmapped from free slots (any path)
  uint64_t background_reclaimed_pages = 0;
  uint64_t mapper_wakeups = 0;  // times the mapper woke to plan work
  uint64_t mapper_batches = 0;
  uint64_t mapper_errors = 0;
  uint64_t step_wait_ns = 0;   // time steps spent waiting for an in-flight mapper batch
};

class PageManager {
 public:
  PageManager(std::shared_ptr<VmmBackend> backend, const PageManagerConfig& config,
              const PolicyConfig& policy);
  ~PageManager();  // close(), errors swallowed
  PageManager(const PageManager&) = delete;
  PageManager& operator=(const PageManager&) = delete;

  // Returns a free slot: the one whose mapped pages fit best (most pages when
  // prompt_tokens < 0; else the smallest that covers prompt_tokens, else the
  // largest), or wanted_slot when >= 0, after unmapping its pages beyond
  // prompt_tokens. Throws OutOfSlots when none is free.
  int64_t alloc_slot(int64_t prompt_tokens, int64_t wanted_slot = -1);
  // Marks a slot free. Its pages stay mapped (deferred_reclaim) or are unmapped now.
  void free_slot(int64_t slot);
  // Maps pages so every allocated slot s holds seq_lens[s] tokens. Returns
  // false, changing no active slot, when the pool cannot supply the pages even
  // after unmapping pages of free slots. Throws std::invalid_argument on bad
  // input (nothing changed), DriverError on driver failure (no new mapping
  // kept), and a mapper error held since the last step.
  bool step(const int64_t* seq_lens, size_t count);
  // Unmaps up to max_pages pages of free slots (tails first); returns how many.
  size_t reclaim(size_t max_pages);
  // Stops the mapper, unmaps everything, releases every physical page, drops
  // this manager's hold on the reservation. Idempotent; every other call
  // afterwards throws ClosedError.
  void close();
  // Blocks until the mapper has nothing left to do (tests and benchmarks).
  void wait_idle();

  bool closed() const;
  size_t mapped_pages(int64_t slot) const;  // pages per buffer mapped in slot
  bool slot_allocated(int64_t slot) const;
  PageStats stats() const;
  const PageManagerConfig& config() const { return config_; }
  const PolicyConfig& policy() const { return policy_; }
  size_t page_size() const { return page_size_; }
  size_t buffer_bytes() const { return config_.num_slots * config_.slot_bytes; }
  std::shared_ptr<Reservation> reservation() const;
  VmmBackend& backend() const { return *backend_; }

 private:
  using Lock = std::unique_lock<std::mutex>;

  // A unit of mapper work, one of three kinds:
  //   map:    create the last to_create of `pages`, map `pages` behind `mappings`
  //           for the slots in `slots`;
  //   unmap:  unmap `unmap_addrs`; their pages `pages` go back to the pool;
  //   create: create `pages` (all of them) into the free pool, mapping nothing,
  //           so page creation (the driver's slowest call) is off the critical path.
  struct Batch {
    std::vector<PageMapping> mappings;
    std::vector<uint32_t> pages;
    size_t to_create = 0;  // the last to_create entries of pages must be created first
    bool created = false;  // run_batch created them (a failed map returns them as created)
    std::vector<size_t> slots;     // slot of each run, in order
    std::vector<size_t> run_pages; // pages per buffer added to that slot
    std::vector<uintptr_t> unmap_addrs;
    bool empty() const { return pages.empty(); }
  };

  void check_open() const;
  void check_slot(int64_t slot, const char* what) const;
  size_t pages_for_tokens(int64_t tokens) const;
  uintptr_t page_address(size_t buffer, size_t slot, size_t page) const;
  size_t mapped_of(size_t slot) const { return slot_pages_[slot].size() / config_.num_buffers; }
  // Pages per buffer slot s lacks for this step's length (need_[s]). Reclaim
  // only touches free slots, whose need_ is 0, so this stays valid across it.
  size_t missing_pages(size_t s) const { return need_[s] > mapped_of(s) ? need_[s] - mapped_of(s) : 0; }
  size_t available_pages() const { return free_pages_.size() + uncreated_.size(); }
  // Pages per buffer slot s should hold once the mapper has run: its last
  // length plus lookahead_tokens.
  size_t lookahead_pages(size_t s) const {
    return pages_for_tokens(std::min<int64_t>(slot_tokens_[s] + static_cast<int64_t>(policy_.lookahead_tokens),
                                              static_cast<int64_t>(config_.max_tokens)));
  }
  int64_t best_free_slot(int64_t prompt_tokens) const;
  void wait_for_batch(Lock& lock);
  void note_mapped(size_t added);
  // Takes `count` page ids (free ones first, then uncreated ones, which are
  // placed last) into out; returns how many must be created. Caller holds mu_
  // and has checked available_pages() >= count.
  size_t claim_pages(size_t count, std::vector<uint32_t>& out);
  // Gives claimed pages back: the last `uncreated` of them were never created.
  void return_pages(const std::vector<uint32_t>& pages, size_t uncreated);
  // Claims, creates and maps the growth of every slot to need_, with mu_ held.
  void map_missing_locked(size_t deficit);
  // Cuts tail pages of free slots (smallest slots first, never `keep_slot`)
  // until `want` pages are gathered; fills addrs/pages. Caller holds mu_.
  size_t detach_free_pages(size_t want, int64_t keep_slot, std::vector<uintptr_t>& addrs,
                           std::vector<uint32_t>& pages);
  // Detaches, synchronizes and unmaps with mu_ held; returns pages reclaimed.
  size_t reclaim_locked(size_t want, int64_t keep_slot);
  // Unmaps the slot's pages from page keep_pages on (all of them by default).
  void unmap_slot_locked(size_t slot, size_t keep_pages = 0);

  void mapper_loop();
  Batch plan_batch();  // caller holds mu_
  void run_batch(Batch& batch);  // without mu_; throws
  void commit_batch(Batch& batch, std::exception_ptr error);  // caller holds mu_

  std::shared_ptr<VmmBackend> backend_;
  const PageManagerConfig config_;
  const PolicyConfig policy_;
  const size_t page_size_;
  const size_t reclaim_floor_pages_;  // reclaim_threshold * pool, in pages

  std::mutex close_mu_;  // serializes close() (joining the mapper twice is undefined)
  mutable std::mutex mu_;
  std::condition_variable wake_;        // mapper: work may have changed, or stop
  std::condition_variable batch_done_;  // waiters: inflight_ became false
  std::shared_ptr<Reservation> reservation_;  // null once closed
  // slot_pages_[s][p * num_buffers + b] = physical page behind page p of slot s in buffer b
  std::vector<std::vector<uint32_t>> slot_pages_;
  std::vector<uint8_t> slot_allocated_;
  std::vector<int64_t> slot_tokens_;  // last step's length per slot
  std::vector<uint32_t> free_pages_;  // created, unmapped pages
  std::vector<uint32_t> uncreated_;   // page ids never created; back() is the smallest
  bool inflight_ = false;             // a mapper batch is between plan and commit
  bool stop_ = false;                 // mapper must exit
  bool mapper_idle_ = true;           // mapper waits for work
  uint64_t mapper_seen_epoch_ = 0;    // work_epoch_ the mapper last planned for
  uint64_t work_epoch_ = 0;           // bumped whenever the mapper's work may change
  std::exception_ptr mapper_error_;   // raised by the next step
  PageStats stats_;
  // Scratch reused by every step so the hot path does not allocate.
  std::vector<size_t> need_;  // target pages per buffer per slot for the current step
  std::vector<uint32_t> taken_;
  std::vector<PageMapping> mappings_;
  std::thread mapper_;  // last: started after everything above exists
};

}  // namespace vattn
