// Page bookkeeping for one KV cache: which physical pages back which slot
// (request id) of which buffer, and the pool of free pages. Knows slots and
// pages only; the Python manager above it knows layers, dtypes and tensors.
//
// Address layout (DESIGN.md section 1). One reservation holds every buffer:
//
//   base + b * buffer_bytes + s * slot_bytes + p * page_size
//          ^ buffer b         ^ slot s         ^ page p of that slot
//
// A slot's mapping is always a prefix: pages [0, mapped) of the slot are mapped
// in every buffer, so one count per slot describes it, and a request of n
// tokens needs ceil(n * bytes_per_token / page_size) of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
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

struct PageStats {
  size_t pages_total = 0;      // pool capacity
  size_t pages_created = 0;    // physical pages committed so far (never shrinks)
  size_t pages_mapped = 0;     // pages mapped in some slot of some buffer
  size_t pages_mapped_peak = 0;
  size_t slots_allocated = 0;
  size_t tokens_active = 0;    // sum of the last step's lengths of allocated slots
  uint64_t step_calls = 0;
  uint64_t failed_steps = 0;   // steps that returned false (not enough pages)
  uint64_t sync_page_maps = 0; // pages mapped inside step
  uint64_t page_unmaps = 0;
  uint64_t reclaimed_pages = 0;  // pages unmapped from free slots
};

class PageManager {
 public:
  PageManager(std::shared_ptr<VmmBackend> backend, const PageManagerConfig& config);
  ~PageManager();  // close(), errors swallowed
  PageManager(const PageManager&) = delete;
  PageManager& operator=(const PageManager&) = delete;

  // Returns a free slot: the one whose mapped pages fit best (most pages when
  // prompt_tokens < 0; else the smallest that covers prompt_tokens, else the
  // largest). Throws OutOfSlots when none is free.
  int64_t alloc_slot(int64_t prompt_tokens);
  // Marks a slot free; its pages stay mapped (deferred reclamation).
  void free_slot(int64_t slot);
  // Maps pages so every allocated slot s holds seq_lens[s] tokens. Returns
  // false, changing no active slot, when the pool cannot supply the pages even
  // after unmapping pages of free slots. Throws std::invalid_argument on bad
  // input (nothing changed) and DriverError on driver failure (no new mapping kept).
  bool step(const int64_t* seq_lens, size_t count);
  // Unmaps up to max_pages pages of free slots (tails first); returns how many.
  size_t reclaim(size_t max_pages);
  // Unmaps everything, releases every physical page, drops this manager's hold
  // on the reservation. Idempotent; every other call afterwards throws ClosedError.
  void close();

  bool closed() const;
  size_t mapped_pages(int64_t slot) const;  // pages per buffer mapped in slot
  bool slot_allocated(int64_t slot) const;
  PageStats stats() const;
  const PageManagerConfig& config() const { return config_; }
  size_t page_size() const { return page_size_; }
  size_t buffer_bytes() const { return config_.num_slots * config_.slot_bytes; }
  std::shared_ptr<Reservation> reservation() const;
  VmmBackend& backend() const { return *backend_; }

 private:
  void check_open() const;
  void check_slot(int64_t slot, const char* what) const;
  size_t pages_for_tokens(int64_t tokens) const;
  uintptr_t page_address(size_t buffer, size_t slot, size_t page) const;
  size_t mapped_of(size_t slot) const { return slot_pages_[slot].size() / config_.num_buffers; }
  // Pages per buffer slot s lacks for this step's length (need_[s]). Reclaim
  // only touches free slots, whose need_ is 0, so this stays valid across it.
  size_t missing_pages(size_t s) const { return need_[s] > mapped_of(s) ? need_[s] - mapped_of(s) : 0; }
  size_t available_pages() const;
  // Unmaps tail pages of free slots, smallest slots first, until `want` pages
  // are back in the pool or none are left. Caller holds mu_.
  size_t reclaim_locked(size_t want);
  // Takes `count` pages from the free list, creating pages as needed. Caller
  // holds mu_ and has checked available_pages() >= count.
  void take_pages(size_t count, std::vector<uint32_t>& out);

  std::shared_ptr<VmmBackend> backend_;
  const PageManagerConfig config_;
  const size_t page_size_;
  const size_t pages_per_slot_;

  // Everything below is guarded by mu_. Driver calls are made with mu_ held,
  // so no two threads ever map or unmap the same address concurrently.
  mutable std::mutex mu_;
  std::shared_ptr<Reservation> reservation_;  // null once closed
  // slot_pages_[s][p * num_buffers + b] = physical page behind page p of slot s in buffer b
  std::vector<std::vector<uint32_t>> slot_pages_;
  std::vector<uint8_t> slot_allocated_;
  std::vector<int64_t> slot_tokens_;  // last step's length per slot
  std::vector<uint32_t> free_pages_;  // created, unmapped pages
  uint32_t next_uncreated_ = 0;       // pages [next_uncreated_, num_pages) not created yet
  PageStats stats_;
  // Scratch reused by every step so the hot path does not allocate.
  std::vector<size_t> need_;  // target pages per buffer per slot for the current step
  std::vector<uint32_t> taken_;
  std::vector<PageMapping> mappings_;
};

}  // namespace vattn
