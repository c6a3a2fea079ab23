#include "page_manager.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

#include "errors.h"

namespace vattn {

namespace {

std::string range_text(int64_t lo, int64_t hi) {
  return "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}

}  // namespace

PageManager::PageManager(std::shared_ptr<VmmBackend> backend, const PageManagerConfig& config,
                         const PolicyConfig& policy)
    : backend_(std::move(backend)),
      config_(config),
      policy_(policy),
      page_size_(backend_->page_size()),
      reclaim_floor_pages_(static_cast<size_t>(policy.reclaim_threshold *
                                               static_cast<double>(backend_->num_pages()))) {
  if (config_.num_buffers == 0 || config_.num_slots == 0 || config_.bytes_per_token == 0 ||
      config_.max_tokens == 0)
    throw std::invalid_argument("PageManager: num_buffers, num_slots, bytes_per_token and "
                                "max_tokens must all be positive");
  if (config_.slot_bytes == 0 || config_.slot_bytes % page_size_ != 0 ||
      config_.slot_bytes < config_.max_tokens * config_.bytes_per_token)
    throw std::invalid_argument("PageManager: slot_bytes must be a multiple of page_size "
                                "covering max_tokens * bytes_per_token");
  if (!(policy_.reclaim_threshold >= 0.0 && policy_.reclaim_threshold <= 1.0))
    throw std::invalid_argument("reclaim_threshold must be in [0, 1]");
  if (policy_.max_batch_pages < config_.num_buffers)
    throw std::invalid_argument("max_batch_pages must be at least num_buffers");
  reservation_ = std::make_shared<Reservation>(backend_, config_.num_buffers * buffer_bytes());
  slot_pages_.resize(config_.num_slots);
  slot_allocated_.assign(config_.num_slots, 0);
  slot_tokens_.assign(config_.num_slots, 0);
  need_.assign(config_.num_slots, 0);
  const size_t n = backend_->num_pages();
  free_pages_.reserve(n);
  uncreated_.reserve(n);
  for (size_t i = n; i > 0; --i) uncreated_.push_back(static_cast<uint32_t>(i - 1));
  stats_.pages_total = n;
  stats_.pages_free_low = n;
  work_epoch_ = 1;  // the mapper starts with work: the eager slot
  if (policy_.background) mapper_ = std::thread(&PageManager::mapper_loop, this);
}

PageManager::~PageManager() {
  try {
    close();
  } catch (...) {
    // Destructors never throw; close() already released what it could.
  }
}

void PageManager::check_open() const {
  if (!reservation_) throw ClosedError("the KV cache manager was cleaned up; create a new one");
}

void PageManager::check_slot(int64_t slot, const char* what) const {
  if (slot < 0 || slot >= static_cast<int64_t>(config_.num_slots))
    throw std::invalid_argument(std::string(what) + ": reqid must be in " +
                                range_text(0, config_.num_slots - 1) + ", got " +
                                std::to_string(slot));
}

size_t PageManager::pages_for_tokens(int64_t tokens) const {
  size_t bytes = static_cast<size_t>(tokens) * config_.bytes_per_token;
  return (bytes + page_size_ - 1) / page_size_;
}

uintptr_t PageManager::page_address(size_t buffer, size_t slot, size_t page) const {
  return reservation_->base() + buffer * buffer_bytes() + slot * config_.slot_bytes +
         page * page_size_;
}

void PageManager::wait_for_batch(Lock& lock) {
  batch_done_.wait(lock, [&] { return !inflight_; });
}

void PageManager::note_mapped(size_t added) {
  stats_.pages_mapped += added;
  stats_.pages_mapped_peak = std::max(stats_.pages_mapped_peak, stats_.pages_mapped);
  stats_.pages_free_low = std::min(stats_.pages_free_low, stats_.pages_total - stats_.pages_mapped);
}

// ---- slots --------------------------------------------------------------------

int64_t PageManager::best_free_slot(int64_t prompt_tokens) const {
  const size_t want = prompt_tokens < 0 ? 0 : pages_for_tokens(prompt_tokens);
  int64_t best = -1;
  size_t best_pages = 0;
  for (size_t s = 0; s < config_.num_slots; ++s) {
    if (slot_allocated_[s]) continue;
    size_t pages = mapped_of(s);
    bool better;
    if (best < 0) {
      better = true;
    } else if (prompt_tokens < 0) {
      better = pages > best_pages;  // most pages mapped
    } else if (best_pages >= want) {
      better = pages >= want && pages < best_pages;  // smallest that covers the prompt
    } else {
      better = pages > best_pages;  // nothing covers yet: the largest
    }
    if (better) {
      best = static_cast<int64_t>(s);
      best_pages = pages;
    }
  }
  return best;
}

int64_t PageManager::alloc_slot(int64_t prompt_tokens, int64_t wanted_slot) {
  Lock lock(mu_);
  check_open();
  if (prompt_tokens > static_cast<int64_t>(config_.max_tokens))
    throw std::invalid_argument("alloc_reqid: prompt_len must be in " +
                                range_text(0, config_.max_tokens) + ", got " +
                                std::to_string(prompt_tokens));
  int64_t best = wanted_slot;
  if (wanted_slot >= 0) {  // the caller owns slot numbering (a framework's block id)
    check_slot(wanted_slot, "alloc_reqid");
    if (slot_allocated_[wanted_slot])
      throw std::invalid_argument("alloc_reqid: reqid " + std::to_string(wanted_slot) +
                                  " is already allocated");
    // Such a caller counts pages by its own lengths: the slot must not bring
    // more pages than the request's first tokens need. Pages left behind by
    // the slot's previous request beyond that are unmapped now.
    size_t keep = pages_for_tokens(std::max<int64_t>(prompt_tokens, 0));
    if (mapped_of(wanted_slot) > keep) {
      wait_for_batch(lock);  // may release mu_ while it waits
      if (slot_allocated_[wanted_slot])
        throw std::invalid_argument("alloc_reqid: reqid " + std::to_string(wanted_slot) +
                                    " is already allocated");
      unmap_slot_locked(wanted_slot, keep);  // may throw: nothing was allocated yet
    }
  } else {
    best = best_free_slot(prompt_tokens);
  }
  if (best < 0)
    throw OutOfSlots("alloc_reqid: all " + std::to_string(config_.num_slots) +
                     " reqids are in use (max_batch_size); free one with free_reqid");
  slot_allocated_[best] = 1;
  slot_tokens_[best] = 0;
  stats_.slots_allocated++;
  work_epoch_++;  // the eager target moved on
  lock.unlock();
  wake_.notify_one();
  return best;
}

void PageManager::free_slot(int64_t slot) {
  Lock lock(mu_);
  check_open();
  check_slot(slot, "free_reqid");
  if (!slot_allocated_[slot])
    throw std::invalid_argument("free_reqid: reqid " + std::to_string(slot) +
                                " is not allocated (freed twice, or never returned by alloc_reqid)");
  if (!policy_.deferred_reclaim) {
    wait_for_batch(lock);
    unmap_slot_locked(slot);  // may throw: the slot then stays allocated, as it was
  }
  slot_allocated_[slot] = 0;
  stats_.tokens_active -= slot_tokens_[slot];
  slot_tokens_[slot] = 0;
  stats_.slots_allocated--;
  work_epoch_++;
  lock.unlock();
  wake_.notify_one();
}

// ---- step ---------------------------------------------------------------------

bool PageManager::step(const int64_t* seq_lens, size_t count) {
  Lock lock(mu_);
  check_open();
  if (count != config_.num_slots)
    throw std::invalid_argument("step: seq_lens must have max_batch_size = " +
                                std::to_string(config_.num_slots) + " entries, got " +
                                std::to_string(count));
  // Validate everything before changing anything.
  size_t deficit = 0;  // pages to map, all buffers together
  for (size_t s = 0; s < count; ++s) {
    int64_t len = seq_lens[s];
    if (len < 0 || len > static_cast<int64_t>(config_.max_tokens))
      throw std::invalid_argument("step: seq_lens[" + std::to_string(s) + "] must be in " +
                                  range_text(0, config_.max_tokens) + " (max_context_len), got " +
                                  std::to_string(len));
    if (len > 0 && !slot_allocated_[s])
      throw std::invalid_argument("step: seq_lens[" + std::to_string(s) + "] = " +
                                  std::to_string(len) + " but reqid " + std::to_string(s) +
                                  " is not allocated (use 0 for inactive reqids)");
    need_[s] = pages_for_tokens(len);
    deficit += missing_pages(s) * config_.num_buffers;
  }
  if (mapper_error_) {
    std::exception_ptr error = mapper_error_;
    mapper_error_ = nullptr;
    std::rethrow_exception(error);
  }
  stats_.step_calls++;
  if (deficit > 0 && inflight_) {
    // The batch may be mapping exactly these pages: let it land, then look again.
    auto t0 = std::chrono::steady_clock::now();
    wait_for_batch(lock);
    stats_.step_wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::steady_clock::now() - t0)
                               .count();
    if (mapper_error_) {
      std::exception_ptr error = mapper_error_;
      mapper_error_ = nullptr;
      std::rethrow_exception(error);
    }
    deficit = 0;
    for (size_t s = 0; s < count; ++s) deficit += missing_pages(s) * config_.num_buffers;
  }
  if (deficit > 0) {
    if (deficit > available_pages()) {
      size_t reclaimable = 0;
      for (size_t s = 0; s < count; ++s)
        if (!slot_allocated_[s]) reclaimable += slot_pages_[s].size();
      if (deficit > available_pages() + reclaimable) {
        stats_.failed_steps++;
        return false;
      }
      reclaim_locked(deficit - available_pages(), -1);  // last resort, on the critical path
    }
    map_missing_locked(deficit);
  }
  // The mapper is woken only when this step gave it work: the pool changed
  // (pages mapped here: reserve, eager and reclaim floor may need attention) or
  // some slot's lookahead now reaches past its mapping. A decode step inside a
  // page does neither, and skips the wake-up.
  bool mapper_work = deficit > 0;
  size_t tokens = 0;
  for (size_t s = 0; s < count; ++s) {
    slot_tokens_[s] = seq_lens[s];
    tokens += seq_lens[s];
    if (seq_lens[s] > 0 && lookahead_pages(s) > mapped_of(s)) mapper_work = true;
  }
  stats_.tokens_active = tokens;
  if (policy_.background && mapper_work) {
    work_epoch_++;
    lock.unlock();
    wake_.notify_one();
  }
  return true;
}

// ---- pages --------------------------------------------------------------------

size_t PageManager::claim_pages(size_t count, std::vector<uint32_t>& out) {
  out.clear();
  size_t from_free = std::min(count, free_pages_.size());
  out.insert(out.end(), free_pages_.end() - from_free, free_pages_.end());
  free_pages_.resize(free_pages_.size() - from_free);
  size_t to_create = count - from_free;
  for (size_t i = 0; i < to_create; ++i) {
    out.push_back(uncreated_.back());
    uncreated_.pop_back();
  }
  return to_create;
}

void PageManager::return_pages(const std::vector<uint32_t>& pages, size_t uncreated) {
  size_t created = pages.size() - uncreated;
  free_pages_.insert(free_pages_.end(), pages.begin(), pages.begin() + created);
  for (size_t i = pages.size(); i > created; --i) uncreated_.push_back(pages[i - 1]);
}

void PageManager::map_missing_locked(size_t deficit) {
  size_t to_create = claim_pages(deficit, taken_);
  if (to_create > 0) {
    try {
      backend_->create_pages(taken_.data() + deficit - to_create, to_create);
    } catch (...) {
      return_pages(taken_, to_create);
      throw;
    }
    stats_.pages_created += to_create;
  }
  // Slot-major, then buffer, then page: each buffer's new pages of a slot are
  // one address run, and freshly created pages get consecutive ids along it,
  // so the host's mappings can merge and CUDA grants access once per run.
  mappings_.clear();
  for (size_t s = 0; s < config_.num_slots; ++s) {
    size_t have = mapped_of(s), add = missing_pages(s);
    for (size_t b = 0; b < config_.num_buffers; ++b)
      for (size_t p = have; p < have + add; ++p)
        mappings_.push_back(PageMapping{page_address(b, s, p), taken_[mappings_.size()]});
  }
  try {
    backend_->map(mappings_.data(), mappings_.size());
  } catch (...) {
    return_pages(taken_, 0);
    throw;
  }
  size_t first = 0;  // index in taken_ of slot s's first new page
  for (size_t s = 0; s < config_.num_slots; ++s) {
    size_t add = missing_pages(s);
    for (size_t p = 0; p < add; ++p)
      for (size_t b = 0; b < config_.num_buffers; ++b)
        slot_pages_[s].push_back(taken_[first + b * add + p]);
    first += add * config_.num_buffers;
  }
  stats_.sync_page_maps += deficit;
  note_mapped(deficit);
}

size_t PageManager::detach_free_pages(size_t want, int64_t keep_slot, std::vector<uintptr_t>& addrs,
                                      std::vector<uint32_t>& pages) {
  addrs.clear();
  pages.clear();
  std::vector<size_t> victims;
  for (size_t s = 0; s < config_.num_slots; ++s)
    if (!slot_allocated_[s] && !slot_pages_[s].empty() && static_cast<int64_t>(s) != keep_slot)
      victims.push_back(s);
  // Smallest slots first: the big ones are what alloc_reqid hands out next.
  std::stable_sort(victims.begin(), victims.end(),
                   [&](size_t a, size_t b) { return slot_pages_[a].size() < slot_pages_[b].size(); });
  for (size_t s : victims) {
    if (pages.size() >= want) break;
    size_t have = mapped_of(s), keep = have;
    while (keep > 0 && pages.size() + (have - keep) * config_.num_buffers < want) --keep;
    for (size_t p = keep; p < have; ++p)
      for (size_t b = 0; b < config_.num_buffers; ++b) addrs.push_back(page_address(b, s, p));
    auto& owned = slot_pages_[s];
    pages.insert(pages.end(), owned.begin() + keep * config_.num_buffers, owned.end());
    owned.resize(keep * config_.num_buffers);
  }
  return pages.size();
}

size_t PageManager::reclaim_locked(size_t want, int64_t keep_slot) {
  std::vector<uintptr_t> addrs;
  std::vector<uint32_t> pages;
  if (want == 0 || detach_free_pages(want, keep_slot, addrs, pages) == 0) return 0;
  // A finished request's kernels may still be reading these pages. If the
  // unmap fails part-way, the detached pages stay out of the pool: handing a
  // possibly still mapped page to another slot would be worse than losing it.
  backend_->synchronize();
  backend_->unmap(addrs.data(), addrs.size());
  free_pages_.insert(free_pages_.end(), pages.begin(), pages.end());
  stats_.reclaimed_pages += pages.size();
  stats_.page_unmaps += pages.size();
  stats_.pages_mapped -= pages.size();
  return pages.size();
}

void PageManager::unmap_slot_locked(size_t slot, size_t keep_pages) {
  std::vector<uintptr_t> addrs;
  for (size_t p = keep_pages; p < mapped_of(slot); ++p)
    for (size_t b = 0; b < config_.num_buffers; ++b) addrs.push_back(page_address(b, slot, p));
  if (addrs.empty()) return;
  backend_->synchronize();
  backend_->unmap(addrs.data(), addrs.size());
  auto& owned = slot_pages_[slot];
  auto first = owned.begin() + keep_pages * config_.num_buffers;
  free_pages_.insert(free_pages_.end(), first, owned.end());
  stats_.page_unmaps += addrs.size();
  stats_.pages_mapped -= addrs.size();
  owned.erase(first, owned.end());
}

size_t PageManager::reclaim(size_t max_pages) {
  Lock lock(mu_);
  check_open();
  wait_for_batch(lock);
  size_t reclaimed = reclaim_locked(max_pages, -1);
  if (reclaimed > 0) {
    work_epoch_++;  // freed pages may let the mapper do what it had no room for
    lock.unlock();
    wake_.notify_one();
  }
  return reclaimed;
}

// ---- background mapper ----------------------------------------------------------

PageManager::Batch PageManager::plan_batch() {
  Batch batch;
  const size_t nb = config_.num_buffers;
  const int64_t eager_slot = policy_.eager ? best_free_slot(-1) : -1;
  // 1. Deferred reclamation: keep free slots' pages until the pool runs low.
  if (policy_.deferred_reclaim && available_pages() < reclaim_floor_pages_) {
    size_t want = std::min(reclaim_floor_pages_ - available_pages(), policy_.max_batch_pages);
    if (detach_free_pages(want, eager_slot, batch.unmap_addrs, batch.pages) > 0) return batch;
  }
  // 2. Lookahead for active slots, then 3. the eager slot, within the budget.
  size_t budget = std::min(policy_.max_batch_pages, available_pages());
  size_t planned = 0;
  auto grow = [&](size_t s, size_t target, size_t limit) {
    size_t have = mapped_of(s);
    if (target <= have || planned >= limit) return;
    size_t add = std::min(target - have, (limit - planned) / nb);
    if (add == 0) return;
    batch.slots.push_back(s);
    batch.run_pages.push_back(add);
    planned += add * nb;
  };
  for (size_t s = 0; s < config_.num_slots; ++s)
    if (slot_allocated_[s] && slot_tokens_[s] > 0) grow(s, lookahead_pages(s), budget);
  if (eager_slot >= 0) {
    // Eager pages are speculative: they never eat into the reclaim floor.
    size_t spare = available_pages() - planned;  // planned <= budget <= available
    size_t above_floor = spare > reclaim_floor_pages_ ? spare - reclaim_floor_pages_ : 0;
    grow(static_cast<size_t>(eager_slot),
         pages_for_tokens(std::min(policy_.eager_tokens, config_.max_tokens)),
         std::min(budget, planned + above_floor));
  }
  if (planned == 0) {
    // 4. Keep one created page row per active request in the free pool: the
    // next page-crossing wave then only maps. Creation needs no address, so
    // it can run while steps proceed.
    size_t active = 0;
    for (size_t s = 0; s < config_.num_slots; ++s) active += slot_allocated_[s];
    size_t reserve = active * nb;
    if (free_pages_.size() < reserve && !uncreated_.empty()) {
      size_t n = std::min({reserve - free_pages_.size(), uncreated_.size(), policy_.max_batch_pages});
      batch.to_create = n;
      for (size_t i = 0; i < n; ++i) {
        batch.pages.push_back(uncreated_.back());
        uncreated_.pop_back();
      }
    }
    return batch;
  }
  batch.to_create = claim_pages(planned, batch.pages);
  for (size_t i = 0, next = 0; i < batch.slots.size(); ++i) {
    size_t s = batch.slots[i], have = mapped_of(s), add = batch.run_pages[i];
    for (size_t b = 0; b < nb; ++b)
      for (size_t p = have; p < have + add; ++p)
        batch.mappings.push_back(PageMapping{page_address(b, s, p), batch.pages[next++]});
  }
  return batch;
}

void PageManager::run_batch(Batch& batch) {
  if (!batch.unmap_addrs.empty()) {
    backend_->synchronize();  // see reclaim_locked
    backend_->unmap(batch.unmap_addrs.data(), batch.unmap_addrs.size());
    return;
  }
  if (batch.to_create > 0) {
    backend_->create_pages(batch.pages.data() + batch.pages.size() - batch.to_create, batch.to_create);
    batch.created = true;
  }
  if (!batch.mappings.empty()) backend_->map(batch.mappings.data(), batch.mappings.size());
}

void PageManager::commit_batch(Batch& batch, std::exception_ptr error) {
  stats_.mapper_batches++;
  const size_t n = batch.pages.size();
  if (error) {
    stats_.mapper_errors++;
    mapper_error_ = error;
    // A failed map leaves nothing mapped (backends undo their own partial work);
    // a failed unmap may leave pages mapped, so those stay out of the pool.
    if (batch.unmap_addrs.empty()) return_pages(batch.pages, batch.created ? 0 : batch.to_create);
  } else if (!batch.unmap_addrs.empty()) {
    free_pages_.insert(free_pages_.end(), batch.pages.begin(), batch.pages.end());
    stats_.reclaimed_pages += n;
    stats_.background_reclaimed_pages += n;
    stats_.page_unmaps += n;
    stats_.pages_mapped -= n;
  } else if (batch.mappings.empty()) {  // a create batch
    free_pages_.insert(free_pages_.end(), batch.pages.begin(), batch.pages.end());
    stats_.pages_created += batch.to_create;
  } else {
    const size_t nb = config_.num_buffers;
    for (size_t i = 0, first = 0; i < batch.slots.size(); ++i) {
      size_t s = batch.slots[i], add = batch.run_pages[i];
      for (size_t p = 0; p < add; ++p)
        for (size_t b = 0; b < nb; ++b) slot_pages_[s].push_back(batch.pages[first + b * add + p]);
      first += add * nb;
    }
    stats_.pages_created += batch.to_create;
    stats_.background_page_maps += n;
    note_mapped(n);
  }
}

void PageManager::mapper_loop() {
  Lock lock(mu_);
  while (true) {
    mapper_idle_ = true;
    batch_done_.notify_all();
    wake_.wait(lock, [&] { return stop_ || work_epoch_ != mapper_seen_epoch_; });
    if (stop_) break;
    mapper_idle_ = false;
    mapper_seen_epoch_ = work_epoch_;
    stats_.mapper_wakeups++;
    while (!stop_ && !mapper_error_) {
      Batch batch = plan_batch();
      if (batch.empty()) break;
      inflight_ = true;
      lock.unlock();
      std::exception_ptr error;
      try {
        run_batch(batch);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      commit_batch(batch, error);
      inflight_ = false;
      batch_done_.notify_all();
    }
  }
  mapper_idle_ = true;
  batch_done_.notify_all();
}

void PageManager::wait_idle() {
  Lock lock(mu_);
  if (!policy_.background) return;
  batch_done_.wait(lock, [&] {
    return stop_ || (mapper_idle_ && !inflight_ && mapper_seen_epoch_ == work_epoch_);
  });
}

// ---- lifetime -------------------------------------------------------------------

void PageManager::close() {
  std::lock_guard<std::mutex> closing(close_mu_);
  {
    Lock lock(mu_);
    if (!reservation_) return;
    stop_ = true;
  }
  wake_.notify_all();
  if (mapper_.joinable()) mapper_.join();  // without mu_: the mapper commits its batch first
  Lock lock(mu_);
  // Tear down everything even if one driver call fails; report the first error.
  std::exception_ptr first_error;
  try {
    backend_->synchronize();
  } catch (...) {
    first_error = std::current_exception();
  }
  std::vector<uintptr_t> addrs;
  for (size_t s = 0; s < config_.num_slots; ++s) {
    addrs.clear();
    for (size_t p = 0; p < mapped_of(s); ++p)
      for (size_t b = 0; b < config_.num_buffers; ++b) addrs.push_back(page_address(b, s, p));
    try {
      backend_->unmap(addrs.data(), addrs.size());
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
    stats_.page_unmaps += addrs.size();
    slot_pages_[s].clear();
    slot_allocated_[s] = 0;
    slot_tokens_[s] = 0;
  }
  backend_->close_pool();
  free_pages_.clear();
  uncreated_.clear();
  stats_.pages_mapped = 0;
  stats_.slots_allocated = 0;
  stats_.tokens_active = 0;
  reservation_.reset();  // tensor views may still hold it; the range stays reserved until they go
  if (first_error) std::rethrow_exception(first_error);
}

bool PageManager::closed() const {
  Lock lock(mu_);
  return !reservation_;
}

size_t PageManager::mapped_pages(int64_t slot) const {
  Lock lock(mu_);
  check_open();
  check_slot(slot, "mapped_pages");
  return mapped_of(slot);
}

bool PageManager::slot_allocated(int64_t slot) const {
  Lock lock(mu_);
  check_open();
  check_slot(slot, "is_allocated");
  return slot_allocated_[slot] != 0;
}

PageStats PageManager::stats() const {
  Lock lock(mu_);
  return stats_;
}

std::shared_ptr<Reservation> PageManager::reservation() const {
  Lock lock(mu_);
  check_open();
  return reservation_;
}

}  // namespace vattn
