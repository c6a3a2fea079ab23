#include "core/page_manager.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "common/errors.h"

namespace vattn {

namespace {

std::string range_text(int64_t lo, int64_t hi) {
  return "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}

size_t checked_mul(size_t a, size_t b, const char* what) {
  size_t out = 0;
  if (__builtin_mul_overflow(a, b, &out))
    throw std::invalid_argument(std::string(what) + " overflows 64-bit arithmetic");
  return out;
}

PolicyConfig checked_policy(PolicyConfig p, size_t max_tokens) {
  if (!(p.reclaim_threshold >= 0.0 && p.reclaim_threshold <= 1.0))
    throw std::invalid_argument("reclaim_threshold must be in [0, 1]");
  if (p.max_batch_ids == 0) throw std::invalid_argument("max_batch_ids must be positive");
  // Lengths are tokens of one request: more than max_context_len means nothing.
  p.lookahead_tokens = std::min(p.lookahead_tokens, max_tokens);
  p.eager_tokens = std::min(p.eager_tokens, max_tokens);
  return p;
}

const char* kForked =
    "this KV cache manager was created by another process: a forked child cannot use its "
    "parent's cache (create a new manager in the child)";

}  // namespace

// ---- construction and lifetime ------------------------------------------------------

PageManager::PageManager(std::shared_ptr<VmmBackend> backend, const PageManagerConfig& config,
                         const PolicyConfig& policy)
    : backend_(std::move(backend)),
      config_(config),
      policy_(checked_policy(policy, config.max_tokens)),
      page_size_(backend_->page_size()),
      num_ids_(config.num_buffers ? backend_->num_pages() / config.num_buffers : 0),
      reclaim_floor_ids_(static_cast<size_t>(std::ceil(policy_.reclaim_threshold * static_cast<double>(num_ids_)))),
      generation_(fork_generation()),
      sync_(std::make_unique<Sync>()) {
  const size_t nb = config_.num_buffers;
  if (nb == 0 || config_.num_slots == 0 || config_.bytes_per_token == 0 || config_.max_tokens == 0)
    throw std::invalid_argument("PageManager: num_buffers, num_slots, bytes_per_token and "
                                "max_tokens must all be positive");
  if (config_.max_tokens > static_cast<size_t>(INT64_MAX))
    throw std::invalid_argument("max_context_len must be below 2^63");
  size_t token_bytes = checked_mul(config_.max_tokens, config_.bytes_per_token, "max_context_len x token bytes");
  if (config_.slot_bytes == 0 || config_.slot_bytes % page_size_ != 0 || config_.slot_bytes < token_bytes)
    throw std::invalid_argument("PageManager: slot_bytes must be a multiple of page_size "
                                "covering max_tokens * bytes_per_token");
  if (num_ids_ == 0)
    throw std::invalid_argument("the physical pool must hold at least one page per buffer (" +
                                std::to_string(nb) + " pages)");
  if (num_ids_ >= kNoId) throw std::invalid_argument("the physical pool holds too many pages");
  size_t total = checked_mul(checked_mul(nb, config_.num_slots, "buffers x slots"), config_.slot_bytes,
                             "reservation size");
  memory_ = std::make_shared<CacheMemory>(backend_, total);
  base_ = memory_->base();
  slot_ids_.resize(config_.num_slots);
  slot_allocated_.assign(config_.num_slots, 0);
  slot_tokens_.assign(config_.num_slots, 0);
  slot_orphans_.assign(config_.num_slots, 0);
  slot_reads_.assign(config_.num_slots, VmmBackend::kNoReads);
  id_maps_.assign(num_ids_, 0);
  id_holds_.assign(num_ids_, 0);
  id_created_.assign(num_ids_, 0);
  if (!config_.external_ids) {
    uncreated_.reserve(num_ids_);
    free_ids_.reserve(num_ids_);
    for (size_t i = num_ids_; i > 0; --i) uncreated_.push_back(static_cast<uint32_t>(i - 1));
  }
  stats_.pages_total = num_ids_ * nb;
  stats_.pages_free_low = stats_.pages_total;
  work_epoch_ = 1;  // the mapper starts with work: the eager slot
  if (policy_.background && !config_.external_ids)
    sync_->mapper = std::thread(&PageManager::mapper_loop, this);
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

void PageManager::check_open() const {
  if (!memory_) throw ClosedError("the KV cache manager was cleaned up; create a new one");
}

void PageManager::check_usable() const {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
}

void PageManager::check_slot(int64_t slot, const char* what) const {
  if (slot < 0 || slot >= static_cast<int64_t>(config_.num_slots))
    throw std::invalid_argument(std::string(what) + ": reqid must be in " +
                                range_text(0, config_.num_slots - 1) + ", got " + std::to_string(slot));
}

void PageManager::check_allocated(int64_t slot, const char* what) const {
  check_slot(slot, what);
  if (!slot_allocated_[slot])
    throw std::invalid_argument(std::string(what) + ": reqid " + std::to_string(slot) +
                                " is not allocated (freed, or never returned by alloc_reqid)");
}

void PageManager::wait_for_batch(Lock& lock) {
  sync_->batch_done.wait(lock, [&] { return !inflight_; });
  check_open();  // cleanup() may have run while this thread waited
}

size_t PageManager::positions_for_tokens(int64_t tokens) const {
  size_t bytes = static_cast<size_t>(tokens) * config_.bytes_per_token;  // <= slot_bytes: no overflow
  return (bytes + page_size_ - 1) / page_size_;
}

int64_t PageManager::tokens_in_positions(size_t positions) const {
  size_t tokens = positions * page_size_ / config_.bytes_per_token;  // <= slot_bytes / token bytes
  return static_cast<int64_t>(std::min(tokens, config_.max_tokens));
}

size_t PageManager::shareable_positions(int64_t num_tokens) const {
  size_t whole = static_cast<size_t>(num_tokens) * config_.bytes_per_token / page_size_;
  // p pages end on a token boundary iff p is a multiple of bytes_per_token / gcd.
  size_t period = config_.bytes_per_token / std::gcd(page_size_, config_.bytes_per_token);
  return whole - whole % period;
}

size_t PageManager::lookahead_positions(size_t s) const {
  size_t tokens = static_cast<size_t>(slot_tokens_[s]) + policy_.lookahead_tokens;  // both <= max_tokens
  return positions_for_tokens(static_cast<int64_t>(std::min(tokens, config_.max_tokens)));
}

size_t PageManager::first_shared(size_t slot) const {
  const auto& ids = slot_ids_[slot];
  for (size_t p = 0; p < ids.size(); ++p)
    if (id_maps_[ids[p]] + id_holds_[ids[p]] > 1) return p;
  return ids.size();
}

// ---- reference counts ---------------------------------------------------------------

void PageManager::note_in_use() {
  stats_.pages_mapped_peak = std::max(stats_.pages_mapped_peak, stats_.pages_mapped);
  stats_.pages_free_low = std::min(stats_.pages_free_low, stats_.pages_total - stats_.pages_in_use);
}

void PageManager::add_map_ref(uint32_t id) {
  if (id_maps_[id]++ == 0) stats_.pages_mapped += config_.num_buffers;
  if (id_maps_[id] + id_holds_[id] == 1) stats_.pages_in_use += config_.num_buffers;
  note_in_use();
}

void PageManager::add_hold(uint32_t id) {
  if (id_holds_[id]++ == 0 && id_maps_[id] == 0) stats_.pages_in_use += config_.num_buffers;
  note_in_use();
}

void PageManager::drop_map_ref(uint32_t id) {
  if (--id_maps_[id] == 0) stats_.pages_mapped -= config_.num_buffers;
  release_if_unreferenced(id);
}

void PageManager::drop_hold(uint32_t id) {
  --id_holds_[id];
  release_if_unreferenced(id);
}

void PageManager::release_if_unreferenced(uint32_t id) {
  if (id_maps_[id] + id_holds_[id] != 0) return;
  stats_.pages_in_use -= config_.num_buffers;
  if (!config_.external_ids) free_ids_.push_back(id);  // external ids stay the caller's
}

// ---- the pool -------------------------------------------------------------------------

std::vector<uint32_t> PageManager::claim_ids(size_t count, std::vector<uint32_t>& to_create) {
  std::vector<uint32_t> out;
  out.reserve(count);
  size_t from_free = std::min(count, free_ids_.size());
  out.insert(out.end(), free_ids_.end() - from_free, free_ids_.end());
  free_ids_.resize(free_ids_.size() - from_free);
  for (size_t i = from_free; i < count; ++i) {
    out.push_back(uncreated_.back());
    to_create.push_back(uncreated_.back());
    uncreated_.pop_back();
  }
  return out;
}

void PageManager::return_fresh(const std::vector<uint32_t>& ids) {
  bool uncreated_back = false;
  for (uint32_t id : ids) {
    if (id_maps_[id] + id_holds_[id] != 0) continue;  // an orphan kept it
    if (id_created_[id]) {
      free_ids_.push_back(id);
    } else {
      uncreated_.push_back(id);
      uncreated_back = true;
    }
  }
  // Keep the smallest uncreated id at the back: fresh runs stay consecutive.
  if (uncreated_back) std::sort(uncreated_.begin(), uncreated_.end(), std::greater<uint32_t>());
}

void PageManager::create_ids(const std::vector<uint32_t>& ids) {
  std::vector<uint32_t> pages;
  pages.reserve(ids.size() * config_.num_buffers);
  for (size_t b = 0; b < config_.num_buffers; ++b)
    for (uint32_t id : ids) pages.push_back(physical(b, id));
  backend_->create_pages(pages.data(), pages.size());
}

void PageManager::mark_created(const std::vector<uint32_t>& ids) {
  for (uint32_t id : ids) id_created_[id] = 1;
  stats_.pages_created += ids.size() * config_.num_buffers;
}

// ---- mapping --------------------------------------------------------------------------

std::vector<PageMapping> PageManager::mappings_for(const std::vector<MapJob>& jobs) const {
  // Job by job, buffer-major: each buffer's new positions of a slot are one
  // address run, and fresh ids are consecutive along it, so the host merges
  // the mappings and CUDA grants access once per run.
  std::vector<PageMapping> out;
  for (const MapJob& job : jobs)
    for (size_t b = 0; b < config_.num_buffers; ++b)
      for (size_t i = 0; i < job.ids.size(); ++i)
        out.push_back(PageMapping{address(b, job.slot, job.from + i), physical(b, job.ids[i])});
  return out;
}

void PageManager::finish_map(std::vector<MapJob>& jobs, const std::vector<PageMapping>& mappings,
                             size_t done, bool background) {
  const size_t nb = config_.num_buffers;
  size_t at = 0;
  for (MapJob& job : jobs) {
    const size_t n_ids = job.ids.size(), n = n_ids * nb;
    if (at + n <= done) {
      for (uint32_t id : job.ids) {
        slot_ids_[job.slot].push_back(id);
        add_map_ref(id);
      }
      stats_.page_slots_mapped += n;
      (background ? stats_.background_page_maps : stats_.sync_page_maps) += n;
    } else {
      size_t mapped_here = done > at ? done - at : 0;
      if (mapped_here > 0) {
        // Undo this job's mapped part so the slot's prefix stays exact; what
        // cannot be undone is kept as orphans.
        std::vector<uintptr_t> addrs;
        for (size_t e = 0; e < mapped_here; ++e) addrs.push_back(mappings[at + e].addr);
        size_t undone = 0;
        try {
          backend_->unmap(addrs.data(), addrs.size(), &undone);
        } catch (...) {
          // The failure is the original error's consequence; orphans record it.
        }
        std::vector<Orphan> kept;
        for (size_t e = undone; e < mapped_here; ++e) {
          size_t i = e % n_ids;
          auto it = std::find_if(kept.begin(), kept.end(), [&](const Orphan& o) { return o.pos == job.from + i; });
          if (it == kept.end()) {
            kept.push_back(Orphan{job.slot, job.from + i, job.ids[i], {}});
            it = kept.end() - 1;
          }
          it->addrs.push_back(addrs[e]);
        }
        for (Orphan& o : kept) {
          add_map_ref(o.id);
          stats_.page_slots_mapped += o.addrs.size();
          stats_.pages_orphaned += o.addrs.size();
          slot_orphans_[o.slot]++;
          orphans_.push_back(std::move(o));
        }
      }
      return_fresh(std::vector<uint32_t>(job.ids.end() - job.fresh, job.ids.end()));
    }
    at += n;
  }
}

void PageManager::map_jobs_locked(std::vector<MapJob>& jobs, std::vector<uint32_t>& to_create) {
  if (!to_create.empty()) {
    try {
      create_ids(to_create);
    } catch (...) {
      for (MapJob& job : jobs) return_fresh(std::vector<uint32_t>(job.ids.end() - job.fresh, job.ids.end()));
      throw;
    }
    mark_created(to_create);
  }
  std::vector<PageMapping> mappings = mappings_for(jobs);
  size_t done = 0;
  std::exception_ptr error;
  try {
    backend_->map(mappings.data(), mappings.size(), &done);
  } catch (...) {
    error = std::current_exception();
  }
  finish_map(jobs, mappings, error ? done : mappings.size(), false);
  if (error) std::rethrow_exception(error);
}

// ---- unmapping ------------------------------------------------------------------------

void PageManager::cut_tail(size_t slot, size_t keep, std::vector<Cut>& cuts) {
  auto& ids = slot_ids_[slot];
  if (ids.size() <= keep) return;
  cuts.push_back(Cut{slot, keep, std::vector<uint32_t>(ids.begin() + keep, ids.end())});
  ids.resize(keep);
}

std::vector<uintptr_t> PageManager::addresses_of(const std::vector<Cut>& cuts) const {
  std::vector<uintptr_t> out;
  for (const Cut& cut : cuts)
    for (size_t b = 0; b < config_.num_buffers; ++b)
      for (size_t i = 0; i < cut.ids.size(); ++i) out.push_back(address(b, cut.slot, cut.from + i));
  return out;
}

void PageManager::finish_unmap(std::vector<Cut>& cuts, const std::vector<uintptr_t>& addrs, size_t done) {
  const size_t nb = config_.num_buffers;
  size_t at = 0;
  for (Cut& cut : cuts) {
    const size_t n_ids = cut.ids.size();
    for (size_t i = 0; i < n_ids; ++i) {
      std::vector<uintptr_t> still;
      for (size_t b = 0; b < nb; ++b)
        if (at + b * n_ids + i >= done) still.push_back(addrs[at + b * n_ids + i]);
      size_t gone = nb - still.size();
      stats_.page_slots_mapped -= gone;
      stats_.page_unmaps += gone;
      if (still.empty()) {
        drop_map_ref(cut.ids[i]);
      } else {  // the position's mapping reference moves to the orphan
        stats_.pages_orphaned += still.size();
        slot_orphans_[cut.slot]++;
        orphans_.push_back(Orphan{cut.slot, cut.from + i, cut.ids[i], std::move(still)});
      }
    }
    at += n_ids * nb;
  }
}

uint64_t PageManager::reads_of(size_t slot) const {
  return slot_allocated_[slot] ? VmmBackend::kReadsNow : slot_reads_[slot];
}

void PageManager::unmap_tails_locked(const std::vector<std::pair<size_t, size_t>>& slot_keep) {
  bool any = false;
  uint64_t reads = VmmBackend::kNoReads;  // fences are ordered: the latest covers the others
  for (auto [slot, keep] : slot_keep) {
    if (mapped_of(slot) <= keep) continue;
    any = true;
    reads = std::max(reads, reads_of(slot));
  }
  if (!any) return;
  // A finished request's kernels may still read these pages. If this fails,
  // nothing has changed yet.
  backend_->wait_reads(reads);
  std::vector<Cut> cuts;
  for (auto [slot, keep] : slot_keep) cut_tail(slot, keep, cuts);
  std::vector<uintptr_t> addrs = addresses_of(cuts);
  size_t done = 0;
  std::exception_ptr error;
  try {
    backend_->unmap(addrs.data(), addrs.size(), &done);
  } catch (...) {
    error = std::current_exception();
  }
  finish_unmap(cuts, addrs, error ? done : addrs.size());
  if (error) std::rethrow_exception(error);
}

void PageManager::settle_orphans_locked(int64_t slot) {
  auto matches = [&](const Orphan& o) { return slot < 0 || o.slot == static_cast<size_t>(slot); };
  if (std::none_of(orphans_.begin(), orphans_.end(), matches)) return;
  backend_->synchronize();
  std::exception_ptr first_error;
  for (size_t k = 0; k < orphans_.size();) {
    Orphan& o = orphans_[k];
    if (!matches(o)) {
      ++k;
      continue;
    }
    size_t done = 0;
    try {
      backend_->unmap(o.addrs.data(), o.addrs.size(), &done);
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
    o.addrs.erase(o.addrs.begin(), o.addrs.begin() + done);
    stats_.page_slots_mapped -= done;
    stats_.page_unmaps += done;
    stats_.pages_orphaned -= done;
    if (!o.addrs.empty()) {
      ++k;
      continue;
    }
    uint32_t id = o.id;
    slot_orphans_[o.slot]--;
    orphans_.erase(orphans_.begin() + k);
    drop_map_ref(id);
  }
  if (first_error) std::rethrow_exception(first_error);
}

std::vector<std::pair<size_t, size_t>> PageManager::plan_reclaim(size_t want, int64_t keep_slot,
                                                                 size_t max_positions, size_t* freed) const {
  std::vector<std::pair<size_t, size_t>> out;
  *freed = 0;
  if (want == 0 || config_.external_ids) return out;
  std::vector<size_t> victims;
  for (size_t s = 0; s < config_.num_slots; ++s)
    if (!slot_allocated_[s] && !slot_ids_[s].empty() && static_cast<int64_t>(s) != keep_slot)
      victims.push_back(s);
  // Smallest slots first: the big ones are what alloc_reqid hands out next.
  std::stable_sort(victims.begin(), victims.end(),
                   [&](size_t a, size_t b) { return slot_ids_[a].size() < slot_ids_[b].size(); });
  std::unordered_map<uint32_t, uint32_t> cut_refs;  // references the plan removes, per id
  size_t positions = 0;
  for (size_t s : victims) {
    if (*freed >= want || positions >= max_positions) break;
    size_t keep = slot_ids_[s].size();
    while (keep > 0 && *freed < want && positions < max_positions) {
      uint32_t id = slot_ids_[s][--keep];
      if (++cut_refs[id] == id_maps_[id] && id_holds_[id] == 0) ++*freed;
      ++positions;
    }
    out.emplace_back(s, keep);
  }
  return out;
}

size_t PageManager::reclaim_locked(size_t want, int64_t keep_slot) {
  size_t freed = 0;
  auto plan = plan_reclaim(want, keep_slot, SIZE_MAX, &freed);
  const size_t before = available_ids();
  std::exception_ptr error;
  try {
    unmap_tails_locked(plan);
  } catch (...) {
    error = std::current_exception();
  }
  const size_t got = available_ids() - before;
  stats_.reclaimed_pages += got * config_.num_buffers;
  if (error) std::rethrow_exception(error);
  return got;
}

void PageManager::trim_for_new_request_locked(size_t slot, size_t keep) {
  // A new request writes every position it uses: a page shared with another
  // slot or a handle must not be among them.
  keep = std::min(keep, first_shared(slot));
  if (slot_orphans_[slot]) settle_orphans_locked(static_cast<int64_t>(slot));
  unmap_tails_locked({{slot, keep}});
}

size_t PageManager::reclaim(size_t max_ids) {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  wait_for_batch(lock);
  const size_t before = available_ids();
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
  const size_t got = available_ids() - before;
  if (got > 0) {
    work_epoch_++;  // freed pages may let the mapper do what it had no room for
    sync_->wake.notify_one();
  }
  if (error) std::rethrow_exception(error);
  return got * config_.num_buffers;
}

// ---- slots --------------------------------------------------------------------------

int64_t PageManager::best_free_slot(int64_t prompt_tokens) const {
  const size_t want = prompt_tokens < 0 ? 0 : positions_for_tokens(prompt_tokens);
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
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  if (prompt_tokens > static_cast<int64_t>(config_.max_tokens))
    throw std::invalid_argument("alloc_reqid: prompt_len must be in " + range_text(0, config_.max_tokens) +
                                ", got " + std::to_string(prompt_tokens));
  int64_t slot = -1;
  if (wanted_slot >= 0) {  // the caller owns slot numbering (a framework's block id)
    check_slot(wanted_slot, "alloc_reqid");
    auto check_free = [&] {
      if (slot_allocated_[wanted_slot])
        throw std::invalid_argument("alloc_reqid: reqid " + std::to_string(wanted_slot) + " is already allocated");
    };
    check_free();
    // An eager batch may be landing on this slot: let it, then trim it.
    if (inflight_) {
      wait_for_batch(lock);
      check_free();
    }
    slot = wanted_slot;
    // Such a caller counts pages by its own lengths: the slot must not bring
    // more pages than the request's first tokens need.
    if (!config_.external_ids)
      trim_for_new_request_locked(slot, positions_for_tokens(std::max<int64_t>(prompt_tokens, 0)));
  } else {
    while (true) {
      slot = best_free_slot(prompt_tokens);
      if (slot < 0 || config_.external_ids) break;
      if (first_shared(slot) >= mapped_of(slot) && slot_orphans_[slot] == 0) break;
      if (inflight_) {
        wait_for_batch(lock);
        continue;  // the choice may have changed while waiting
      }
      trim_for_new_request_locked(slot, mapped_of(slot));
      break;
    }
    if (slot < 0)
      throw OutOfSlots("alloc_reqid: all " + std::to_string(config_.num_slots) +
                       " reqids are in use (max_batch_size); free one with free_reqid");
  }
  slot_allocated_[slot] = 1;
  slot_tokens_[slot] = 0;
  stats_.slots_allocated++;
  work_epoch_++;  // the eager target moved on
  sync_->wake.notify_one();
  return slot;
}

void PageManager::free_slot(int64_t slot) {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  check_allocated(slot, "free_reqid");
  slot_allocated_[slot] = 0;
  // Every kernel that reads this request's pages has been queued by now.
  slot_reads_[slot] = backend_->record_reads();
  stats_.tokens_active -= static_cast<size_t>(slot_tokens_[slot]);
  slot_tokens_[slot] = 0;
  stats_.slots_allocated--;
  work_epoch_++;
  sync_->wake.notify_one();
  if (policy_.deferred_reclaim || config_.external_ids || mapped_of(slot) == 0) return;
  // The request is over whatever happens below; a failed unmap leaves pages
  // mapped in the free slot (or as orphans) to be retried.
  wait_for_batch(lock);
  if (!slot_allocated_[slot]) unmap_tails_locked({{static_cast<size_t>(slot), 0}});
}

// ---- step -------------------------------------------------------------------------------

bool PageManager::step(const int64_t* seq_lens, size_t count) {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  if (config_.external_ids)
    throw std::invalid_argument("step: this manager's page ids are owned by the caller "
                                "(page_allocator='external'); map them with map_pages");
  if (count != config_.num_slots)
    throw std::invalid_argument("step: seq_lens must have max_batch_size = " + std::to_string(config_.num_slots) +
                                " entries, got " + std::to_string(count));
  // Per-thread scratch: several threads may step at once, and a step can wait
  // (releasing the mutex) between computing and using it.
  thread_local std::vector<size_t> need;
  need.resize(count);
  size_t deficit = 0;  // page ids (positions) to map, all slots together
  while (true) {
    // Validated after every wait too: another thread may have freed a reqid.
    deficit = 0;
    for (size_t s = 0; s < count; ++s) {
      int64_t len = seq_lens[s];
      if (len < 0 || len > static_cast<int64_t>(config_.max_tokens))
        throw std::invalid_argument("step: seq_lens[" + std::to_string(s) + "] must be in " +
                                    range_text(0, config_.max_tokens) + " (max_context_len), got " +
                                    std::to_string(len));
      if (len > 0 && !slot_allocated_[s])
        throw std::invalid_argument("step: seq_lens[" + std::to_string(s) + "] = " + std::to_string(len) +
                                    " but reqid " + std::to_string(s) +
                                    " is not allocated (use 0 for inactive reqids)");
      need[s] = positions_for_tokens(len);
      if (need[s] > mapped_of(s)) deficit += need[s] - mapped_of(s);
    }
    if (mapper_error_) {
      std::exception_ptr error = mapper_error_;
      mapper_error_ = nullptr;
      std::rethrow_exception(error);
    }
    if (deficit == 0 || !inflight_) break;
    // The batch may be mapping exactly these pages: let it land, then look again.
    auto t0 = std::chrono::steady_clock::now();
    wait_for_batch(lock);
    stats_.step_wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::steady_clock::now() - t0).count();
  }
  stats_.step_calls++;
  if (deficit > 0) {
    if (deficit > available_ids()) {
      size_t reclaimable = 0;
      auto plan = plan_reclaim(deficit - available_ids(), -1, SIZE_MAX, &reclaimable);
      if (available_ids() + reclaimable < deficit) {
        stats_.failed_steps++;
        return false;
      }
      reclaim_locked(deficit - available_ids(), -1);  // last resort, on the critical path
    }
    // Addresses left mapped by an earlier failure are retried before anything
    // is claimed: a throw here must not strand claimed ids.
    for (size_t s = 0; s < count; ++s)
      if (need[s] > mapped_of(s) && slot_orphans_[s]) settle_orphans_locked(static_cast<int64_t>(s));
    std::vector<MapJob> jobs;
    std::vector<uint32_t> to_create;
    for (size_t s = 0; s < count; ++s) {
      if (need[s] <= mapped_of(s)) continue;
      size_t add = need[s] - mapped_of(s);
      jobs.push_back(MapJob{s, mapped_of(s), claim_ids(add, to_create), add});
    }
    map_jobs_locked(jobs, to_create);
  }
  // The mapper is woken only when this step gave it work: the pool changed
  // (pages mapped here: reserve, eager and reclaim floor may need attention) or
  // some slot's lookahead now reaches past its mapping. A decode step inside a
  // page does neither, and skips the wake-up.
  bool mapper_work = deficit > 0;
  size_t tokens = 0;
  for (size_t s = 0; s < count; ++s) {
    if (!slot_allocated_[s]) continue;
    // A 0 means "not in this step", not "empty": threads may step disjoint reqids.
    if (seq_lens[s] > 0) slot_tokens_[s] = seq_lens[s];
    tokens += static_cast<size_t>(slot_tokens_[s]);
    if (slot_tokens_[s] > 0 && lookahead_positions(s) > mapped_of(s)) mapper_work = true;
  }
  stats_.tokens_active = tokens;
  if (policy_.background && mapper_work) {
    work_epoch_++;
    sync_->wake.notify_one();
  }
  return true;
}

// ---- shared pages ---------------------------------------------------------------------

int64_t PageManager::fork(int64_t src, int64_t num_tokens) {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  if (config_.external_ids)
    throw std::invalid_argument("fork: this manager's page ids are owned by the caller "
                                "(page_allocator='external')");
  auto validate = [&] {
    check_allocated(src, "fork");
    int64_t mapped = tokens_in_positions(mapped_of(src));
    if (num_tokens < 0 || num_tokens > mapped)
      throw std::invalid_argument("fork: num_tokens must be in " + range_text(0, mapped) +
                                  " (tokens mapped for reqid " + std::to_string(src) + "), got " +
                                  std::to_string(num_tokens));
  };
  validate();
  wait_for_batch(lock);
  validate();
  const size_t shared = shareable_positions(num_tokens);
  const size_t total = positions_for_tokens(num_tokens);
  const size_t fresh = total - shared;
  // The free slot with the fewest mapped positions: everything it maps is
  // replaced.
  int64_t dst = -1;
  for (size_t s = 0; s < config_.num_slots; ++s)
    if (!slot_allocated_[s] && (dst < 0 || mapped_of(s) < mapped_of(dst))) dst = static_cast<int64_t>(s);
  if (dst < 0)
    throw OutOfSlots("fork: all " + std::to_string(config_.num_slots) +
                     " reqids are in use (max_batch_size); free one with free_reqid");
  size_t own = 0;  // ids only dst references: truncating it frees them
  for (uint32_t id : slot_ids_[dst]) own += id_maps_[id] == 1 && id_holds_[id] == 0;
  size_t reclaimable = 0;
  if (available_ids() + own < fresh) plan_reclaim(fresh - available_ids() - own, dst, SIZE_MAX, &reclaimable);
  if (available_ids() + own + reclaimable < fresh)
    throw OutOfPages("fork: the page pool cannot supply the " + std::to_string(fresh) +
                     " page(s) per buffer the copied tail of " + std::to_string(num_tokens) +
                     " tokens needs; free requests or raise physical_memory");
  const size_t d = static_cast<size_t>(dst);
  if (slot_orphans_[d]) settle_orphans_locked(dst);
  unmap_tails_locked({{d, 0}});
  if (available_ids() < fresh) reclaim_locked(fresh - available_ids(), dst);
  if (available_ids() < fresh) throw OutOfPages("fork: the page pool ran out while reclaiming");
  std::vector<uint32_t> to_create;
  std::vector<MapJob> jobs;
  jobs.push_back(MapJob{d, 0, std::vector<uint32_t>(slot_ids_[src].begin(), slot_ids_[src].begin() + shared), 0});
  jobs.push_back(MapJob{d, shared, claim_ids(fresh, to_create), fresh});
  try {
    map_jobs_locked(jobs, to_create);
    if (fresh > 0) {
      backend_->synchronize();  // the source's last tokens must have been written
      for (size_t b = 0; b < config_.num_buffers; ++b)
        backend_->copy(address(b, d, shared), address(b, static_cast<size_t>(src), shared), fresh * page_size_);
    }
  } catch (...) {
    try {
      unmap_tails_locked({{d, 0}});  // nothing half-done: dst stays free and empty
    } catch (...) {
    }
    throw;
  }
  slot_allocated_[d] = 1;
  slot_tokens_[d] = num_tokens;
  stats_.slots_allocated++;
  stats_.tokens_active += static_cast<size_t>(num_tokens);
  stats_.forks++;
  stats_.pages_copied += fresh * config_.num_buffers;
  work_epoch_++;
  sync_->wake.notify_one();
  return dst;
}

std::pair<uint64_t, int64_t> PageManager::retain_prefix(int64_t slot, int64_t num_tokens) {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  if (config_.external_ids)
    throw std::invalid_argument("retain_prefix: this manager's page ids are owned by the caller "
                                "(page_allocator='external')");
  check_allocated(slot, "retain_prefix");
  int64_t mapped = tokens_in_positions(mapped_of(slot));
  if (num_tokens < 0 || num_tokens > mapped)
    throw std::invalid_argument("retain_prefix: num_tokens must be in " + range_text(0, mapped) +
                                " (tokens mapped for reqid " + std::to_string(slot) + "), got " +
                                std::to_string(num_tokens));
  const size_t shared = shareable_positions(num_tokens);
  std::vector<uint32_t> ids(slot_ids_[slot].begin(), slot_ids_[slot].begin() + shared);
  for (uint32_t id : ids) add_hold(id);
  uint64_t handle = next_handle_++;
  handles_.emplace(handle, std::move(ids));
  stats_.prefix_handles = handles_.size();
  return {handle, tokens_in_positions(shared)};
}

int64_t PageManager::attach_prefix(uint64_t handle, int64_t slot) {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  auto validate = [&] {
    if (!handles_.count(handle))
      throw std::invalid_argument("attach_prefix: the prefix handle was released");
    check_allocated(slot, "attach_prefix");
    if (slot_tokens_[slot] > 0)
      throw std::invalid_argument("attach_prefix: reqid " + std::to_string(slot) + " already holds " +
                                  std::to_string(slot_tokens_[slot]) +
                                  " tokens; attach to a freshly allocated reqid");
  };
  validate();
  wait_for_batch(lock);
  validate();
  const std::vector<uint32_t> ids = handles_.at(handle);
  const size_t s = static_cast<size_t>(slot);
  if (slot_orphans_[s]) settle_orphans_locked(slot);
  size_t same = 0;
  while (same < std::min(mapped_of(s), ids.size()) && slot_ids_[s][same] == ids[same]) ++same;
  unmap_tails_locked({{s, same}});
  std::vector<MapJob> jobs{MapJob{s, same, std::vector<uint32_t>(ids.begin() + same, ids.end()), 0}};
  std::vector<uint32_t> none;
  map_jobs_locked(jobs, none);
  int64_t tokens = tokens_in_positions(ids.size());
  slot_tokens_[s] = tokens;
  stats_.tokens_active += static_cast<size_t>(tokens);
  return tokens;
}

void PageManager::release_prefix(uint64_t handle) {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  auto it = handles_.find(handle);
  if (it == handles_.end()) return;  // released already, or by cleanup()
  for (uint32_t id : it->second) drop_hold(id);
  handles_.erase(it);
  stats_.prefix_handles = handles_.size();
  work_epoch_++;
  sync_->wake.notify_one();
}

std::vector<uint32_t> PageManager::prefix_ids(uint64_t handle) const {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  auto it = handles_.find(handle);
  if (it == handles_.end()) throw std::invalid_argument("the prefix handle was released");
  return it->second;
}

void PageManager::map_ids(const int64_t* slots, const int64_t* starts, const int64_t* offsets, size_t count,
                          const uint32_t* ids, size_t num_ids_given) {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  const size_t slot_positions = config_.slot_bytes / page_size_;
  auto validate = [&] {
    if (offsets[0] != 0 || static_cast<size_t>(offsets[count]) != num_ids_given)
      throw std::invalid_argument("map_pages: counts must add up to len(page_ids) = " +
                                  std::to_string(num_ids_given));
    std::vector<uint8_t> seen(config_.num_slots, 0);
    for (size_t i = 0; i < count; ++i) {
      check_allocated(slots[i], "map_pages");
      if (seen[slots[i]]++)
        throw std::invalid_argument("map_pages: reqid " + std::to_string(slots[i]) + " appears twice");
      int64_t n = offsets[i + 1] - offsets[i];
      int64_t mapped = static_cast<int64_t>(mapped_of(slots[i]));
      if (n < 0) throw std::invalid_argument("map_pages: counts must be >= 0");
      if (starts[i] < 0 || starts[i] > mapped)
        throw std::invalid_argument("map_pages: starts[" + std::to_string(i) + "] must be in " +
                                    range_text(0, mapped) + " (positions mapped for reqid " +
                                    std::to_string(slots[i]) + "), got " + std::to_string(starts[i]));
      if (static_cast<size_t>(starts[i] + n) > slot_positions)
        throw std::invalid_argument("map_pages: reqid " + std::to_string(slots[i]) + " has " +
                                    std::to_string(slot_positions) + " page positions; starts[" +
                                    std::to_string(i) + "] + count = " + std::to_string(starts[i] + n));
    }
    for (size_t k = 0; k < num_ids_given; ++k) {
      if (ids[k] >= num_ids_)
        throw std::invalid_argument("map_pages: page_ids[" + std::to_string(k) + "] must be in " +
                                    range_text(0, num_ids_ - 1) + " (num_page_ids), got " + std::to_string(ids[k]));
      if (!config_.external_ids && id_maps_[ids[k]] + id_holds_[ids[k]] == 0)
        throw std::invalid_argument("map_pages: page_ids[" + std::to_string(k) + "] = " + std::to_string(ids[k]) +
                                    " is not in use (managed page ids must be mapped in some reqid "
                                    "or held by a prefix handle)");
    }
  };
  validate();
  if (inflight_) {
    wait_for_batch(lock);
    validate();
  }
  if (config_.external_ids) {  // pages are created on first use
    std::vector<uint32_t> missing;
    for (size_t k = 0; k < num_ids_given; ++k)
      if (!id_created_[ids[k]]) {
        missing.push_back(ids[k]);
        id_created_[ids[k]] = 2;  // dedupe marker, reset below
      }
    for (uint32_t id : missing) id_created_[id] = 0;
    if (!missing.empty()) {
      create_ids(missing);
      mark_created(missing);
    }
  }
  std::vector<std::pair<size_t, size_t>> cuts;
  std::vector<MapJob> jobs;
  for (size_t i = 0; i < count; ++i) {
    const size_t s = static_cast<size_t>(slots[i]), start = static_cast<size_t>(starts[i]);
    const size_t n = static_cast<size_t>(offsets[i + 1] - offsets[i]);
    const uint32_t* row = ids + offsets[i];
    size_t same = 0;
    while (same < n && start + same < mapped_of(s) && slot_ids_[s][start + same] == row[same]) ++same;
    if (same == n) continue;
    if (slot_orphans_[s]) settle_orphans_locked(slots[i]);
    cuts.emplace_back(s, start + same);
    jobs.push_back(MapJob{s, start + same, std::vector<uint32_t>(row + same, row + n), 0});
  }
  unmap_tails_locked(cuts);
  std::vector<uint32_t> none;
  map_jobs_locked(jobs, none);
}

void PageManager::truncate(const int64_t* slots, const int64_t* keep, size_t count) {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  for (size_t i = 0; i < count; ++i) {
    check_slot(slots[i], "unmap_pages");
    if (keep[i] < 0) throw std::invalid_argument("unmap_pages: keep must be >= 0, got " + std::to_string(keep[i]));
  }
  wait_for_batch(lock);
  std::vector<std::pair<size_t, size_t>> cuts;
  for (size_t i = 0; i < count; ++i) cuts.emplace_back(static_cast<size_t>(slots[i]), static_cast<size_t>(keep[i]));
  for (auto [s, k] : cuts)
    if (slot_orphans_[s]) settle_orphans_locked(static_cast<int64_t>(s));
  unmap_tails_locked(cuts);
  work_epoch_++;
  sync_->wake.notify_one();
}

std::vector<uint32_t> PageManager::slot_ids(int64_t slot) const {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  check_slot(slot, "page_ids");
  return slot_ids_[slot];
}

// ---- background mapper ------------------------------------------------------------------

PageManager::Batch PageManager::plan_batch() {
  Batch batch;
  const int64_t eager_slot = policy_.eager ? best_free_slot(-1) : -1;
  // 1. Deferred reclamation: keep free slots' pages until the pool runs low.
  if (policy_.deferred_reclaim && available_ids() < reclaim_floor_ids_) {
    size_t freed = 0;
    auto plan = plan_reclaim(reclaim_floor_ids_ - available_ids(), eager_slot, policy_.max_batch_ids, &freed);
    if (!plan.empty()) {
      for (auto [s, keep] : plan) batch.reads = std::max(batch.reads, reads_of(s));
      for (auto [s, keep] : plan) cut_tail(s, keep, batch.cuts);
      batch.unmap_addrs = addresses_of(batch.cuts);
      return batch;
    }
  }
  // 2. Lookahead for active slots, then 3. the eager slot, within the budget.
  const size_t budget = std::min(policy_.max_batch_ids, available_ids());
  size_t planned = 0;
  std::vector<std::pair<size_t, size_t>> grows;  // (slot, positions to add)
  auto grow = [&](size_t s, size_t target, size_t limit) {
    size_t have = mapped_of(s);
    if (target <= have || planned >= limit || slot_orphans_[s]) return;
    size_t add = std::min(target - have, limit - planned);
    grows.emplace_back(s, add);
    planned += add;
  };
  for (size_t s = 0; s < config_.num_slots; ++s)
    if (slot_allocated_[s] && slot_tokens_[s] > 0) grow(s, lookahead_positions(s), budget);
  if (eager_slot >= 0 && first_shared(static_cast<size_t>(eager_slot)) == mapped_of(eager_slot)) {
    // Eager pages are speculative: they never eat into the reclaim floor.
    size_t spare = available_ids() - planned;  // planned <= budget <= available
    size_t above_floor = spare > reclaim_floor_ids_ ? spare - reclaim_floor_ids_ : 0;
    grow(static_cast<size_t>(eager_slot), positions_for_tokens(static_cast<int64_t>(policy_.eager_tokens)),
         std::min(budget, planned + above_floor));
  }
  if (planned == 0) {
    // 4. Keep one created page id per active request in the free pool: the
    // next page-crossing wave then only maps. Creation needs no address, so
    // it can run while steps proceed.
    size_t active = 0;
    for (size_t s = 0; s < config_.num_slots; ++s) active += slot_allocated_[s];
    if (free_ids_.size() < active && !uncreated_.empty()) {
      size_t n = std::min({active - free_ids_.size(), uncreated_.size(), policy_.max_batch_ids});
      for (size_t i = 0; i < n; ++i) {
        batch.to_create.push_back(uncreated_.back());
        uncreated_.pop_back();
      }
    }
    return batch;
  }
  for (auto [s, add] : grows) {
    batch.jobs.push_back(MapJob{s, mapped_of(s), claim_ids(add, batch.to_create), add});
  }
  batch.mappings = mappings_for(batch.jobs);
  return batch;
}

void PageManager::run_batch(Batch& batch, size_t* done) {
  *done = 0;
  if (!batch.cuts.empty()) {
    backend_->wait_reads(batch.reads);  // see unmap_tails_locked
    backend_->unmap(batch.unmap_addrs.data(), batch.unmap_addrs.size(), done);
    return;
  }
  if (!batch.to_create.empty()) {
    create_ids(batch.to_create);  // all or nothing
    batch.created = true;
  }
  if (!batch.mappings.empty()) backend_->map(batch.mappings.data(), batch.mappings.size(), done);
}

void PageManager::commit_batch(Batch& batch, size_t done, std::exception_ptr error) {
  stats_.mapper_batches++;
  if (error) {
    stats_.mapper_errors++;
    mapper_error_ = error;
  }
  if (!batch.cuts.empty()) {
    const size_t before = available_ids();
    finish_unmap(batch.cuts, batch.unmap_addrs, error ? done : batch.unmap_addrs.size());
    const size_t pages = (available_ids() - before) * config_.num_buffers;
    stats_.reclaimed_pages += pages;
    stats_.background_reclaimed_pages += pages;
    return;
  }
  if (batch.created) mark_created(batch.to_create);
  if (batch.jobs.empty()) {  // a create batch: its pages join the pool (or go back uncreated)
    return_fresh(batch.to_create);
    return;
  }
  if (!batch.to_create.empty() && !batch.created) {  // creation failed: nothing was mapped
    for (MapJob& job : batch.jobs) return_fresh(job.ids);
    return;
  }
  finish_map(batch.jobs, batch.mappings, error ? done : batch.mappings.size(), true);
}

void PageManager::mapper_loop() {
  Lock lock(sync_->mu);
  while (true) {
    mapper_idle_ = true;
    sync_->batch_done.notify_all();
    sync_->wake.wait(lock, [&] { return stop_ || (!paused_ && work_epoch_ != mapper_seen_epoch_); });
    if (stop_) break;
    mapper_idle_ = false;
    mapper_seen_epoch_ = work_epoch_;
    stats_.mapper_wakeups++;
    while (!stop_ && !mapper_error_ && !paused_) {
      Batch batch = plan_batch();
      if (batch.empty()) break;
      inflight_ = true;
      lock.unlock();
      size_t done = 0;
      std::exception_ptr error;
      try {
        run_batch(batch, &done);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      commit_batch(batch, done, error);
      inflight_ = false;
      sync_->batch_done.notify_all();
    }
  }
  mapper_idle_ = true;
  sync_->batch_done.notify_all();
}

void PageManager::wait_idle() {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  if (!policy_.background) return;
  sync_->batch_done.wait(lock, [&] {
    return stop_ || (!inflight_ && (paused_ || (mapper_idle_ && mapper_seen_epoch_ == work_epoch_)));
  });
}

void PageManager::pause_mapper(bool paused) {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  if (paused) check_open();  // unpausing a closed manager is a no-op (a capture block that closed it)
  if (paused && paused_) throw std::logic_error("the mapper is already paused (graph_capture is not reentrant)");
  paused_ = paused;
  if (paused) {
    sync_->batch_done.wait(lock, [&] { return !inflight_; });
  } else {
    work_epoch_++;  // plan again: work may have come, or been cut short, while paused
    sync_->wake.notify_one();
  }
}

// ---- lifetime -------------------------------------------------------------------------

void PageManager::close() {
  if (forked()) throw ForkedError(kForked);
  std::lock_guard<std::mutex> closing(sync_->close_mu);
  {
    Lock lock(sync_->mu);
    if (!memory_) return;
    stop_ = true;
  }
  sync_->wake.notify_all();
  if (sync_->mapper.joinable()) sync_->mapper.join();  // without mu: the mapper commits its batch first
  Lock lock(sync_->mu);
  for (auto& [handle, ids] : handles_)
    for (uint32_t id : ids) drop_hold(id);
  handles_.clear();
  std::vector<uintptr_t> mapped;
  for (size_t s = 0; s < config_.num_slots; ++s) {
    for (size_t b = 0; b < config_.num_buffers; ++b)
      for (size_t p = 0; p < mapped_of(s); ++p) mapped.push_back(address(b, s, p));
    slot_ids_[s].clear();
    slot_allocated_[s] = 0;
    slot_tokens_[s] = 0;
    slot_orphans_[s] = 0;
  }
  for (const Orphan& o : orphans_) mapped.insert(mapped.end(), o.addrs.begin(), o.addrs.end());
  orphans_.clear();
  memory_->hand_over(std::move(mapped));
  std::shared_ptr<CacheMemory> memory = std::move(memory_);  // memory_ null: closed
  free_ids_.clear();
  uncreated_.clear();
  stats_.pages_mapped = stats_.pages_in_use = stats_.page_slots_mapped = stats_.pages_orphaned = 0;
  stats_.pages_created = 0;
  stats_.slots_allocated = stats_.tokens_active = stats_.prefix_handles = 0;
  lock.unlock();
  // No tensor view left: tear down now and report errors. Otherwise the last
  // view's deleter does it (views cannot be created any more, so the count
  // only falls).
  if (memory.use_count() == 1) memory->teardown();
}

bool PageManager::closed() const {
  if (forked()) return true;
  Lock lock(sync_->mu);
  return !memory_;
}

size_t PageManager::mapped_pages(int64_t slot) const {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  check_slot(slot, "mapped_pages");
  return mapped_of(slot);
}

bool PageManager::slot_allocated(int64_t slot) const {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  check_slot(slot, "is_allocated");
  return slot_allocated_[slot] != 0;
}

void PageManager::check_mapped(const int64_t* slots, const int64_t* tokens, size_t count,
                               const std::string& what) const {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  for (size_t i = 0; i < count; ++i) {
    check_allocated(slots[i], what.c_str());
    const int64_t mapped = tokens_in_positions(mapped_of(static_cast<size_t>(slots[i])));
    if (tokens[i] < 0 || tokens[i] > mapped)
      throw std::invalid_argument(what + ": reqid " + std::to_string(slots[i]) + " would read " +
                                  std::to_string(tokens[i]) + " tokens but has " + std::to_string(mapped) +
                                  " mapped (step() it to at least " + std::to_string(tokens[i]) +
                                  " tokens before attending)");
  }
}

PageStats PageManager::stats() const {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  return stats_;
}

std::vector<TableEntry> PageManager::table() const {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  std::vector<TableEntry> out;
  for (size_t s = 0; s < config_.num_slots; ++s)
    for (size_t b = 0; b < config_.num_buffers; ++b)
      for (size_t p = 0; p < mapped_of(s); ++p)
        out.push_back(TableEntry{address(b, s, p), physical(b, slot_ids_[s][p])});
  for (const Orphan& o : orphans_)
    for (uintptr_t a : o.addrs) {
      size_t b = (a - base_) / buffer_bytes();
      out.push_back(TableEntry{a, physical(b, o.id)});
    }
  return out;
}

std::string PageManager::check_invariants() {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  sync_->batch_done.wait(lock, [&] { return !inflight_; });
  const size_t nb = config_.num_buffers;
  std::vector<uint32_t> maps(num_ids_, 0), holds(num_ids_, 0), pooled(num_ids_, 0);
  size_t slots_mapped = 0, allocated = 0;
  for (size_t s = 0; s < config_.num_slots; ++s) {
    allocated += slot_allocated_[s];
    for (uint32_t id : slot_ids_[s]) {
      if (id >= num_ids_) return "slot " + std::to_string(s) + " holds id " + std::to_string(id) + " out of range";
      if (!id_created_[id]) return "slot " + std::to_string(s) + " maps uncreated id " + std::to_string(id);
      maps[id]++;
    }
    slots_mapped += slot_ids_[s].size() * nb;
  }
  size_t orphaned = 0;
  std::vector<uint32_t> per_slot(config_.num_slots, 0);
  for (const Orphan& o : orphans_) {
    if (o.addrs.empty()) return "an orphan without addresses";
    maps[o.id]++;
    per_slot[o.slot]++;
    orphaned += o.addrs.size();
    slots_mapped += o.addrs.size();
  }
  if (per_slot != slot_orphans_) return "orphan counts per slot disagree";
  for (auto& [h, ids] : handles_)
    for (uint32_t id : ids) holds[id]++;
  for (uint32_t id : free_ids_) {
    if (pooled[id]++) return "id " + std::to_string(id) + " is in the free pool twice";
    if (!id_created_[id]) return "free id " + std::to_string(id) + " was never created";
  }
  for (uint32_t id : uncreated_) {
    if (pooled[id]++) return "id " + std::to_string(id) + " is both free and uncreated, or uncreated twice";
    if (id_created_[id]) return "uncreated id " + std::to_string(id) + " is marked created";
  }
  size_t mapped = 0, in_use = 0, created = 0;
  for (size_t id = 0; id < num_ids_; ++id) {
    if (maps[id] != id_maps_[id]) return "id " + std::to_string(id) + ": " + std::to_string(id_maps_[id]) +
                                          " mapping references counted, " + std::to_string(maps[id]) + " in the table";
    if (holds[id] != id_holds_[id]) return "id " + std::to_string(id) + ": hold count disagrees with the handles";
    bool used = maps[id] + holds[id] > 0;
    if (!config_.external_ids && used == (pooled[id] != 0))
      return "id " + std::to_string(id) + (used ? " is in use and in the pool" : " is neither in use nor in the pool");
    mapped += maps[id] > 0;
    in_use += used;
    created += id_created_[id] != 0;
  }
  const PageStats& st = stats_;
  if (st.pages_mapped != mapped * nb) return "pages_mapped counter is off";
  if (st.pages_in_use != in_use * nb) return "pages_in_use counter is off";
  if (st.page_slots_mapped != slots_mapped) return "page_slots_mapped counter is off";
  if (st.pages_orphaned != orphaned) return "pages_orphaned counter is off";
  if (st.pages_created != created * nb) return "pages_created counter is off";
  if (st.slots_allocated != allocated) return "slots_allocated counter is off";
  if (st.prefix_handles != handles_.size()) return "prefix_handles counter is off";
  return "";
}

std::shared_ptr<CacheMemory> PageManager::memory() const {
  if (forked()) throw ForkedError(kForked);
  Lock lock(sync_->mu);
  check_open();
  return memory_;
}

}  // namespace vattn
