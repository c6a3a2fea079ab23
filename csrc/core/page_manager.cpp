// PageManager: construction and lifetime, reqids, step, reclaim and the
// queries. The sharing operations, the driver work and the background mapper
// are in page_manager_sharing.cpp, page_manager_driver.cpp and
// page_manager_mapper.cpp.
#include "core/page_manager.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <string>

#include "common/errors.h"

namespace vattn {

namespace {

size_t checked_mul(size_t a, size_t b, const char* what) {
  size_t out = 0;
  if (__builtin_mul_overflow(a, b, &out))
    throw std::invalid_argument(std::string(what) + " overflows 64-bit arithmetic");
  return out;
}

const PolicyConfig& checked_policy(const PolicyConfig& p, size_t max_tokens) {
  validate_policy(p, max_tokens);
  return p;
}

// Validates the configuration against the backend's pool; returns the number
// of page ids (backend pages / num_buffers).
size_t checked_num_ids(const VmmBackend& backend, const PageManagerConfig& config, uint32_t no_id) {
  const size_t nb = config.num_buffers, page_size = backend.page_size();
  const size_t num_ids = nb ? backend.num_pages() / nb : 0;
  if (nb == 0 || config.num_reqids == 0 || config.bytes_per_token == 0 || config.max_tokens == 0)
    throw std::invalid_argument("PageManager: num_buffers, num_reqids, bytes_per_token and "
                                "max_tokens must all be positive");
  if (config.max_tokens > static_cast<size_t>(INT64_MAX))
    throw std::invalid_argument("max_context_len must be below 2^63");
  size_t token_bytes = checked_mul(config.max_tokens, config.bytes_per_token, "max_context_len x token bytes");
  if (config.slice_bytes == 0 || config.slice_bytes % page_size != 0 || config.slice_bytes < token_bytes)
    throw std::invalid_argument("PageManager: slice_bytes must be a multiple of page_size "
                                "covering max_tokens * bytes_per_token");
  if (num_ids == 0)
    throw std::invalid_argument("the physical pool must hold at least one page per buffer (" +
                                std::to_string(nb) + " pages)");
  if (num_ids >= no_id) throw std::invalid_argument("the physical pool holds too many pages");
  checked_mul(checked_mul(nb, config.num_reqids, "buffers x reqids"), config.slice_bytes, "reservation size");
  return num_ids;
}

uint64_t checked_idle_release_ns(double seconds) {
  if (!(seconds >= 0 && seconds <= 1e9))
    throw std::invalid_argument("idle_release_s must be in [0, 1e9] seconds (0: never)");
  return static_cast<uint64_t>(seconds * 1e9);
}

const char* kForked =
    "this KV cache manager was created by another process: a forked child cannot use its "
    "parent's cache (create a new manager in the child)";

}  // namespace

// ---- construction and lifetime ------------------------------------------------------

PageManager::PageManager(std::shared_ptr<VmmBackend> backend, const PageManagerConfig& config,
                         const PolicyConfig& policy, const BudgetLink& budget)
    : backend_(std::move(backend)),
      config_(config),
      policy_(checked_policy(policy, config.max_tokens)),
      page_size_(backend_->page_size()),
      geometry_{page_size_, config.bytes_per_token, config.max_tokens},
      num_ids_(checked_num_ids(*backend_, config, kNoId)),
      reclaim_floor_ids_(static_cast<size_t>(std::ceil(policy_.reclaim_threshold * static_cast<double>(num_ids_)))),
      generation_(fork_generation()),
      sync_(std::make_unique<Sync>()),
      idle_release_ns_(checked_idle_release_ns(budget.idle_release_s)),
      table_(config.num_reqids, config.num_buffers, num_ids_, config.external_ids) {
  memory_ = std::make_shared<CacheMemory>(backend_, config_.num_buffers * buffer_bytes());
  base_ = memory_->base();
  reqid_reads_.assign(config_.num_reqids, VmmBackend::kNoReads);
  unreleased_.reset(new std::atomic<uint8_t>[num_ids_]);
  for (size_t id = 0; id < num_ids_; ++id) unreleased_[id].store(0, std::memory_order_relaxed);
  if (budget.member) {
    budget_ = std::make_shared<PageBudget>(budget.member, static_cast<uint64_t>(page_size_) * config_.num_buffers);
    // The share ends with the pages: at teardown, which a tensor view may delay past close().
    memory_->on_teardown([b = budget_] { b->leave(); });
  }
  if (config_.preallocate) preallocate();  // before any thread: a failure destroys nothing running
  work_epoch_ = 1;  // the mapper starts with work: the eager reqid
  last_step_ns_ = steady_ns();
  if (policy_.background && !config_.external_ids)
    sync_->mapper = std::thread(&PageManager::mapper_loop, this);
  if (budget_) sync_->keeper = std::thread(&PageManager::keeper_loop, this);
}

PageManager::~PageManager() {
  if (forked()) {
    // The mapper and any waiter lived in the parent: leak the thread handle
    // and the condition variables rather than join or destroy them here.
    sync_.release();
    return;
  }
  try {
    close();
  } catch (...) {
    // Destructors never throw; close() released what it could.
  }
}

std::string PageManager::range_text(int64_t lo, int64_t hi) {
  return "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}

void PageManager::throw_forked() { throw ForkedError(kForked); }

void PageManager::check_open() const {
  if (!memory_) throw ClosedError("the KV cache manager was cleaned up; create a new one");
}

void PageManager::check_usable() const {
  check_process();
  Lock lock(sync_->mu);
  check_open();
}

void PageManager::check_reqid(int64_t reqid, const char* what) const {
  if (reqid < 0 || reqid >= static_cast<int64_t>(config_.num_reqids))
    throw std::invalid_argument(std::string(what) + ": reqid must be in " +
                                range_text(0, config_.num_reqids - 1) + ", got " + std::to_string(reqid));
}

void PageManager::check_allocated(int64_t reqid, const char* what) const {
  check_reqid(reqid, what);
  if (!table_.allocated(reqid))
    throw std::invalid_argument(std::string(what) + ": reqid " + std::to_string(reqid) +
                                " is not allocated (freed, or never returned by alloc_reqid)");
}

void PageManager::wait_for_round(Lock& lock) {
  sync_->round_done.wait(lock, [&] { return !inflight_; });
  check_open();  // cleanup() may have run while this thread waited
}

// ---- reqids --------------------------------------------------------------------------

int64_t PageManager::alloc_reqid(int64_t prompt_tokens, int64_t wanted_reqid) {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  if (prompt_tokens > static_cast<int64_t>(config_.max_tokens))
    throw std::invalid_argument("alloc_reqid: prompt_len must be in " + range_text(0, config_.max_tokens) +
                                ", got " + std::to_string(prompt_tokens));
  int64_t reqid = -1;
  if (wanted_reqid >= 0) {  // the caller owns reqid numbering (a framework's block id)
    check_reqid(wanted_reqid, "alloc_reqid");
    auto check_free = [&] {
      if (table_.allocated(wanted_reqid))
        throw std::invalid_argument("alloc_reqid: reqid " + std::to_string(wanted_reqid) + " is already allocated");
    };
    check_free();
    // An eager round may be landing on this reqid: let it, then trim it.
    if (inflight_) {
      wait_for_round(lock);
      check_free();
    }
    reqid = wanted_reqid;
    // Such a caller counts pages by its own lengths: the reqid must not bring
    // more pages than the request's first tokens need.
    if (!config_.external_ids)
      trim_for_new_request_locked(reqid, geometry_.positions_for_tokens(std::max<int64_t>(prompt_tokens, 0)));
  } else {
    const int64_t want = prompt_tokens < 0 ? -1 : static_cast<int64_t>(geometry_.positions_for_tokens(prompt_tokens));
    while (true) {
      reqid = best_free_reqid(table_, want);
      if (reqid < 0 || config_.external_ids) break;
      const size_t s = static_cast<size_t>(reqid);
      if (table_.first_shared(s) >= table_.mapped(s) && table_.orphans_of(s) == 0) break;
      if (inflight_) {
        wait_for_round(lock);
        continue;  // the choice may have changed while waiting
      }
      trim_for_new_request_locked(s, table_.mapped(s));
      break;
    }
    if (reqid < 0)
      throw OutOfReqids("alloc_reqid: all " + std::to_string(config_.num_reqids) +
                       " reqids are in use (max_batch_size); free one with free_reqid");
  }
  table_.allocate(static_cast<size_t>(reqid));
  work_epoch_++;  // the eager target moved on
  sync_->wake.notify_one();
  return reqid;
}

void PageManager::free_reqid(int64_t reqid) {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  check_allocated(reqid, "free_reqid");
  const size_t s = static_cast<size_t>(reqid);
  table_.release(s);
  // Every kernel that reads this request's pages has been queued by now.
  reqid_reads_[s] = backend_->record_reads();
  work_epoch_++;
  sync_->wake.notify_one();
  if (policy_.deferred_reclaim || config_.external_ids || table_.mapped(s) == 0) return;
  // The request is over whatever happens below; a failed unmap leaves pages
  // mapped in the free reqid (or as orphans) to be retried.
  wait_for_round(lock);
  if (!table_.allocated(s)) unmap_tails_locked({{s, 0}});
}

// ---- step -------------------------------------------------------------------------------

bool PageManager::step(const int64_t* seq_lens, size_t count) {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  if (config_.external_ids)
    throw std::invalid_argument("step: this manager's page ids are owned by the caller "
                                "(page_allocator='external'); map them with map_pages");
  if (count != config_.num_reqids)
    throw std::invalid_argument("step: seq_lens must have max_batch_size = " + std::to_string(config_.num_reqids) +
                                " entries, got " + std::to_string(count));
  // Per-thread scratch: several threads may step at once, and a step can wait
  // (releasing the mutex) between computing and using it.
  thread_local std::vector<size_t> need;
  need.resize(count);
  size_t deficit = 0;  // page ids (positions) to map, all reqids together
  while (true) {
    // Validated after every wait too: another thread may have freed a reqid.
    deficit = 0;
    for (size_t s = 0; s < count; ++s) {
      int64_t len = seq_lens[s];
      if (len < 0 || len > static_cast<int64_t>(config_.max_tokens))
        throw std::invalid_argument("step: seq_lens[" + std::to_string(s) + "] must be in " +
                                    range_text(0, config_.max_tokens) + " (max_context_len), got " +
                                    std::to_string(len));
      if (len > 0 && !table_.allocated(s))
        throw std::invalid_argument("step: seq_lens[" + std::to_string(s) + "] = " + std::to_string(len) +
                                    " but reqid " + std::to_string(s) +
                                    " is not allocated (use 0 for inactive reqids)");
      need[s] = geometry_.positions_for_tokens(len);
      if (need[s] > table_.mapped(s)) deficit += need[s] - table_.mapped(s);
    }
    if (mapper_error_) {
      std::exception_ptr error = mapper_error_;
      mapper_error_ = nullptr;
      std::rethrow_exception(error);
    }
    if (deficit == 0 || !inflight_) break;
    // The round may be mapping exactly these pages: let it land, then look again.
    auto t0 = std::chrono::steady_clock::now();
    wait_for_round(lock);
    table_.counters().step_wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                                       std::chrono::steady_clock::now() - t0).count();
  }
  // A step that passed its checks is activity; one refused above changed nothing (not the idle clock either).
  if (budget_) {
    last_step_ns_ = steady_ns();
    if (idle_released_) {  // busy again: the mapper may run ahead again
      idle_released_ = false;
      work_epoch_++;
      sync_->wake.notify_one();
    }
  }
  PageStats& stats = table_.counters();
  stats.step_calls++;
  for (bool reclaimed_for_creation = false; deficit > 0;) {
    if (deficit > table_.available()) {
      // Orphans (addresses a failed unmap left mapped) hold their ids until an unmap succeeds; the plan
      // below only counts mapped positions, so retry them first. One that fails again stays an orphan,
      // as the table says; its error was raised when it was kept, and this step only needs what it frees.
      if (!table_.orphans().empty()) {
        try {
          settle_orphans_locked(-1);
        } catch (const std::exception&) {
        }
      }
      ReclaimPlan plan = plan_reclaim(table_, deficit - table_.available(), -1, SIZE_MAX);
      if (table_.available() + plan.freed_ids < deficit) {
        stats.failed_steps++;
        return false;
      }
      reclaim_locked(deficit - table_.available(), -1);  // last resort, on the critical path
    }
    // Addresses left mapped by an earlier failure are retried before anything
    // is claimed: a throw here must not strand claimed ids.
    for (size_t s = 0; s < count; ++s)
      if (need[s] > table_.mapped(s) && table_.orphans_of(s)) settle_orphans_locked(static_cast<int64_t>(s));
    std::vector<MapJob> jobs;
    std::vector<uint32_t> to_create;
    for (size_t s = 0; s < count; ++s) {
      if (need[s] <= table_.mapped(s)) continue;
      size_t add = need[s] - table_.mapped(s);
      jobs.push_back(MapJob{s, table_.mapped(s), table_.claim(add, to_create), add});
    }
    try {
      map_jobs_locked(jobs, to_create);
      break;
    } catch (const OutOfPages&) {
      // No page can be created now (the budget refused, the device is out of
      // memory) and nothing changed. Pages cached in free reqids stand in for
      // new ones, once; then the pool is full, as when it has no page left.
      if (!reclaimed_for_creation && reclaim_locked(to_create.size(), -1) > 0) {
        reclaimed_for_creation = true;
        continue;
      }
      stats.failed_steps++;
      return false;
    }
  }
  // The mapper is woken only when this step gave it work: the pool changed
  // (pages mapped here: reserve, eager and reclaim floor may need attention) or
  // some reqid's lookahead now reaches past its mapping. A decode step inside a
  // page does neither, and skips the wake-up.
  bool mapper_work = deficit > 0;
  for (size_t s = 0; s < count; ++s) {
    if (!table_.allocated(s)) continue;
    // A 0 means "not in this step", not "empty": threads may step disjoint reqids.
    if (seq_lens[s] > 0) table_.set_tokens(s, seq_lens[s]);
    if (table_.tokens(s) > 0 && lookahead_positions(table_, geometry_, policy_, s) > table_.mapped(s))
      mapper_work = true;
  }
  if (policy_.background && mapper_work) {
    work_epoch_++;
    sync_->wake.notify_one();
  }
  return true;
}

// ---- reclaim ----------------------------------------------------------------------------

size_t PageManager::reclaim(size_t max_ids) {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  wait_for_round(lock);
  const size_t before = table_.available();
  std::exception_ptr error;
  try {
    settle_orphans_locked(-1);
  } catch (...) {
    error = std::current_exception();
  }
  if (!error) {
    try {
      reclaim_locked(max_ids, -1);
    } catch (...) {
      error = std::current_exception();
    }
  }
  const size_t got = table_.available() - before;
  if (got > 0) {
    work_epoch_++;  // freed pages may let the mapper do what it had no room for
    sync_->wake.notify_one();
  }
  if (error) std::rethrow_exception(error);
  return got * config_.num_buffers;
}

std::pair<size_t, size_t> PageManager::reclaim_freed(bool wait) {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  wait_for_round(lock);
  std::vector<ReqidKeep> cuts;
  size_t pending = 0;
  for (size_t s = 0; s < config_.num_reqids; ++s) {
    if (table_.allocated(s) || table_.mapped(s) == 0) continue;
    if (wait || backend_->reads_done(reqid_reads_[s]))
      cuts.emplace_back(s, 0);
    else
      ++pending;
  }
  if (cuts.empty()) return {0, pending};
  const uint64_t before = table_.counters().page_unmaps;
  // Fences that passed are known done: the wait below returns without a driver call.
  unmap_tails_locked(cuts);
  work_epoch_++;
  sync_->wake.notify_one();
  for (auto [s, keep] : cuts) pending += table_.mapped(s) > keep;  // orphans left by a failed unmap
  return {(table_.counters().page_unmaps - before) / config_.num_buffers, pending};
}

// ---- lifetime -------------------------------------------------------------------------

void PageManager::close() {
  check_process();
  std::lock_guard<std::mutex> closing(sync_->close_mu);
  {
    Lock lock(sync_->mu);
    if (!memory_) return;
    stop_ = true;
  }
  sync_->wake.notify_all();
  sync_->keeper_wake.notify_all();
  if (sync_->mapper.joinable()) sync_->mapper.join();  // without mu: the mapper commits its round first
  if (sync_->keeper.joinable()) sync_->keeper.join();
  Lock lock(sync_->mu);
  table_.release_all_handles();
  std::vector<uintptr_t> mapped;
  for (size_t s = 0; s < config_.num_reqids; ++s)
    for (size_t b = 0; b < config_.num_buffers; ++b)
      for (size_t p = 0; p < table_.mapped(s); ++p)
        if (table_.ids(s)[p] != PageTable::kHole) mapped.push_back(address(b, s, p));
  for (const Orphan& o : table_.orphans()) mapped.insert(mapped.end(), o.addrs.begin(), o.addrs.end());
  table_.clear();
  memory_->hand_over(std::move(mapped));
  std::shared_ptr<CacheMemory> memory = std::move(memory_);  // memory_ null: closed
  lock.unlock();
  // No tensor view left: tear down now and report errors. Otherwise the last
  // view's deleter does it (views cannot be created any more, so the count
  // only falls).
  if (memory.use_count() == 1) memory->teardown();
}

// ---- queries ----------------------------------------------------------------------------

bool PageManager::closed() const {
  if (forked()) return true;
  Lock lock(sync_->mu);
  return !memory_;
}

size_t PageManager::mapped_pages(int64_t reqid) const {
  return read_reqid(reqid, "mapped_pages", [&](size_t s) { return table_.mapped(s); });
}

size_t PageManager::backed_pages(int64_t reqid) const {
  return read_reqid(reqid, "mapped_bytes", [&](size_t s) { return table_.mapped(s) - table_.leading_holes(s); });
}

bool PageManager::reqid_allocated(int64_t reqid) const {
  return read_reqid(reqid, "is_allocated", [&](size_t s) { return table_.allocated(s); });
}

bool PageManager::reads_done(int64_t reqid) const {
  return read_reqid(reqid, "reads_done",
                    [&](size_t s) { return !table_.allocated(s) && backend_->reads_done(reqid_reads_[s]); });
}

void PageManager::check_mapped(const int64_t* reqids, const int64_t* tokens, size_t count, const std::string& what,
                               const int64_t* firsts) const {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  for (size_t i = 0; i < count; ++i) {
    check_allocated(reqids[i], what.c_str());
    const size_t s = static_cast<size_t>(reqids[i]);
    const int64_t mapped = geometry_.tokens_in_positions(table_.mapped(s));
    if (tokens[i] < 0)  // tokens = seq_lens + the view's first token: below 0 only for a negative seq_lens
      throw std::invalid_argument(what + ": reqid " + std::to_string(reqids[i]) + " would read " +
                                  std::to_string(tokens[i]) + " tokens: seq_lens must be at least 0");
    if (tokens[i] > mapped)
      throw std::invalid_argument(what + ": reqid " + std::to_string(reqids[i]) + " would read " +
                                  std::to_string(tokens[i]) + " tokens but has " + std::to_string(mapped) +
                                  " mapped (step() it to at least " + std::to_string(tokens[i]) +
                                  " tokens before attending)");
    const int64_t first = firsts ? firsts[i] : 0;
    const int64_t unmapped_below = geometry_.tokens_in_positions(table_.leading_holes(s));  // rows of the holes
    if (tokens[i] > first && first < unmapped_below)
      throw std::invalid_argument(what + ": reqid " + std::to_string(reqids[i]) + " would read rows from " +
                                  std::to_string(first) + " on, but its rows below " +
                                  std::to_string(unmapped_below) +
                                  " are unmapped (unmap_pages_below): only a sliding window that starts at or "
                                  "above them may read this request");
  }
}

PageStats PageManager::stats() const {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  PageStats out = table_.stats();
  out.pages_unreleased = unreleased_ids_.load() * config_.num_buffers;
  return out;
}

uint64_t PageManager::shrinks() const {
  check_process();
  return table_.shrinks();
}

std::vector<TableEntry> PageManager::table() const {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  std::vector<TableEntry> out;
  for (size_t s = 0; s < config_.num_reqids; ++s)
    for (size_t b = 0; b < config_.num_buffers; ++b)
      for (size_t p = 0; p < table_.mapped(s); ++p)
        if (table_.ids(s)[p] != PageTable::kHole)
          out.push_back(TableEntry{address(b, s, p), physical(b, table_.ids(s)[p])});
  for (const Orphan& o : table_.orphans())
    for (uintptr_t a : o.addrs) {
      size_t b = (a - base_) / buffer_bytes();
      out.push_back(TableEntry{a, physical(b, o.id)});
    }
  return out;
}

std::string PageManager::check_invariants() {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  sync_->round_done.wait(lock, [&] { return !inflight_; });
  std::string problem = table_.check_invariants();
  const size_t created_ids = table_.stats().pages_created / config_.num_buffers;
  const size_t unreleased = unreleased_ids_.load();  // uncreated in the table, their memory still held
  if (problem.empty() && budget_ && budget_->charged_ids() != created_ids + unreleased)
    problem = "the budget is charged for " + std::to_string(budget_->charged_ids()) + " page ids, " +
              std::to_string(created_ids) + " are created and " + std::to_string(unreleased) +
              " kept after a failed release";
  return problem;
}

std::shared_ptr<CacheMemory> PageManager::memory() const {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  return memory_;
}

}  // namespace vattn
