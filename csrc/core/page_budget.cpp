#include "core/page_budget.h"


#include <algorithm>
#include <cstdio>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "budget/budget_error.h"

namespace vattn {

PageBudget::PageBudget(std::shared_ptr<BudgetMember> member, uint64_t id_bytes)
    : member_(std::move(member)), id_bytes_(id_bytes) {
  if (!member_) throw std::invalid_argument("PageBudget: no budget member");
  if (id_bytes_ == 0) throw std::invalid_argument("PageBudget: a page id must have bytes");
}

PageBudget::~PageBudget() { leave(); }

void PageBudget::leave() noexcept {
  try {
    member_->leave();
    charged_.store(0, std::memory_order_release);
  } catch (...) {
    // A forked child: the entry is the parent's, which leaves it.
  }
}

bool PageBudget::charge(size_t ids, bool demand) {
  if (ids == 0) return true;
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(ids), id_bytes_, &bytes)) return false;
  if (!detached_.load(std::memory_order_acquire)) {
    try {
      if (!member_->try_grant(bytes, demand)) return false;
    } catch (const BudgetLockTimeout&) {
      // A stopped or stuck holder of the budget's lock: the budget is sound, and what this cache holds
      // must stay within it, so this is a refusal (the caller answers or waits as for a full budget).
      return false;
    } catch (const BudgetError& e) {
      // A budget no one can use any more must not stop a cache's requests
      // (docs/elastic.md, "When a budget is removed or damaged"): the cache
      // goes on as if it had none, its pages bounded by its own pool.
      detach(e.what());
    }
  }
  charged_.fetch_add(ids, std::memory_order_acq_rel);
  return true;
}

void PageBudget::detach(const std::string& why) noexcept {
  std::lock_guard<std::mutex> lock(detached_mu_);
  if (detached_.exchange(true, std::memory_order_acq_rel)) return;
  detached_reason_ = why;
  std::fprintf(stderr, "vattn: %s; this cache goes on without a budget, within its own pool\n", why.c_str());
}

std::string PageBudget::detached_reason() const {
  std::lock_guard<std::mutex> lock(detached_mu_);
  return detached_reason_;
}

void PageBudget::uncharge(size_t ids) noexcept {
  if (ids == 0) return;
  size_t had = charged_.load(std::memory_order_acquire);
  size_t take = 0;
  do {
    take = std::min(ids, had);
  } while (!charged_.compare_exchange_weak(had, had - take, std::memory_order_acq_rel));
  give_back(take);
}

void PageBudget::give_back(size_t ids) noexcept {
  ids += unreturned_.exchange(0, std::memory_order_acq_rel);
  if (ids == 0) return;
  try {
    member_->release(static_cast<uint64_t>(ids) * id_bytes_);
  } catch (const BudgetLockTimeout&) {
    // A stuck holder of the budget's lock: the pages are gone but the budget still counts them; given
    // back by the keeper's next tick (retry_give_back) or the next uncharge.
    unreturned_.fetch_add(ids, std::memory_order_acq_rel);
  } catch (...) {
    // The member was dropped (its budget was removed and created again, or is
    // corrupt): there is no share left to return.
  }
}

void PageBudget::retry_give_back() noexcept {
  if (unreturned_.load(std::memory_order_acquire) != 0) give_back(0);
}

size_t PageBudget::pressure_ids() {
  const uint64_t bytes = member_->pressure();
  return bytes == 0 ? 0 : static_cast<size_t>((bytes + id_bytes_ - 1) / id_bytes_);
}

size_t PageBudget::grantable_ids() const {
  if (detached_.load(std::memory_order_acquire) || !unusable_reason().empty())
    return std::numeric_limits<size_t>::max();
  return static_cast<size_t>(member_->budget()->available_bytes() / id_bytes_);
}

void PageBudget::report(size_t in_use_ids, size_t free_ids) {
  // The mapper may have charged for pages the table does not count yet, never
  // the reverse; clamp anyway so a report can never be refused.
  const size_t charged = charged_ids();
  in_use_ids = std::min(in_use_ids, charged);
  free_ids = std::min(free_ids, charged - in_use_ids);
  member_->report(static_cast<uint64_t>(in_use_ids) * id_bytes_, static_cast<uint64_t>(free_ids) * id_bytes_);
}

std::string PageBudget::describe() const {
  const auto& budget = member_->budget();
  return "budget '" + budget->name() + "' (limit " + std::to_string(budget->limit_bytes()) + " bytes, " +
         std::to_string(budget->available_bytes()) + " available)";
}

}  // namespace vattn
