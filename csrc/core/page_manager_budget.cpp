// PageManager: memory given back. Preallocation of the whole pool, releasing
// free pages (to the OS or device, and to the budget), and the keeper thread
// that does it on its own when the manager is in a budget: after
// idle_release_s without a step, and when other members wait or the limit
// was lowered. Pages under requests, prefix handles and orphans are never
// released; a preallocated pool is never shrunk. docs/elastic.md has the
// semantics.
#include <algorithm>
#include <chrono>
#include <exception>
#include <stdexcept>
#include <string>

#include "common/errors.h"
#include "core/page_manager.h"
#include "budget/budget_error.h"

namespace vattn {

namespace {

// How often the keeper looks at the budget: a lock-free poll when nothing is
// asked of it, so another process that waits for pages gets them within this.
constexpr auto kKeeperInterval = std::chrono::milliseconds(20);

}  // namespace

void PageManager::preallocate() {
  std::vector<uint32_t> ids;
  if (config_.external_ids) {
    for (size_t id = 0; id < num_ids_; ++id) ids.push_back(static_cast<uint32_t>(id));
  } else {
    ids = table_.take_uncreated(num_ids_);
  }
  try {
    create_ids(ids, false);
  } catch (const OutOfPages& e) {
    throw OutOfPages(std::string("preallocate: ") + e.what() + "; raise the budget's limit, lower " +
                     "physical_memory, or create pages on first use (preallocate=False)");
  }
  table_.mark_created(ids);
  if (!config_.external_ids) table_.return_fresh(ids);  // the free pool, smallest id handed out first
}

size_t PageManager::release_free(size_t max_ids) {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  if (config_.external_ids)
    throw std::invalid_argument("release_free_memory: this manager's page ids are owned by the caller "
                                "(page_allocator='external'): their pages keep their contents until cleanup");
  if (config_.preallocate) return 0;  // its pool is kept whole until close
  const size_t released = shed_locked(lock, max_ids);
  if (released > 0) {
    work_epoch_++;  // the pool changed
    sync_->wake.notify_one();
  }
  return released * config_.num_buffers;
}

std::vector<uint32_t> PageManager::release_external(const uint32_t* ids, size_t n) {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  if (!config_.external_ids)
    throw std::invalid_argument("release_pages: this manager hands out its own page ids (page_allocator='vattn'); "
                                "use release_free_memory");
  for (size_t k = 0; k < n; ++k)
    if (ids[k] >= num_ids_)
      throw std::invalid_argument("release_pages: page_ids[" + std::to_string(k) + "] must be in " +
                                  range_text(0, static_cast<int64_t>(num_ids_) - 1) + " (num_page_ids), got " +
                                  std::to_string(ids[k]));
  if (config_.preallocate) return {};  // its pool is kept whole until close
  wait_for_round(lock);
  std::vector<uint32_t> released = table_.uncreate_unreferenced(ids, n);
  release_ids(released);
  if (!released.empty()) work_epoch_++;  // the keeper reports the new split
  return released;
}

size_t PageManager::shed_locked(Lock& lock, size_t want) {
  wait_for_round(lock);  // a round in flight holds ids out of the pool
  std::vector<uint32_t> ids = table_.uncreate_free(want);
  release_ids(ids);
  size_t released = ids.size();
  if (released < want && !config_.external_ids) {
    // The deferred-reclaim cache and the eager reqid: unmapped (after their
    // read fences), then released like the rest.
    std::exception_ptr error;
    try {
      reclaim_locked(want - released, -1);
    } catch (...) {
      error = std::current_exception();  // what was unmapped still goes
    }
    ids = table_.uncreate_free(want - released);
    release_ids(ids);
    released += ids.size();
    if (error) std::rethrow_exception(error);
  }
  return released;
}

bool PageManager::has_idle_pages_locked() const {
  if (!table_.free_ids().empty()) return true;
  for (size_t s = 0; s < config_.num_reqids; ++s)
    if (!table_.allocated(s) && table_.mapped(s) > 0) return true;
  return false;
}

MapperLimits PageManager::mapper_limits() const {
  MapperLimits limits;
  if (refused_epoch_ == work_epoch_) limits.creatable_ids = 0;
  if (budget_) {
    limits.creatable_ids = std::min(limits.creatable_ids, budget_->grantable_ids());
    // Pages nobody asked for would be taken from whoever waits, or given back
    // for idleness only to be made again.
    limits.speculative = !idle_released_ && !budget_->contended();
  }
  return limits;
}

BudgetShare PageManager::budget_share() const {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  sync_->round_done.wait(lock, [&] { return !inflight_; });  // charges and the table agree between rounds
  return budget_share_locked();
}

BudgetShare PageManager::budget_share_locked() const {
  BudgetShare share;
  if (!budget_) return share;
  const PageStats stats = table_.stats();
  const size_t created = stats.pages_created / config_.num_buffers;
  // External ids keep their contents while unmapped: free-held, but never released.
  const size_t idle = config_.external_ids ? created - stats.pages_in_use / config_.num_buffers : table_.idle_ids();
  share.budget = budget_->budget_name();
  share.detached = budget_->detached_reason();
  share.held_bytes = budget_->charged_ids() * budget_->id_bytes();
  share.in_use_bytes = (created - std::min(idle, created)) * budget_->id_bytes();
  share.free_held_bytes = std::min(idle, created) * budget_->id_bytes();
  return share;
}

bool PageManager::wait_for_budget(double timeout_s) {
  check_process();
  if (!(timeout_s >= 0 && timeout_s <= 3600))
    throw std::invalid_argument("wait_for_budget: timeout_s must be in [0, 3600] seconds, got " +
                                std::to_string(timeout_s));
  check_usable();  // ClosedError after cleanup
  if (!budget_) return false;
  return budget_->wait_for_memory(timeout_s);  // the budget's futex: neither mu nor the budget's lock is held
}

// ---- the keeper -------------------------------------------------------------------------

void PageManager::keeper_loop() {
  Lock lock(sync_->mu);
  while (!stop_) {
    sync_->keeper_wake.wait_for(lock, kKeeperInterval);
    if (stop_) break;
    try {
      keeper_tick(lock);
    } catch (const BudgetLockTimeout&) {
      // A stopped or stuck holder of the budget's lock: the next tick tries again (a step that needs
      // pages meanwhile is refused, as by a full budget).
    } catch (...) {
      // A driver error while releasing (the pages stay, retried later) or a
      // budget that cannot be used: the next step raises it. Not when the
      // budget became unusable meanwhile (truncated, removed): the manager
      // works on with what it holds, and a step that needs new pages says why.
      if (!mapper_error_ && budget_->unusable_reason().empty()) mapper_error_ = std::current_exception();
    }
  }
}

void PageManager::keeper_tick(Lock& lock) {
  // The budget's lock is shared with other processes: never waited for under mu.
  size_t want = 0;
  std::exception_ptr error;
  lock.unlock();
  // A budget truncated, overwritten or removed by force is not drawn from
  // nor given to any more: no pressure, no idle release, no reports.
  if (!budget_->unusable_reason().empty()) {
    lock.lock();
    return;
  }
  budget_->retry_give_back();  // what a stuck lock kept a release from giving back
  try {
    if (!config_.preallocate && !config_.external_ids) want = budget_->pressure_ids();
  } catch (...) {
    error = std::current_exception();
  }
  lock.lock();
  if (error) std::rethrow_exception(error);
  if (stop_ || !memory_) return;
  if (!config_.preallocate && !config_.external_ids && idle_release_ns_ > 0 &&
      steady_ns() - last_step_ns_ >= idle_release_ns_) {
    idle_released_ = true;  // until the next step: no speculative pages
    want = SIZE_MAX;        // pages freed later in the idle spell go too
  }
  // While a CUDA graph is captured nothing may reach the driver: the release
  // waits for the next tick after the capture.
  if (want > 0 && !background_paused() && has_idle_pages_locked() && shed_locked(lock, want) > 0) {
    work_epoch_++;
    sync_->wake.notify_one();
  }
  // Report the split when the table changed (the scan is O(pages)).
  const PageStats& stats = table_.counters();
  std::vector<uint64_t> signature = {work_epoch_, stats.pages_created, stats.pages_in_use, stats.page_mappings,
                                     stats.mapper_rounds, budget_->charged_ids()};
  if (inflight_ || signature == reported_) return;
  const BudgetShare share = budget_share_locked();
  reported_ = std::move(signature);
  lock.unlock();
  try {
    budget_->report(share.in_use_bytes / budget_->id_bytes(), share.free_held_bytes / budget_->id_bytes());
  } catch (...) {
    error = std::current_exception();
  }
  lock.lock();
  if (error) std::rethrow_exception(error);
}

}  // namespace vattn
