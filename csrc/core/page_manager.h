// The page manager of one KV cache: the lock, the background mapper thread
// and every driver call, over a page table (core/page_table.h) that records
// and a policy (core/policy.h) that decides. Knows reqids and pages only; the
// Python manager above it knows layers, dtypes and tensors. docs/design.md
// describes the layers, the address layout, sharing and the failure contract.
//
// Address layout. One reservation holds every buffer:
//
//   base + b * buffer_bytes + r * slice_bytes + p * page_size
//          ^ buffer b         ^ reqid r's slice  ^ page position p of that slice
//
// Page id r is physical page b * num_ids + r of the backend's pool in buffer
// b, so consecutive ids are consecutive pages of one buffer and the host can
// merge their mappings.
//
// Failures. Backends report how far a map or unmap got, so the table always
// describes exactly what is mapped; what could not be unmapped is kept as an
// orphan, retried before anything is mapped into its reqid, by reclaim and at
// close.
//
// Locking discipline
// ------------------
// One mutex, mu, guards the table and every member below it in the class.
// Driver calls made by the caller's thread run with mu held. The mapper thread
// plans under mu, runs its driver calls WITHOUT mu (so a step on the fast path
// never waits for the driver), then commits under mu. Between plan and commit
// the round is "in flight" (inflight_ is true):
//   * Its fresh pages were taken out of the pool under mu, so no other thread
//     can map them: a page is never handed out twice.
//   * Its target addresses lie past the committed prefix of their reqids, and a
//     reclaim round's positions were already cut from their reqid's prefix. Any
//     call that would map or unmap addresses first waits on round_done until
//     inflight_ is false, so no two threads touch one address; after the wait
//     it checks again that the manager is open and the input still valid.
//   * The mapper only unmaps pages of free (unallocated) reqids, after the
//     device finished the reads queued before each reqid was freed (a read
//     fence recorded by free_reqid, see VmmBackend::record_reads), so a page
//     in use is never unmapped. Callers' unmaps wait the same way; pages of
//     an allocated reqid wait for all work queued so far.
//   * A failed round is rolled back at commit (fresh pages back to the pool,
//     what could not be undone kept as orphans) and its error is kept until
//     the next step() raises it: no page is lost and no error is dropped.
// There is one mapper thread per manager, started in the constructor and joined
// by close(); it sleeps on `wake` until step/alloc/free/reclaim give it work.
//
// fork(): a manager belongs to the process that created it. In a child every
// call raises ForkedError before touching a lock (the mutex may have been held
// by a thread that does not exist there), and the destructor leaks the
// synchronisation objects and the thread handle instead of joining a thread
// that is not there.
//
// Budget. A manager may hold a share of a machine-wide budget (core/
// page_budget.h): every page creation is charged first, every release
// uncharged after. One path says "no pages can be created now": create_ids
// throws OutOfPages when the budget refuses or the device (host) is out of
// memory, and step() returns false for it, fork() and map_pages() raise it, the
// mapper stops creating until new work comes. A keeper thread (only with a
// budget) gives free pages back: all of them after idle_release_s without a
// step, and as many as others wait for or a lowered limit asks.
//
// The member functions live in five files: page_manager.cpp (lifetime, reqids,
// step, queries), page_manager_sharing.cpp (fork, prefix handles, map_pages,
// unmap_pages), page_manager_driver.cpp (create, map and unmap on the caller's
// thread), page_manager_mapper.cpp (the background mapper) and
// page_manager_budget.cpp (preallocation, giving pages back, the keeper).
#pragma once

#include <chrono>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backends/vmm_backend.h"
#include "core/page_budget.h"
#include "core/page_geometry.h"
#include "core/page_table.h"
#include "core/policy.h"

namespace vattn {

struct PageManagerConfig {
  size_t num_buffers = 0;      // K and V buffers: 2 * layers (per_layer) or 2 (all_layers)
  size_t num_reqids = 0;        // max concurrent requests (B)
  size_t slice_bytes = 0;       // bytes per reqid per buffer, a multiple of page_size (S_req)
  size_t bytes_per_token = 0;  // bytes one token takes in one buffer (S_tok)
  size_t max_tokens = 0;       // max context length in tokens (L)
  bool external_ids = false;   // page ids are owned by the caller (core/page_table.h)
  bool preallocate = false;    // create every page at construction and keep them until close
};

// A manager's place in a machine-wide budget (budget/budget.h).
struct BudgetLink {
  std::shared_ptr<BudgetMember> member;  // null: no budget
  double idle_release_s = 0;             // free pages go back after this long without a step; 0: never
};

// What a manager holds of its budget now. Bytes.
struct BudgetShare {
  std::string budget;            // the budget's name ("" without one)
  uint64_t held_bytes = 0;       // charged: every created page
  uint64_t in_use_bytes = 0;     // of held: pages under requests, prefix handles or orphans
  uint64_t free_held_bytes = 0;  // of held: free pages kept for reuse
  std::string detached;          // why the cache went on without its budget ("" while it draws from it)
};

// One mapping the table believes exists (for tests and diagnostics).
struct TableEntry {
  uintptr_t addr;
  uint32_t page;  // physical page of the backend pool
};

class PageManager {
 public:
  // Throws OutOfPages when preallocate cannot create the pool (the budget
  // refuses it, or the device has no memory for it).
  PageManager(std::shared_ptr<VmmBackend> backend, const PageManagerConfig& config,
              const PolicyConfig& policy, const BudgetLink& budget = BudgetLink{});
  ~PageManager();  // close(), errors swallowed; leaks the thread handle in a forked child
  PageManager(const PageManager&) = delete;
  PageManager& operator=(const PageManager&) = delete;

  // Returns a free reqid: the one whose mapped pages fit best (most pages when
  // prompt_tokens < 0; else the smallest that covers prompt_tokens, else the
  // largest), or wanted_reqid when >= 0, after unmapping its pages beyond
  // prompt_tokens. Positions from the first page shared with another reqid or a
  // handle on are unmapped before the reqid is handed out (its new request
  // writes there). Throws OutOfReqids when none is free.
  int64_t alloc_reqid(int64_t prompt_tokens, int64_t wanted_reqid = -1);
  // Marks a reqid free. Its pages stay mapped (deferred_reclaim) or are
  // unmapped now; a DriverError then means some stay mapped, retried later.
  void free_reqid(int64_t reqid);
  // Maps pages so every allocated reqid s holds seq_lens[s] tokens. Returns
  // false, changing no active reqid, when the pool cannot supply the pages even
  // after unmapping pages of free reqids, or the pages cannot be created now
  // (the budget refuses them, the device is out of memory). Throws std::invalid_argument on bad
  // input (nothing changed), DriverError on driver failure (no new mapping
  // kept), and a mapper error held since the last step.
  bool step(const int64_t* seq_lens, size_t count);
  // Unmaps pages of free reqids (tails first) until up to max_ids page ids went
  // back to the pool, and retries orphans; returns the physical pages freed.
  size_t reclaim(size_t max_ids);
  // Deferred reclamation of freed reqids, in either mode: unmaps every
  // position of the free reqids whose read fence has passed (asked without
  // waiting: no device wait on the caller's thread), or, with `wait`, of
  // every free reqid (waiting for its readers). Returns the positions
  // unmapped (per buffer) and the free reqids that still map pages.
  std::pair<size_t, size_t> reclaim_freed(bool wait);
  // Releases up to max_ids free page ids (the free pool first, then pages of
  // free reqids, unmapped), giving their memory back to the OS or device and
  // to the budget; returns the physical pages released. Pages under
  // requests and prefix handles stay. Throws std::invalid_argument with
  // external ids (their pages keep their contents).
  size_t release_free(size_t max_ids);
  // External ids only: releases the pages of those of ids[0, n) that are
  // created and that no reqid position, orphan or hold references, giving
  // their memory back to the OS or device and to the budget; a later
  // map_pages creates (and charges) them again, their contents gone. Returns
  // the ids released; referenced or uncreated ids are left as they are.
  // Throws std::invalid_argument for a managed manager or an id out of range
  // (nothing released).
  std::vector<uint32_t> release_external(const uint32_t* ids, size_t n);
  // The budget share now (an empty name without a budget).
  BudgetShare budget_share() const;
  // In a budget, after a step refused for want of the budget's memory: blocks
  // (no CPU) until memory may have come free there (another member released
  // pages, left or died, the limit changed) or `timeout_s` seconds pass.
  // Returns whether it did; false at once without a budget.
  bool wait_for_budget(double timeout_s);

  // ---- shared pages ----
  // A new reqid whose first num_tokens tokens are src's: whole pages shared,
  // the rest copied into fresh pages. Throws OutOfReqids / OutOfPages with
  // nothing changed when no reqid or page is left.
  int64_t fork(int64_t src, int64_t num_tokens);
  // References the whole pages holding src's first num_tokens tokens (rounded
  // down to a page boundary that is also a token boundary). Returns (handle
  // id, tokens covered).
  std::pair<uint64_t, int64_t> retain_prefix(int64_t reqid, int64_t num_tokens);
  // Maps a handle's pages at positions 0.. of an allocated reqid that holds no
  // tokens yet; returns the tokens now present.
  int64_t attach_prefix(uint64_t handle, int64_t reqid);
  void release_prefix(uint64_t handle);
  std::vector<uint32_t> prefix_ids(uint64_t handle) const;
  // The page-table primitive. For each i: page ids ids[offsets[i] ..
  // offsets[i+1]) go to positions starts[i].. of reqids[i]; starts[i] may not
  // pass the reqid's mapped prefix. Positions that already hold the same id are
  // left alone; from the first one that differs, the reqid's old mapping is
  // unmapped and the new ids are mapped. Managed ids must already be
  // referenced; their new references are taken before the old positions are
  // cut, so an id may move within a reqid or between reqids (a swap). External
  // ids are any in [0, num_ids).
  void map_pages(const int64_t* reqids, const int64_t* starts, const int64_t* offsets, size_t count,
               const uint32_t* ids, size_t num_ids_given);
  // For each i: unmaps positions from keep[i] on of reqids[i].
  void unmap_pages(const int64_t* reqids, const int64_t* keep, size_t count);
  // For each i: positions [0, first[i]) of reqids[i] become holes (unmapped,
  // addresses kept; a shorter prefix grows to first[i] with holes), so map_pages
  // may start at first[i]. External ids only: a sliding window's front.
  void unmap_pages_below(const int64_t* reqids, const int64_t* first, size_t count);
  std::vector<uint32_t> reqid_page_ids(int64_t reqid) const;

  // Stops the mapper, releases prefix handles, hands every mapping to the
  // cache memory (unmapped when the last tensor view goes, now if none) and
  // drops this manager's hold on it. Idempotent; every other call afterwards
  // throws ClosedError.
  void close();
  // Blocks until the mapper has nothing left to do (tests and benchmarks).
  void wait_idle();
  // paused = true: waits for the mapper's round in flight and keeps it from
  // starting another until pause_mapper(false) (a CUDA graph capture); throws
  // std::logic_error when already paused.
  void pause_mapper(bool paused);
  // A CUDA graph capture in this process began (true) or ended (false):
  // counted, so captures may nest and overlap graph_capture(). While any is
  // in progress neither the mapper nor the keeper starts driver work (their
  // work waits, it does not fail); beginning waits for the mapper's round in
  // flight and the keeper's release under way.
  void pause_for_capture(bool begin);
  // Throws ForkedError / ClosedError unless the manager can act.
  void check_usable() const;

  bool closed() const;
  size_t mapped_pages(int64_t reqid) const;  // positions (pages per buffer) mapped in reqid
  size_t backed_pages(int64_t reqid) const;  // of those, the ones with a page behind (not a window's holes)
  bool reqid_allocated(int64_t reqid) const;
  // Whether the device is done with a free reqid's last reads (its fence
  // passed; asked without waiting), so unmapping its pages waits for
  // nothing. An allocated reqid is still read: false.
  bool reads_done(int64_t reqid) const;
  // Throws std::invalid_argument (message prefixed with `what`) unless every
  // reqids[i] is allocated and rows [firsts[i], tokens[i]) are mapped in every
  // buffer (firsts null: from row 0): what an attention kernel checks before it
  // reads them. Rows below a slice's holes (unmap_pages_below) are unmapped:
  // only a sliding window that starts above them may read the slice. One lock
  // for the whole batch.
  void check_mapped(const int64_t* reqids, const int64_t* tokens, size_t count, const std::string& what,
                    const int64_t* firsts = nullptr) const;
  PageStats stats() const;
  // stats().shrinks without the lock (one atomic read; close() counts as one): the kernels' per-layer
  // mapping check asks the core again only when it moved.
  uint64_t shrinks() const;
  // Every mapping the table holds, orphans included.
  std::vector<TableEntry> table() const;
  // Waits for the mapper's round, then checks every bookkeeping invariant
  // (reference counts against the table, each id in exactly one place: a
  // reqid, a handle, the pool, the uncreated list; the counters). Returns the
  // first violation, or "" (tests).
  std::string check_invariants();
  const PageManagerConfig& config() const { return config_; }
  const PolicyConfig& policy() const { return policy_; }
  size_t page_size() const { return page_size_; }
  size_t num_ids() const { return num_ids_; }
  size_t buffer_bytes() const { return config_.num_reqids * config_.slice_bytes; }
  std::shared_ptr<CacheMemory> memory() const;
  VmmBackend& backend() const { return *backend_; }

 private:
  using Lock = std::unique_lock<std::mutex>;
  static constexpr uint32_t kNoId = UINT32_MAX;
  using ReqidKeep = std::pair<size_t, size_t>;  // (reqid, positions kept)

  // Positions [from, from + ids.size()) of `reqid` get `ids`.
  struct MapJob {
    size_t reqid;
    size_t from;
    std::vector<uint32_t> ids;
    size_t fresh = 0;  // the last `fresh` ids came out of the pool for this job
  };
  // A unit of mapper work: map jobs, or cuts to unmap, or pages to create
  // into the pool (creation, the driver's slowest call, off the critical path).
  struct Round {
    std::vector<MapJob> jobs;
    std::vector<PageMapping> mappings;
    std::vector<uint32_t> to_create;  // ids to create before mapping (or into the pool)
    std::vector<Cut> cuts;
    std::vector<uintptr_t> unmap_addrs;
    bool created = false;  // run_round created to_create
    uint64_t reads = VmmBackend::kNoReads;  // the read fence to wait for before unmapping the cuts
    bool empty() const { return jobs.empty() && to_create.empty() && cuts.empty(); }
  };
  // Synchronisation objects live on the heap so a forked child can leak them
  // (a condition variable with waiters from the parent cannot be destroyed).
  struct Sync {
    std::mutex close_mu;            // serializes close() (joining the mapper twice is undefined)
    std::mutex mu;                  // guards the manager's state
    std::condition_variable wake;        // mapper: work may have changed, or stop
    std::condition_variable round_done;  // waiters: inflight_ became false
    std::thread mapper;
    std::condition_variable keeper_wake;  // keeper: stop
    std::thread keeper;                   // only with a budget
  };

  static std::string range_text(int64_t lo, int64_t hi);
  static uint64_t steady_ns() {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count());
  }
  bool forked() const { return fork_generation() != generation_; }
  // Throws ForkedError in a forked child; takes no lock. Inline: every call starts with it.
  void check_process() const {
    if (forked()) throw_forked();
  }
  [[noreturn]] static void throw_forked();
  void check_open() const;     // caller holds mu
  void check_reqid(int64_t reqid, const char* what) const;
  void check_allocated(int64_t reqid, const char* what) const;
  // read(slice) under the lock, once the process, the cache and the reqid are checked: one reqid's reads.
  template <typename Read>
  auto read_reqid(int64_t reqid, const char* what, Read read) const {
    check_process();
    Lock lock(sync_->mu);
    check_open();
    check_reqid(reqid, what);
    return read(static_cast<size_t>(reqid));
  }
  uintptr_t address(size_t buffer, size_t reqid, size_t pos) const {
    return base_ + buffer * buffer_bytes() + reqid * config_.slice_bytes + pos * page_size_;
  }
  uint32_t physical(size_t buffer, uint32_t id) const {
    return static_cast<uint32_t>(buffer * num_ids_ + id);
  }
  void wait_for_round(Lock& lock);  // then check_open()
  // Neither the mapper nor the keeper may start driver work (caller holds mu):
  // graph_capture(), or a CUDA graph capture anywhere in the process.
  bool background_paused() const { return paused_ || capture_pauses_ > 0; }

  // ---- driver work on the caller's thread (caller holds mu) ----
  // Creates the pages of `ids` in every buffer, charged to the budget first.
  // Throws OutOfPages when no pages can be created now (the budget refuses,
  // the device is out of memory): nothing created, nothing charged. `demand`:
  // a caller needs them now (a refusal is recorded as a wait, and counted:
  // the caller holds mu). The mapper calls it without mu and demand false.
  void create_ids(const std::vector<uint32_t>& ids, bool demand);
  // Backend release, then uncharge the ids whose pages all went back. An id
  // with a page whose release failed stays uncreated in the table (its
  // contents count as gone) but charged: its pages still hold memory, which
  // the next create_ids of it reuses without a second charge.
  void release_ids(const std::vector<uint32_t>& ids);
  // Releases again the ids whose release was refused or deferred (a capture's
  // closed gate queues releases until it opens): once the gate is open their
  // memory is back, and the budget and stats say so. Caller holds mu.
  void retry_unreleased_locked();
  std::vector<PageMapping> mappings_for(const std::vector<MapJob>& jobs) const;
  // Commits the jobs covered by the first `done` mappings, undoes the rest
  // (orphaning what cannot be undone), returns fresh ids to the pool.
  void finish_map(std::vector<MapJob>& jobs, const std::vector<PageMapping>& mappings, size_t done,
                  bool background);
  // Creates `to_create` (ids the jobs claimed from the uncreated pool), then
  // maps the jobs on this thread; throws DriverError with the table exact.
  // `populate`: their page-table entries are made now (VmmBackend::populate),
  // for pages the caller writes at once (map_pages).
  void map_jobs_locked(std::vector<MapJob>& jobs, std::vector<uint32_t>& to_create, bool populate = false);
  std::vector<uintptr_t> addresses_of(const std::vector<Cut>& cuts) const;
  // Drops the references of positions whose every address is among the first
  // `done` of `addrs`; the rest become orphans.
  void finish_unmap(std::vector<Cut>& cuts, const std::vector<uintptr_t>& addrs, size_t done);
  // The read fence to wait for before unmapping pages of these reqids: the one
  // recorded when a free reqid was freed, "now" for an allocated reqid.
  uint64_t reads_of(size_t reqid) const;
  // Waits for the reqids' reads, then unmaps the cut positions on this thread.
  // A failed wait changes nothing; a failed unmap leaves orphans. Throws.
  void unmap_tails_locked(const std::vector<ReqidKeep>& reqid_keep);
  // Unmaps positions cut from the table (their reads waited for); a failed
  // unmap leaves orphans. Throws.
  void unmap_cuts_locked(std::vector<Cut>& cuts);
  // Retries unmapping orphans (of `reqid`, or all when reqid < 0). Throws the
  // first failure after trying all.
  void settle_orphans_locked(int64_t reqid);
  // Unmaps free reqids' tails (never keep_reqid) until up to `want` ids went
  // back to the pool; returns how many did.
  size_t reclaim_locked(size_t want, int64_t keep_reqid);
  void trim_for_new_request_locked(size_t reqid, size_t keep);

  // ---- the budget (page_manager_budget.cpp) ----
  void preallocate();  // constructor: every page created, into the pool
  // Releases up to `want` free ids, reclaiming free reqids' pages for more;
  // returns the ids released. Waits for the mapper's round.
  size_t shed_locked(Lock& lock, size_t want);
  bool has_idle_pages_locked() const;
  // What the mapper may create now (caller holds mu).
  MapperLimits mapper_limits() const;
  BudgetShare budget_share_locked() const;
  void keeper_loop();  // the budget's keeper thread: idle release, pressure, reports
  void keeper_tick(Lock& lock);

  // ---- the background mapper ----
  void mapper_loop();
  Round plan_round();                                         // caller holds mu
  void run_round(Round& round, size_t* done);                 // without mu; throws
  void commit_round(Round& round, size_t done, std::exception_ptr error);  // caller holds mu

  std::shared_ptr<VmmBackend> backend_;
  const PageManagerConfig config_;
  const PolicyConfig policy_;
  const size_t page_size_;
  const PageGeometry geometry_;
  const size_t num_ids_;              // page ids: backend pages / num_buffers
  const size_t reclaim_floor_ids_;    // reclaim_threshold * num_ids
  const uint64_t generation_;         // fork generation of the creating process
  std::unique_ptr<Sync> sync_;
  std::shared_ptr<PageBudget> budget_;  // null without a budget; the cache memory drops it at teardown
  const uint64_t idle_release_ns_;      // 0: no idle release

  // ---- guarded by sync_->mu ----
  PageTable table_;
  std::shared_ptr<CacheMemory> memory_;  // null once closed
  uintptr_t base_ = 0;
  std::vector<uint64_t> reqid_reads_;  // read fence recorded when each reqid was last freed
  bool inflight_ = false;             // a mapper round is between plan and commit
  bool stop_ = false;                 // mapper must exit
  bool paused_ = false;               // mapper starts no round (pause_mapper)
  bool mapper_idle_ = true;           // mapper waits for work
  uint64_t mapper_seen_epoch_ = 0;    // work_epoch_ the mapper last planned for
  uint64_t work_epoch_ = 0;           // bumped whenever the mapper's work may change
  std::exception_ptr mapper_error_;   // raised by the next step (also the keeper's errors)
  uint64_t refused_epoch_ = 0;        // work_epoch_ when the mapper's creation was refused (0: never)
  uint64_t last_step_ns_ = 0;         // steady clock of the last step (budget only)
  bool idle_released_ = false;        // idle past idle_release_s: free pages go back, no speculative ones until a step
  std::vector<uint64_t> reported_;    // what the keeper last reported (a signature of the state)
  size_t capture_pauses_ = 0;         // CUDA graph captures in progress (pause_for_capture)

  // Ids with a page whose release failed (still charged, still holding
  // memory); read by create_ids on the mapper thread without mu, written under
  // mu or by create_ids for its own in-flight ids: one id is never both.
  std::unique_ptr<std::atomic<uint8_t>[]> unreleased_;
  std::atomic<size_t> unreleased_ids_{0};
};

}  // namespace vattn
