#include "page_manager.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

#include "errors.h"

namespace vattn {

namespace {

std::string range_text(int64_t lo, int64_t hi) {
  return "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}

}  // namespace

PageManager::PageManager(std::shared_ptr<VmmBackend> backend, const PageManagerConfig& config)
    : backend_(std::move(backend)),
      config_(config),
      page_size_(backend_->page_size()),
      pages_per_slot_(config.slot_bytes / backend_->page_size()) {
  if (config_.num_buffers == 0 || config_.num_slots == 0 || config_.bytes_per_token == 0 ||
      config_.max_tokens == 0)
    throw std::invalid_argument("PageManager: num_buffers, num_slots, bytes_per_token and "
                                "max_tokens must all be positive");
  if (config_.slot_bytes == 0 || config_.slot_bytes % page_size_ != 0 ||
      config_.slot_bytes < config_.max_tokens * config_.bytes_per_token)
    throw std::invalid_argument("PageManager: slot_bytes must be a multiple of page_size "
                                "covering max_tokens * bytes_per_token");
  reservation_ = std::make_shared<Reservation>(backend_, config_.num_buffers * buffer_bytes());
  slot_pages_.resize(config_.num_slots);
  slot_allocated_.assign(config_.num_slots, 0);
  slot_tokens_.assign(config_.num_slots, 0);
  need_.assign(config_.num_slots, 0);
  free_pages_.reserve(backend_->num_pages());
  stats_.pages_total = backend_->num_pages();
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

size_t PageManager::available_pages() const {
  return free_pages_.size() + (backend_->num_pages() - next_uncreated_);
}

int64_t PageManager::alloc_slot(int64_t prompt_tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  if (prompt_tokens > static_cast<int64_t>(config_.max_tokens))
    throw std::invalid_argument("alloc_reqid: prompt_len must be in " +
                                range_text(0, config_.max_tokens) + ", got " +
                                std::to_string(prompt_tokens));
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
  if (best < 0)
    throw OutOfSlots("alloc_reqid: all " + std::to_string(config_.num_slots) +
                     " reqids are in use (max_batch_size); free one with free_reqid");
  slot_allocated_[best] = 1;
  slot_tokens_[best] = 0;
  stats_.slots_allocated++;
  return best;
}

void PageManager::free_slot(int64_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  check_slot(slot, "free_reqid");
  if (!slot_allocated_[slot])
    throw std::invalid_argument("free_reqid: reqid " + std::to_string(slot) +
                                " is not allocated (freed twice, or never returned by alloc_reqid)");
  slot_allocated_[slot] = 0;
  stats_.tokens_active -= slot_tokens_[slot];
  slot_tokens_[slot] = 0;
  stats_.slots_allocated--;
}

bool PageManager::step(const int64_t* seq_lens, size_t count) {
  std::lock_guard<std::mutex> lock(mu_);
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
  stats_.step_calls++;
  if (deficit > 0) {
    if (deficit > available_pages()) {
      size_t reclaimable = 0;
      for (size_t s = 0; s < count; ++s)
        if (!slot_allocated_[s]) reclaimable += slot_pages_[s].size();
      if (deficit > available_pages() + reclaimable) {
        stats_.failed_steps++;
        return false;
      }
      reclaim_locked(deficit - available_pages());
    }
    take_pages(deficit, taken_);
    // Slot-major, then buffer, then page: each buffer's new pages of a slot are
    // one address run, and freshly created pages get consecutive ids along it,
    // so the host's mappings can merge and CUDA grants access once per run.
    mappings_.clear();
    for (size_t s = 0; s < count; ++s) {
      size_t have = mapped_of(s), add = missing_pages(s);
      for (size_t b = 0; b < config_.num_buffers; ++b)
        for (size_t p = have; p < have + add; ++p)
          mappings_.push_back(PageMapping{page_address(b, s, p), taken_[mappings_.size()]});
    }
    try {
      backend_->map(mappings_.data(), mappings_.size());
    } catch (...) {
      free_pages_.insert(free_pages_.end(), taken_.begin(), taken_.end());
      throw;
    }
    size_t first = 0;  // index in taken_ of slot s's first new page
    for (size_t s = 0; s < count; ++s) {
      size_t add = missing_pages(s);
      for (size_t p = 0; p < add; ++p)
        for (size_t b = 0; b < config_.num_buffers; ++b)
          slot_pages_[s].push_back(taken_[first + b * add + p]);
      first += add * config_.num_buffers;
    }
    stats_.sync_page_maps += deficit;
    stats_.pages_mapped += deficit;
    stats_.pages_mapped_peak = std::max(stats_.pages_mapped_peak, stats_.pages_mapped);
  }
  size_t tokens = 0;
  for (size_t s = 0; s < count; ++s) {
    slot_tokens_[s] = seq_lens[s];
    tokens += seq_lens[s];
  }
  stats_.tokens_active = tokens;
  return true;
}

void PageManager::take_pages(size_t count, std::vector<uint32_t>& out) {
  out.clear();
  size_t from_free = std::min(count, free_pages_.size());
  out.insert(out.end(), free_pages_.end() - from_free, free_pages_.end());
  free_pages_.resize(free_pages_.size() - from_free);
  size_t to_create = count - from_free;
  if (to_create > 0) {
    try {
      backend_->create_pages(next_uncreated_, static_cast<uint32_t>(to_create));
    } catch (...) {
      free_pages_.insert(free_pages_.end(), out.begin(), out.end());
      throw;
    }
    for (size_t i = 0; i < to_create; ++i) out.push_back(next_uncreated_ + i);
    next_uncreated_ += static_cast<uint32_t>(to_create);
    stats_.pages_created = next_uncreated_;
  }
}

size_t PageManager::reclaim(size_t max_pages) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  return reclaim_locked(max_pages);
}

size_t PageManager::reclaim_locked(size_t want) {
  std::vector<size_t> victims;
  for (size_t s = 0; s < config_.num_slots; ++s)
    if (!slot_allocated_[s] && !slot_pages_[s].empty()) victims.push_back(s);
  if (victims.empty() || want == 0) return 0;
  // Smallest slots first: the big ones are what alloc_reqid hands out next.
  std::stable_sort(victims.begin(), victims.end(),
                   [&](size_t a, size_t b) { return slot_pages_[a].size() < slot_pages_[b].size(); });
  // A finished request's kernels may still be reading these pages.
  backend_->synchronize();
  size_t reclaimed = 0;
  std::vector<uintptr_t> addrs;
  for (size_t s : victims) {
    if (reclaimed >= want) break;
    size_t keep = mapped_of(s);
    while (keep > 0 && reclaimed < want) {
      --keep;
      reclaimed += config_.num_buffers;
    }
    addrs.clear();
    for (size_t p = keep; p < mapped_of(s); ++p)
      for (size_t b = 0; b < config_.num_buffers; ++b) addrs.push_back(page_address(b, s, p));
    backend_->unmap(addrs.data(), addrs.size());
    auto& pages = slot_pages_[s];
    free_pages_.insert(free_pages_.end(), pages.begin() + keep * config_.num_buffers, pages.end());
    pages.resize(keep * config_.num_buffers);
    stats_.reclaimed_pages += addrs.size();
    stats_.page_unmaps += addrs.size();
    stats_.pages_mapped -= addrs.size();
  }
  return reclaimed;
}

void PageManager::close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!reservation_) return;
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
  backend_->release_pages(0, next_uncreated_);
  backend_->close_pool();
  free_pages_.clear();
  next_uncreated_ = 0;
  stats_.pages_mapped = 0;
  stats_.slots_allocated = 0;
  stats_.tokens_active = 0;
  reservation_.reset();  // tensor views may still hold it; the range stays reserved until they go
  if (first_error) std::rethrow_exception(first_error);
}

bool PageManager::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !reservation_;
}

size_t PageManager::mapped_pages(int64_t slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  check_slot(slot, "mapped_pages");
  return mapped_of(slot);
}

bool PageManager::slot_allocated(int64_t slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  check_slot(slot, "is_allocated");
  return slot_allocated_[slot] != 0;
}

PageStats PageManager::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

std::shared_ptr<Reservation> PageManager::reservation() const {
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  return reservation_;
}

}  // namespace vattn
