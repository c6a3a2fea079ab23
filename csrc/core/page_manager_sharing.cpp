// PageManager: shared pages. fork, prefix handles, and the page-table
// primitive (map_pages / unmap_pages / unmap_pages_below) that puts given ids at given
// positions.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/errors.h"
#include "core/page_manager.h"

namespace vattn {

int64_t PageManager::fork(int64_t src, int64_t num_tokens) {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  if (config_.external_ids)
    throw std::invalid_argument("fork: this manager's page ids are owned by the caller (page_allocator='external')");
  auto validate = [&] {
    check_allocated(src, "fork");
    int64_t mapped = geometry_.tokens_in_positions(table_.mapped(static_cast<size_t>(src)));
    if (num_tokens < 0 || num_tokens > mapped)
      throw std::invalid_argument("fork: num_tokens must be in " + range_text(0, mapped) +
                                  " (tokens mapped for reqid " + std::to_string(src) + "), got " +
                                  std::to_string(num_tokens));
  };
  validate();
  wait_for_round(lock);
  validate();
  const size_t shared = geometry_.shareable_positions(num_tokens);
  const size_t total = geometry_.positions_for_tokens(num_tokens);
  const size_t fresh = total - shared;
  const int64_t dst = emptiest_free_reqid(table_);
  if (dst < 0)
    throw OutOfReqids("fork: all " + std::to_string(config_.num_reqids) +
                     " reqids are in use (max_batch_size); free one with free_reqid");
  const size_t d = static_cast<size_t>(dst);
  size_t own = 0;  // ids only dst references: truncating it frees them
  for (uint32_t id : table_.ids(d)) own += table_.maps(id) == 1 && table_.holds(id) == 0;
  size_t reclaimable = 0;
  if (table_.available() + own < fresh)
    reclaimable = plan_reclaim(table_, fresh - table_.available() - own, dst, SIZE_MAX).freed_ids;
  const auto pool_short = [&] {
    return OutOfPages("fork: the page pool cannot supply the " + std::to_string(fresh) +
                      " page(s) per buffer the copied tail of " + std::to_string(num_tokens) +
                      " tokens needs; free requests or raise physical_memory");
  };
  if (table_.available() + own + reclaimable < fresh) throw pool_short();
  // The tail's pages that no created id will supply are created before dst is touched: a creation the
  // budget or the device refuses leaves everything as it was (OutOfPages, nothing changed), and
  // other free reqids' cached pages stand in for the refused ones, as in step.
  const auto created_free = [&] { return table_.free_ids().size(); };
  const size_t to_make = fresh > created_free() + own ? fresh - created_free() - own : 0;
  if (to_make > 0) {
    std::vector<uint32_t> made = table_.take_uncreated(to_make);
    // what creation cannot cover (too few uncreated ids, or a refusal) must come from reclaiming
    const auto reclaim_covers = [&](size_t ids) {
      return ids == 0 || plan_reclaim(table_, ids, dst, SIZE_MAX).freed_ids >= ids;
    };
    if (!reclaim_covers(to_make - made.size())) {
      table_.return_fresh(made);
      throw pool_short();
    }
    try {
      create_ids(made, true);
      table_.mark_created(made);
    } catch (const OutOfPages& refused) {
      table_.return_fresh(made);  // uncreated again
      made.clear();
      if (!reclaim_covers(to_make)) throw OutOfPages(std::string("fork: ") + refused.what());
    } catch (...) {
      table_.return_fresh(made);
      throw;
    }
    table_.return_fresh(made);  // created ones into the free pool, which claim takes first
  }
  if (table_.orphans_of(d)) settle_orphans_locked(dst);
  unmap_tails_locked({{d, 0}});
  if (created_free() < fresh) reclaim_locked(fresh - created_free(), dst);
  if (created_free() < fresh) throw OutOfPages("fork: the page pool ran out while reclaiming");
  const std::vector<uint32_t>& src_ids = table_.ids(static_cast<size_t>(src));
  std::vector<uint32_t> to_create;
  std::vector<MapJob> jobs;
  jobs.push_back(MapJob{d, 0, std::vector<uint32_t>(src_ids.begin(), src_ids.begin() + shared), 0});
  jobs.push_back(MapJob{d, shared, table_.claim(fresh, to_create), fresh});
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
  table_.allocate(d);
  table_.set_tokens(d, num_tokens);
  PageStats& stats = table_.counters();
  stats.forks++;
  stats.pages_copied += fresh * config_.num_buffers;
  work_epoch_++;
  sync_->wake.notify_one();
  return dst;
}

std::pair<uint64_t, int64_t> PageManager::retain_prefix(int64_t reqid, int64_t num_tokens) {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  if (config_.external_ids)
    throw std::invalid_argument("retain_prefix: this manager's page ids are owned by the caller "
                                "(page_allocator='external')");
  check_allocated(reqid, "retain_prefix");
  const std::vector<uint32_t>& reqid_page_ids = table_.ids(static_cast<size_t>(reqid));
  int64_t mapped = geometry_.tokens_in_positions(reqid_page_ids.size());
  if (num_tokens < 0 || num_tokens > mapped)
    throw std::invalid_argument("retain_prefix: num_tokens must be in " + range_text(0, mapped) +
                                " (tokens mapped for reqid " + std::to_string(reqid) + "), got " +
                                std::to_string(num_tokens));
  const size_t shared = geometry_.shareable_positions(num_tokens);
  uint64_t handle = table_.retain(std::vector<uint32_t>(reqid_page_ids.begin(), reqid_page_ids.begin() + shared));
  return {handle, geometry_.tokens_in_positions(shared)};
}

int64_t PageManager::attach_prefix(uint64_t handle, int64_t reqid) {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  auto validate = [&] {
    if (!table_.handle_ids(handle)) throw std::invalid_argument("attach_prefix: the prefix handle was released");
    check_allocated(reqid, "attach_prefix");
    if (table_.tokens(static_cast<size_t>(reqid)) > 0)
      throw std::invalid_argument("attach_prefix: reqid " + std::to_string(reqid) + " already holds " +
                                  std::to_string(table_.tokens(static_cast<size_t>(reqid))) +
                                  " tokens; attach to a freshly allocated reqid");
  };
  validate();
  wait_for_round(lock);
  validate();
  const std::vector<uint32_t> ids = *table_.handle_ids(handle);
  const size_t s = static_cast<size_t>(reqid);
  if (table_.orphans_of(s)) settle_orphans_locked(reqid);
  size_t same = 0;
  while (same < std::min(table_.mapped(s), ids.size()) && table_.ids(s)[same] == ids[same]) ++same;
  unmap_tails_locked({{s, same}});
  std::vector<MapJob> jobs{MapJob{s, same, std::vector<uint32_t>(ids.begin() + same, ids.end()), 0}};
  std::vector<uint32_t> none;
  map_jobs_locked(jobs, none);
  int64_t tokens = geometry_.tokens_in_positions(ids.size());
  table_.set_tokens(s, tokens);
  return tokens;
}

void PageManager::release_prefix(uint64_t handle) {
  check_process();
  Lock lock(sync_->mu);
  if (!table_.release_handle(handle)) return;  // released already, or by cleanup()
  work_epoch_++;
  sync_->wake.notify_one();
}

std::vector<uint32_t> PageManager::prefix_ids(uint64_t handle) const {
  check_process();
  Lock lock(sync_->mu);
  const std::vector<uint32_t>* ids = table_.handle_ids(handle);
  if (!ids) throw std::invalid_argument("the prefix handle was released");
  return *ids;
}

void PageManager::map_pages(const int64_t* reqids, const int64_t* starts, const int64_t* offsets, size_t count,
                          const uint32_t* ids, size_t num_ids_given) {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  const size_t slice_positions = config_.slice_bytes / page_size_;
  auto validate = [&] {
    if (offsets[0] != 0 || static_cast<size_t>(offsets[count]) != num_ids_given)
      throw std::invalid_argument("map_pages: counts must add up to len(page_ids) = " +
                                  std::to_string(num_ids_given));
    std::vector<uint8_t> seen(config_.num_reqids, 0);
    for (size_t i = 0; i < count; ++i) {
      check_allocated(reqids[i], "map_pages");
      if (seen[reqids[i]]++)
        throw std::invalid_argument("map_pages: reqid " + std::to_string(reqids[i]) + " appears twice");
      int64_t n = offsets[i + 1] - offsets[i];
      int64_t mapped = static_cast<int64_t>(table_.mapped(static_cast<size_t>(reqids[i])));
      if (n < 0) throw std::invalid_argument("map_pages: counts must be >= 0");
      if (starts[i] < 0 || starts[i] > mapped)
        throw std::invalid_argument("map_pages: starts[" + std::to_string(i) + "] must be in " +
                                    range_text(0, mapped) + " (positions mapped for reqid " +
                                    std::to_string(reqids[i]) + "), got " + std::to_string(starts[i]));
      if (static_cast<size_t>(starts[i] + n) > slice_positions)
        throw std::invalid_argument("map_pages: reqid " + std::to_string(reqids[i]) + " has " +
                                    std::to_string(slice_positions) + " page positions; starts[" +
                                    std::to_string(i) + "] + count = " + std::to_string(starts[i] + n));
    }
    for (size_t k = 0; k < num_ids_given; ++k) {
      if (ids[k] >= num_ids_)
        throw std::invalid_argument("map_pages: page_ids[" + std::to_string(k) + "] must be in " +
                                    range_text(0, num_ids_ - 1) + " (num_page_ids), got " + std::to_string(ids[k]));
      if (!config_.external_ids && table_.refs(ids[k]) == 0)
        throw std::invalid_argument("map_pages: page_ids[" + std::to_string(k) + "] = " + std::to_string(ids[k]) +
                                    " is not in use (managed page ids must be mapped in some reqid "
                                    "or held by a prefix handle)");
    }
  };
  validate();
  if (inflight_) {
    wait_for_round(lock);
    validate();
  }
  if (config_.external_ids) {  // pages are created on first use
    std::vector<uint32_t> missing = table_.uncreated_among(ids, num_ids_given);
    if (!missing.empty()) {
      create_ids(missing, true);  // OutOfPages: nothing changed yet
      table_.mark_created(missing);
    }
  }
  // Managed ids: the new positions' references are pinned before any old
  // position is cut, so an id that moves (within a reqid, or a swap between
  // two) never drops to zero references and into the free pool while mapped.
  std::vector<uint32_t> pinned;
  if (!config_.external_ids) pinned.assign(ids, ids + num_ids_given);
  for (uint32_t id : pinned) table_.add_hold(id);
  auto unpin = [&] {
    for (uint32_t id : pinned) table_.drop_hold(id);
  };
  try {
    std::vector<ReqidKeep> cuts;
    std::vector<MapJob> jobs;
    for (size_t i = 0; i < count; ++i) {
      const size_t s = static_cast<size_t>(reqids[i]), start = static_cast<size_t>(starts[i]);
      const size_t n = static_cast<size_t>(offsets[i + 1] - offsets[i]);
      const uint32_t* row = ids + offsets[i];
      size_t same = 0;
      while (same < n && start + same < table_.mapped(s) && table_.ids(s)[start + same] == row[same]) ++same;
      if (same == n) continue;
      if (table_.orphans_of(s)) settle_orphans_locked(reqids[i]);
      cuts.emplace_back(s, start + same);
      jobs.push_back(MapJob{s, start + same, std::vector<uint32_t>(row + same, row + n), 0});
    }
    unmap_tails_locked(cuts);
    std::vector<uint32_t> none;
    map_jobs_locked(jobs, none, true);  // a framework writes the blocks it maps in the forward that follows
  } catch (...) {
    unpin();
    throw;
  }
  unpin();
}

void PageManager::unmap_pages(const int64_t* reqids, const int64_t* keep, size_t count) {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  for (size_t i = 0; i < count; ++i) {
    check_reqid(reqids[i], "unmap_pages");
    if (keep[i] < 0) throw std::invalid_argument("unmap_pages: keep must be >= 0, got " + std::to_string(keep[i]));
  }
  wait_for_round(lock);
  std::vector<ReqidKeep> cuts;
  for (size_t i = 0; i < count; ++i) cuts.emplace_back(static_cast<size_t>(reqids[i]), static_cast<size_t>(keep[i]));
  for (auto [s, k] : cuts)
    if (table_.orphans_of(s)) settle_orphans_locked(static_cast<int64_t>(s));
  unmap_tails_locked(cuts);
  work_epoch_++;
  sync_->wake.notify_one();
}

void PageManager::unmap_pages_below(const int64_t* reqids, const int64_t* first, size_t count) {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  if (!config_.external_ids)
    throw std::invalid_argument("unmap_pages_below: only a manager whose page ids the caller owns "
                                "(page_allocator='external') leaves holes in a slice");
  const int64_t slice_positions = static_cast<int64_t>(config_.slice_bytes / page_size_);
  for (size_t i = 0; i < count; ++i) {
    check_reqid(reqids[i], "unmap_pages_below");
    if (first[i] < 0 || first[i] > slice_positions)
      throw std::invalid_argument("unmap_pages_below: first must be in " + range_text(0, slice_positions) +
                                  " (page positions per reqid), got " + std::to_string(first[i]));
  }
  wait_for_round(lock);
  uint64_t reads = VmmBackend::kNoReads;
  for (size_t i = 0; i < count; ++i) {
    const size_t s = static_cast<size_t>(reqids[i]);
    if (table_.orphans_of(s)) settle_orphans_locked(reqids[i]);
    if (table_.maps_below(s, static_cast<size_t>(first[i]))) reads = std::max(reads, reads_of(s));
  }
  backend_->wait_reads(reads);  // the pages behind a window may still be read by queued work
  std::vector<Cut> cuts;
  for (size_t i = 0; i < count; ++i) table_.unmap_pages_below(static_cast<size_t>(reqids[i]), static_cast<size_t>(first[i]), cuts);
  unmap_cuts_locked(cuts);
  work_epoch_++;
  sync_->wake.notify_one();
}

std::vector<uint32_t> PageManager::reqid_page_ids(int64_t reqid) const {
  return read_reqid(reqid, "page_ids", [&](size_t s) { return table_.ids(s); });
}

}  // namespace vattn
