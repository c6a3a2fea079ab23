// PageManager: driver work on the caller's thread, with mu held. Every
// backend call reports how far it got, and the table is brought to exactly
// what is mapped before an error goes on.
#include <algorithm>
#include <exception>
#include <string>

#include "common/errors.h"
#include "core/page_manager.h"

namespace vattn {

// ---- creating and releasing pages ------------------------------------------------------

void PageManager::create_ids(const std::vector<uint32_t>& ids, bool demand) {
  if (ids.empty()) return;
  const size_t nb = config_.num_buffers;
  auto refused = [&](const std::string& why) {
    if (demand) table_.counters().creations_refused++;
    return OutOfPages("cannot create " + std::to_string(ids.size() * nb) + " page(s) of " +
                      std::to_string(page_size_) + " bytes now: " + why);
  };
  // Ids whose release failed are still charged (their pages still hold
  // memory, which the backend reuses): only the others are charged now.
  size_t kept = 0;
  for (uint32_t id : ids) kept += unreleased_[id].load(std::memory_order_acquire) != 0;
  const size_t charge = ids.size() - kept;
  if (budget_ && charge > 0 && !budget_->charge(charge, demand))
    throw refused("the " + budget_->describe() + " cannot grant " +
                  std::to_string(charge * budget_->id_bytes()) + " more bytes");
  std::vector<uint32_t> pages;
  pages.reserve(ids.size() * nb);
  for (size_t b = 0; b < nb; ++b)
    for (uint32_t id : ids) pages.push_back(physical(b, id));
  try {
    backend_->create_pages(pages.data(), pages.size());  // all or nothing (kept pages stay kept)
  } catch (const OutOfMemory& e) {
    if (budget_ && charge > 0) {
      budget_->uncharge(charge);
      budget_->rearm_wait();  // a wait after this must not end at once on the uncharge just made
    }
    throw refused(std::string("the ") + (backend_->dl_device().device_type == kDLCPU ? "host" : "device") +
                  " has no memory left for them (" + e.what() + ")");
  } catch (...) {
    if (budget_ && charge > 0) budget_->uncharge(charge);
    throw;
  }
  if (kept > 0) {
    for (uint32_t id : ids) unreleased_[id].store(0, std::memory_order_release);
    unreleased_ids_ -= kept;
  }
}

void PageManager::release_ids(const std::vector<uint32_t>& ids) {
  if (ids.empty()) return;
  const size_t nb = config_.num_buffers;
  std::vector<uint32_t> pages;
  pages.reserve(ids.size() * nb);
  for (size_t b = 0; b < nb; ++b)
    for (uint32_t id : ids) pages.push_back(physical(b, id));
  std::vector<uint8_t> failed(pages.size(), 0);
  const size_t refused = backend_->release_pages(pages.data(), pages.size(), failed.data());  // never throws
  PageStats& stats = table_.counters();
  stats.pages_released += pages.size() - refused;
  stats.pages_release_failed += refused;
  // The budget counts memory: an id is uncharged only when every one of its
  // pages went back. The others stay charged and marked; the table has them
  // uncreated either way (what they held is gone for the cache).
  size_t gone = ids.size();
  if (refused > 0) {
    for (size_t k = 0; k < ids.size(); ++k) {
      bool held = false;
      for (size_t b = 0; b < nb; ++b) held = held || failed[b * ids.size() + k];
      if (held && !unreleased_[ids[k]].exchange(1, std::memory_order_acq_rel)) {
        ++unreleased_ids_;
        --gone;
      }
    }
  }
  if (budget_ && gone > 0) budget_->uncharge(gone);
}

void PageManager::retry_unreleased_locked() {
  if (!memory_ || unreleased_ids_.load() == 0) return;
  std::vector<uint32_t> ids;
  for (uint32_t id = 0; id < num_ids_; ++id)
    if (unreleased_[id].exchange(0, std::memory_order_acq_rel)) ids.push_back(id);
  unreleased_ids_ -= ids.size();  // release_ids marks again those whose pages are still held
  release_ids(ids);
}

// ---- mapping ----------------------------------------------------------------------------

std::vector<PageMapping> PageManager::mappings_for(const std::vector<MapJob>& jobs) const {
  // Job by job, buffer-major: each buffer's new positions of a reqid are one
  // address run, and fresh ids are consecutive along it, so the host merges
  // the mappings and CUDA grants access once per run.
  std::vector<PageMapping> out;
  for (const MapJob& job : jobs)
    for (size_t b = 0; b < config_.num_buffers; ++b)
      for (size_t i = 0; i < job.ids.size(); ++i)
        out.push_back(PageMapping{address(b, job.reqid, job.from + i), physical(b, job.ids[i])});
  return out;
}

void PageManager::finish_map(std::vector<MapJob>& jobs, const std::vector<PageMapping>& mappings,
                             size_t done, bool background) {
  const size_t nb = config_.num_buffers;
  PageStats& stats = table_.counters();
  size_t at = 0;
  for (MapJob& job : jobs) {
    const size_t n_ids = job.ids.size(), n = n_ids * nb;
    if (at + n <= done) {
      table_.append(job.reqid, job.ids);
      (background ? stats.background_page_maps : stats.sync_page_maps) += n;
    } else {
      size_t mapped_here = done > at ? done - at : 0;
      if (mapped_here > 0) {
        // Undo this job's mapped part so the reqid's prefix stays exact; what
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
            kept.push_back(Orphan{job.reqid, job.from + i, job.ids[i], {}});
            it = kept.end() - 1;
          }
          it->addrs.push_back(addrs[e]);
        }
        for (Orphan& o : kept) table_.add_orphan(std::move(o));
      }
      table_.return_fresh(std::vector<uint32_t>(job.ids.end() - job.fresh, job.ids.end()));
    }
    at += n;
  }
}

void PageManager::map_jobs_locked(std::vector<MapJob>& jobs, std::vector<uint32_t>& to_create, bool populate) {
  if (!to_create.empty()) {
    try {
      create_ids(to_create, true);
    } catch (...) {
      for (MapJob& job : jobs) table_.return_fresh(std::vector<uint32_t>(job.ids.end() - job.fresh, job.ids.end()));
      throw;
    }
    table_.mark_created(to_create);
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
  if (populate) {
    std::vector<uintptr_t> addrs(mappings.size());
    for (size_t i = 0; i < mappings.size(); ++i) addrs[i] = mappings[i].addr;
    backend_->populate(addrs.data(), addrs.size());
  }
}

// ---- unmapping ------------------------------------------------------------------------

std::vector<uintptr_t> PageManager::addresses_of(const std::vector<Cut>& cuts) const {
  std::vector<uintptr_t> out;
  for (const Cut& cut : cuts)
    for (size_t b = 0; b < config_.num_buffers; ++b)
      for (size_t i = 0; i < cut.ids.size(); ++i) out.push_back(address(b, cut.reqid, cut.from + i));
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
      table_.count_unmapped(nb - still.size());
      if (still.empty()) {
        table_.drop_map_ref(cut.ids[i]);
      } else {  // the position's mapping reference moves to the orphan
        table_.keep_orphan(Orphan{cut.reqid, cut.from + i, cut.ids[i], std::move(still)});
      }
    }
    at += n_ids * nb;
  }
}

uint64_t PageManager::reads_of(size_t reqid) const {
  return table_.allocated(reqid) ? VmmBackend::kReadsNow : reqid_reads_[reqid];
}

void PageManager::unmap_tails_locked(const std::vector<ReqidKeep>& reqid_keep) {
  bool any = false;
  uint64_t reads = VmmBackend::kNoReads;  // fences are ordered: the latest covers the others
  for (auto [reqid, keep] : reqid_keep) {
    if (table_.mapped(reqid) <= keep) continue;
    any = true;
    reads = std::max(reads, reads_of(reqid));
  }
  if (!any) return;
  // A finished request's kernels may still read these pages. If this fails,
  // nothing has changed yet.
  backend_->wait_reads(reads);
  std::vector<Cut> cuts;
  for (auto [reqid, keep] : reqid_keep) table_.cut_tail(reqid, keep, cuts);
  unmap_cuts_locked(cuts);
}

void PageManager::unmap_cuts_locked(std::vector<Cut>& cuts) {
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

void PageManager::settle_orphans_locked(int64_t reqid) {
  const std::vector<Orphan>& orphans = table_.orphans();
  auto matches = [&](const Orphan& o) { return reqid < 0 || o.reqid == static_cast<size_t>(reqid); };
  if (std::none_of(orphans.begin(), orphans.end(), matches)) return;
  backend_->synchronize();
  std::exception_ptr first_error;
  for (size_t k = 0; k < orphans.size();) {
    const Orphan& o = orphans[k];
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
    if (!table_.settle_orphan(k, done)) ++k;  // some addresses are still mapped
  }
  if (first_error) std::rethrow_exception(first_error);
}

// ---- reclaiming ---------------------------------------------------------------------------

size_t PageManager::reclaim_locked(size_t want, int64_t keep_reqid) {
  ReclaimPlan plan = plan_reclaim(table_, want, keep_reqid, SIZE_MAX);
  const size_t before = table_.available();
  std::exception_ptr error;
  try {
    unmap_tails_locked(plan.cuts);
  } catch (...) {
    error = std::current_exception();
  }
  const size_t got = table_.available() - before;
  table_.counters().reclaimed_pages += got * config_.num_buffers;
  if (error) std::rethrow_exception(error);
  return got;
}

void PageManager::trim_for_new_request_locked(size_t reqid, size_t keep) {
  // A new request writes every position it uses: a page shared with another
  // reqid or a handle must not be among them.
  keep = std::min(keep, table_.first_shared(reqid));
  if (table_.orphans_of(reqid)) settle_orphans_locked(static_cast<int64_t>(reqid));
  unmap_tails_locked({{reqid, keep}});
}

}  // namespace vattn
