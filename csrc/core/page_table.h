// The page table of one KV cache: which page id sits at each position of each
// reqid, how many references each id has, which ids are free, and the counters.
// It records what the caller did; it decides nothing (core/policy.h does), it
// calls no driver and takes no lock (core/page_manager.h does both).
//
// Page ids. Ids 0..num_ids-1 each name one physical page per buffer. A reqid
// (request id) maps a prefix of positions [0, n) of its slice, the same id at
// a position in every buffer. With external ids the front of a prefix may be
// holes (unmap_pages_below): positions that map nothing and hold no
// reference, so a sliding window's slice gives back the pages behind the
// window and keeps its addresses. An id's reference count is its mappings
// (positions of reqids, and orphans) plus the prefix handles holding it; an
// id is in exactly one of: referenced, the free pool (created, unreferenced),
// the uncreated list, or in flight (claimed by the caller, not yet appended or
// given back).
//
// Two ways to own page ids:
//   * managed: the table hands out ids from its pool (claim) and takes them
//     back when their last reference goes;
//   * external: the caller owns every id; the pool is not used, and an id
//     whose last reference goes stays the caller's.
//
// Orphans. A position whose addresses could not all be unmapped stays
// referenced as an orphan (reqid, position, id, the addresses still mapped)
// until a retry unmaps them: its id is never handed out twice.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace vattn {

// Counters. "pages" are physical pages (a page id counts num_buffers of them).
// The occupancy counters follow from the table's operations; the event
// counters marked "caller" are bumped by the page manager through counters().
struct PageStats {
  size_t pages_total = 0;        // pool capacity
  size_t pages_created = 0;      // physical pages committed now
  size_t pages_mapped = 0;       // distinct pages mapped in at least one reqid
  size_t pages_in_requests = 0;  // distinct pages mapped in at least one allocated reqid
  size_t pages_in_use = 0;       // distinct pages referenced (mapped, or held by a prefix handle)
  size_t page_mappings = 0;  // page-sized mappings (a shared page counts once per reqid)
  size_t pages_mapped_peak = 0;
  size_t pages_free_low = 0;     // low-water mark of pages not in use
  size_t pages_orphaned = 0;     // pages kept mapped after a failed unmap, retried later
  size_t reqids_allocated = 0;
  size_t tokens_active = 0;      // sum of allocated reqids' last stepped lengths
  size_t prefix_handles = 0;     // live prefix handles
  uint64_t step_calls = 0;       // caller
  uint64_t failed_steps = 0;     // caller: steps that returned false (not enough pages)
  uint64_t sync_page_maps = 0;   // caller: pages mapped on the caller's thread (step, fork, map_pages)
  uint64_t background_page_maps = 0;  // caller
  uint64_t page_unmaps = 0;
  uint64_t reclaimed_pages = 0;  // caller: pages returned to the pool from free reqids (any path)
  uint64_t background_reclaimed_pages = 0;  // caller
  uint64_t forks = 0;            // caller
  uint64_t pages_copied = 0;     // caller: fork's copies of partial pages
  uint64_t mapper_wakeups = 0;   // caller: times the mapper woke to plan work
  uint64_t mapper_rounds = 0;   // caller
  uint64_t mapper_errors = 0;    // caller
  uint64_t step_wait_ns = 0;     // caller: time steps spent waiting for an in-flight mapper round
  uint64_t pages_released = 0;   // caller: created pages released again (given back to a budget)
  uint64_t pages_release_failed = 0;  // caller: releases the driver or OS refused (the memory stayed)
  // caller: pages whose release failed, still held: their ids stay uncreated in
  // the table and charged to the budget until created again (which reuses them)
  size_t pages_unreleased = 0;
  uint64_t creations_refused = 0;  // caller: page creations a budget refused or the device had no memory for
  // Times a reqid lost positions or was released: while it stands still, every
  // check that a batch's rows are mapped still holds (kernels check it per layer).
  uint64_t shrinks = 0;
};

// Positions [from, from + ids.size()) of `reqid`, cut from its prefix: their
// mapping references stay until the caller reports them unmapped.
struct Cut {
  size_t reqid;
  size_t from;
  std::vector<uint32_t> ids;
};

// A position of `reqid` whose addresses `addrs` are still mapped.
struct Orphan {
  size_t reqid;
  size_t pos;
  uint32_t id;
  std::vector<uintptr_t> addrs;
};

class PageTable {
 public:
  static constexpr uint32_t kHole = UINT32_MAX;  // a position of a prefix that maps nothing

  // Every reqid free and empty; managed ids all uncreated, handed out smallest first.
  PageTable(size_t num_reqids, size_t num_buffers, size_t num_ids, bool external_ids);

  size_t num_reqids() const { return reqid_page_ids_.size(); }
  size_t num_buffers() const { return num_buffers_; }
  size_t num_ids() const { return id_maps_.size(); }
  bool external_ids() const { return external_ids_; }

  // ---- reqids ----
  const std::vector<uint32_t>& ids(size_t reqid) const { return reqid_page_ids_[reqid]; }
  size_t mapped(size_t reqid) const { return reqid_page_ids_[reqid].size(); }  // positions in the prefix, holes included
  bool allocated(size_t reqid) const { return reqid_allocated_[reqid] != 0; }
  int64_t tokens(size_t reqid) const { return reqid_tokens_[reqid]; }  // last stepped length
  size_t orphans_of(size_t reqid) const { return reqid_orphans_[reqid]; }
  // The first position whose id has another reference (a reqid's position or
  // a handle): from there on, the reqid does not own its pages alone.
  size_t first_shared(size_t reqid) const;
  // Marks a free reqid allocated with 0 tokens.
  void allocate(size_t reqid);
  // Marks an allocated reqid free with 0 tokens. Its positions stay
  // (deferred reclaim).
  void release(size_t reqid);
  // Inline and nothing else: step() sets every active reqid's length on its
  // fast path (tokens_active is summed when stats() is read).
  void set_tokens(size_t reqid, int64_t tokens) { reqid_tokens_[reqid] = tokens; }

  // ---- reference counts ----
  uint32_t maps(uint32_t id) const { return id_maps_[id]; }    // positions and orphans
  uint32_t holds(uint32_t id) const { return id_holds_[id]; }  // prefix handles (and pins)
  uint32_t refs(uint32_t id) const { return id_maps_[id] + id_holds_[id]; }
  bool created(uint32_t id) const { return id_created_[id] != 0; }
  // A hold outside any handle pins an id: its last mapping can go without
  // the id going back to the pool (a page moved between positions).
  void add_hold(uint32_t id);
  void drop_hold(uint32_t id);

  // ---- the pool (managed) ----
  size_t available() const { return free_ids_.size() + uncreated_.size(); }
  const std::vector<uint32_t>& free_ids() const { return free_ids_; }    // back() is handed out next
  const std::vector<uint32_t>& uncreated() const { return uncreated_; }  // back() is the smallest
  // Takes `count` ids out of the pool, in flight: free ones first (the most
  // recently freed, in the order they were freed), then uncreated ones
  // (smallest first), which are also appended to `to_create`. Caller checked
  // available() >= count.
  std::vector<uint32_t> claim(size_t count, std::vector<uint32_t>& to_create);
  // Takes up to `count` uncreated ids (smallest first), in flight, to create.
  std::vector<uint32_t> take_uncreated(size_t count);
  // In-flight ids back to the pool: created ones free, the others uncreated.
  // Ids that meanwhile got a reference (an orphan) stay where they are.
  void return_fresh(const std::vector<uint32_t>& ids);
  void mark_created(const std::vector<uint32_t>& ids);
  // Up to `count` ids of the free pool, the least recently freed first, are
  // uncreated again (their physical pages are to be released by the caller).
  std::vector<uint32_t> uncreate_free(size_t count);
  // External ids: those of ids[0, count) that are created and unreferenced
  // (no position, orphan or hold) are uncreated again, each once; returns
  // them (their physical pages are to be released by the caller).
  std::vector<uint32_t> uncreate_unreferenced(const uint32_t* ids, size_t count);
  // Created ids that no allocated reqid, prefix handle or orphan references:
  // the free pool and the ids only free reqids map (deferred reclaim, eager
  // pages). What a budget counts as free-held. O(num_ids + free reqids' positions).
  size_t idle_ids() const;
  // The distinct ids among ids[0, count) not created yet, in first-seen order.
  std::vector<uint32_t> uncreated_among(const uint32_t* ids, size_t count);

  // ---- positions ----
  // Positions mapped(reqid).. of `reqid` now hold `ids` (each gets a mapping reference).
  void append(size_t reqid, const std::vector<uint32_t>& ids);
  // Cuts positions [keep, mapped) of `reqid` out of its prefix into `cuts`
  // (nothing when keep >= mapped; one cut per run between holes); their
  // references stay until reported.
  void cut_tail(size_t reqid, size_t keep, std::vector<Cut>& cuts);
  // Positions [0, first) of `reqid` become holes: their ids go into `cuts`
  // (references stay until reported), and a prefix shorter than `first`
  // grows to it with holes. External ids only.
  void unmap_pages_below(size_t reqid, size_t first, std::vector<Cut>& cuts);
  // Whether positions [0, first) of `reqid` hold any page.
  bool maps_below(size_t reqid, size_t first) const;
  // Positions at the front of `reqid` that are holes (unmap_pages_below): holes only ever form a prefix
  // (check_invariants holds it), so a binary search finds the first mapped position.
  size_t leading_holes(size_t reqid) const;
  // `addrs` page-sized mappings went away (the unmap counters).
  void count_unmapped(size_t addrs);
  // Drops one mapping reference of `id` (a cut position fully unmapped).
  void drop_map_ref(uint32_t id);
  // A cut position that stays partly mapped: its mapping reference moves to the orphan.
  void keep_orphan(Orphan orphan);
  // A position mapped by a failed job that could not be undone: a new
  // mapping reference, held by the orphan.
  void add_orphan(Orphan orphan);
  const std::vector<Orphan>& orphans() const { return orphans_; }
  // The first `done` addresses of orphans()[k] were unmapped. Returns true
  // when none is left: the orphan and its reference are gone (later orphans
  // move down by one).
  bool settle_orphan(size_t k, size_t done);

  // ---- prefix handles ----
  // A new handle holding `ids`; returns its id (1, 2, ...).
  uint64_t retain(std::vector<uint32_t> ids);
  // Drops a handle's holds; false when it was released already.
  bool release_handle(uint64_t handle);
  // The handle's ids, or null when it was released.
  const std::vector<uint32_t>* handle_ids(uint64_t handle) const;
  void release_all_handles();

  // Forgets every reqid, orphan and pooled id and zeroes the occupancy
  // counters: the manager closed (it listed what was mapped first) and uses
  // the table no more.
  void clear();

  // The counters now; tokens_active is the sum of the reqids' tokens (a free
  // reqid holds 0).
  PageStats stats() const;
  // The counters the caller bumps (the event counters).
  PageStats& counters() { return stats_; }
  // stats().shrinks, read without the manager's lock: the kernels' mapping check reads it per layer, and a
  // reader that waited for the lock (a step mapping pages holds it for milliseconds) would stall its forward.
  uint64_t shrinks() const { return shrinks_.load(std::memory_order_acquire); }

  // Checks every invariant: reference counts against the positions, orphans
  // and handles; each managed id in exactly one place; the occupancy
  // counters. Returns the first violation, or "". Ids in flight count as
  // violations: call it between operations.
  std::string check_invariants() const;

 private:
  void add_map_ref(uint32_t id);
  void release_if_unreferenced(uint32_t id);
  // A position of an allocated reqid starts or stops mapping `id`.
  void add_request_ref(uint32_t id);
  void drop_request_ref(uint32_t id);
  // Positions [from, to) of `reqid` leave it: their request references go when it is allocated.
  void drop_request_refs(size_t reqid, size_t from, size_t to);
  // Runs of ids (holes skipped) among positions [from, to) of `reqid`, as cuts.
  void cut_runs(size_t reqid, size_t from, size_t to, std::vector<Cut>& cuts) const;
  void note_in_use();
  void note_shrink() { shrinks_.store(++stats_.shrinks, std::memory_order_release); }

  const size_t num_buffers_;
  const bool external_ids_;
  std::vector<std::vector<uint32_t>> reqid_page_ids_;  // page id at each mapped position of each reqid
  std::vector<uint8_t> reqid_allocated_;
  std::vector<int64_t> reqid_tokens_;  // last stepped length per reqid
  std::vector<uint32_t> reqid_orphans_;  // orphans per reqid
  std::vector<uint32_t> id_maps_;     // mappings of each page id (reqid positions and orphans)
  std::vector<uint32_t> id_holds_;    // prefix-handle references of each page id
  std::vector<uint32_t> id_request_maps_;  // positions of allocated reqids that map each page id
  std::vector<uint8_t> id_created_;
  std::vector<uint32_t> free_ids_;    // created, unreferenced ids (managed)
  std::vector<uint32_t> uncreated_;   // ids never created (managed); back() is the smallest
  std::vector<Orphan> orphans_;
  std::map<uint64_t, std::vector<uint32_t>> handles_;
  uint64_t next_handle_ = 1;
  PageStats stats_;
  std::atomic<uint64_t> shrinks_{0};  // stats_.shrinks, published for shrinks()
};

}  // namespace vattn
