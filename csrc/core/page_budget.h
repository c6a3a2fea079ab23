// A page manager's share of a machine-wide memory budget (budget/budget.h),
// counted in page ids: one id is num_buffers physical pages of page_size
// bytes. An id is charged before its pages are created and uncharged after
// they are released (host: the hole punched; CUDA: cuMemRelease), so the
// budget always covers every physical page this manager holds.
//
// Thread-safe without the page manager's lock: the mapper charges for the
// pages it creates while the manager's mutex is free (the budget has a
// process-shared lock of its own). docs/elastic.md has the semantics.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "budget/budget.h"

namespace vattn {

class PageBudget {
 public:
  PageBudget(std::shared_ptr<BudgetMember> member, uint64_t id_bytes);
  ~PageBudget();  // leaves the budget (not in a forked child: the entry is the parent's)
  PageBudget(const PageBudget&) = delete;
  PageBudget& operator=(const PageBudget&) = delete;

  // Charges `ids` page ids before their pages are created. False when the
  // budget refuses; `demand` (a caller needs them now, not the mapper ahead
  // of time) records the refusal as a wait, which makes the budget's other
  // members give free pages back. When the budget cannot be used (removed,
  // truncated, corrupt, this member dropped) the cache detaches from it, once
  // and logged, and goes on without a budget: every charge after that is
  // granted (the pool bounds it) and counted here only. A lock held past
  // lock_timeout_s (a stopped or stuck holder) is a refusal instead: the
  // budget is sound, and the cache stays within it.
  bool charge(size_t ids, bool demand);
  // Gives `ids` charged ids back (their pages were released, or never
  // created). Never throws: a budget that cannot be reached has nothing to
  // give back to; one whose lock is stuck gets them at a later retry.
  void uncharge(size_t ids) noexcept;
  // Gives back what a stuck lock kept uncharge from returning (the keeper, every tick).
  void retry_give_back() noexcept;
  // Page ids released here that the budget still counts (its lock was stuck when they went).
  size_t unreturned_ids() const { return unreturned_.load(std::memory_order_acquire); }
  // Page ids to give back now: others' waits and a lowered limit, beyond
  // what is free within the limit (rounded up to whole ids). Lock-free when 0.
  size_t pressure_ids();
  // Lock-free: whether anyone waits or the total is above the limit.
  bool contended() const { return member_->contended(); }
  // Lock-free: ids a charge could get now (stale by the time it is used);
  // unbounded once detached or when the budget cannot be used (the pool decides).
  size_t grantable_ids() const;
  // Why the cache went on without its budget ("" while it draws from it).
  std::string detached_reason() const;
  // Empty while the budget can be used; otherwise why not (truncated,
  // overwritten, removed by force). The keeper stops drawing from it then.
  std::string unusable_reason() const noexcept { return member_->budget()->unusable_reason(); }
  // After a refused demand charge: blocks until memory may have come free in
  // the budget, or `timeout_s` seconds pass (no CPU spent). Whether it did.
  bool wait_for_memory(double timeout_s) { return member_->wait_for_memory(timeout_s); }
  // A creation failed for another reason than the budget (out of memory):
  // the next wait_for_memory waits for what happens after it.
  void rearm_wait() noexcept { member_->rearm_wait(); }
  // Records the split of what is charged: ids under requests and free ids
  // kept for reuse (clamped to what is charged).
  void report(size_t in_use_ids, size_t free_ids);
  // Leaves the budget, giving back everything charged: the pages are gone.
  // Idempotent; never throws.
  void leave() noexcept;

  size_t charged_ids() const { return charged_.load(std::memory_order_acquire); }
  uint64_t id_bytes() const { return id_bytes_; }
  const std::string& budget_name() const { return member_->budget()->name(); }
  // "budget 'NAME' (limit L bytes, A available)": for error messages.
  std::string describe() const;

 private:
  std::shared_ptr<BudgetMember> member_;
  const uint64_t id_bytes_;
  std::atomic<size_t> charged_{0};
  std::atomic<size_t> unreturned_{0};  // uncharged here, still counted by the budget (give_back retries)
  std::atomic<bool> detached_{false};
  mutable std::mutex detached_mu_;
  std::string detached_reason_;  // guarded by detached_mu_
  void detach(const std::string& why) noexcept;
  void give_back(size_t ids) noexcept;  // member_->release of ids and of what is unreturned
};

}  // namespace vattn
