#include "core/page_table.h"

#include <algorithm>
#include <functional>
#include <utility>

namespace vattn {

PageTable::PageTable(size_t num_reqids, size_t num_buffers, size_t num_ids, bool external_ids)
    : num_buffers_(num_buffers), external_ids_(external_ids) {
  reqid_page_ids_.resize(num_reqids);
  reqid_allocated_.assign(num_reqids, 0);
  reqid_tokens_.assign(num_reqids, 0);
  reqid_orphans_.assign(num_reqids, 0);
  id_maps_.assign(num_ids, 0);
  id_holds_.assign(num_ids, 0);
  id_request_maps_.assign(num_ids, 0);
  id_created_.assign(num_ids, 0);
  if (!external_ids_) {
    uncreated_.reserve(num_ids);
    free_ids_.reserve(num_ids);
    for (size_t i = num_ids; i > 0; --i) uncreated_.push_back(static_cast<uint32_t>(i - 1));
  }
  stats_.pages_total = num_ids * num_buffers;
  stats_.pages_free_low = stats_.pages_total;
}

// ---- reqids ------------------------------------------------------------------------------

size_t PageTable::first_shared(size_t reqid) const {
  const auto& ids = reqid_page_ids_[reqid];
  for (size_t p = 0; p < ids.size(); ++p)
    if (ids[p] != kHole && refs(ids[p]) > 1) return p;
  return ids.size();
}

void PageTable::allocate(size_t reqid) {
  reqid_allocated_[reqid] = 1;
  for (uint32_t id : reqid_page_ids_[reqid])  // a reused reqid's positions are its request's again
    if (id != kHole) add_request_ref(id);
  reqid_tokens_[reqid] = 0;
  stats_.reqids_allocated++;
}

void PageTable::release(size_t reqid) {
  drop_request_refs(reqid, 0, reqid_page_ids_[reqid].size());
  reqid_allocated_[reqid] = 0;
  reqid_tokens_[reqid] = 0;
  stats_.reqids_allocated--;
  note_shrink();
}

// ---- reference counts ---------------------------------------------------------------

void PageTable::note_in_use() {
  stats_.pages_mapped_peak = std::max(stats_.pages_mapped_peak, stats_.pages_mapped);
  stats_.pages_free_low = std::min(stats_.pages_free_low, stats_.pages_total - stats_.pages_in_use);
}

void PageTable::add_map_ref(uint32_t id) {
  if (id_maps_[id]++ == 0) stats_.pages_mapped += num_buffers_;
  if (refs(id) == 1) stats_.pages_in_use += num_buffers_;
  note_in_use();
}

void PageTable::add_hold(uint32_t id) {
  if (id_holds_[id]++ == 0 && id_maps_[id] == 0) stats_.pages_in_use += num_buffers_;
  note_in_use();
}

void PageTable::add_request_ref(uint32_t id) {
  if (id_request_maps_[id]++ == 0) stats_.pages_in_requests += num_buffers_;
}

void PageTable::drop_request_ref(uint32_t id) {
  if (--id_request_maps_[id] == 0) stats_.pages_in_requests -= num_buffers_;
}

void PageTable::drop_request_refs(size_t reqid, size_t from, size_t to) {
  if (!reqid_allocated_[reqid]) return;
  const auto& ids = reqid_page_ids_[reqid];
  for (size_t p = from; p < to; ++p)
    if (ids[p] != kHole) drop_request_ref(ids[p]);
}

void PageTable::drop_map_ref(uint32_t id) {
  if (--id_maps_[id] == 0) stats_.pages_mapped -= num_buffers_;
  release_if_unreferenced(id);
}

void PageTable::drop_hold(uint32_t id) {
  --id_holds_[id];
  release_if_unreferenced(id);
}

void PageTable::release_if_unreferenced(uint32_t id) {
  if (refs(id) != 0) return;
  stats_.pages_in_use -= num_buffers_;
  if (!external_ids_) free_ids_.push_back(id);  // external ids stay the caller's
}

// ---- the pool ---------------------------------------------------------------------------

std::vector<uint32_t> PageTable::claim(size_t count, std::vector<uint32_t>& to_create) {
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

std::vector<uint32_t> PageTable::take_uncreated(size_t count) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < count && !uncreated_.empty(); ++i) {
    out.push_back(uncreated_.back());
    uncreated_.pop_back();
  }
  return out;
}

void PageTable::return_fresh(const std::vector<uint32_t>& ids) {
  bool uncreated_back = false;
  for (uint32_t id : ids) {
    if (refs(id) != 0) continue;  // an orphan kept it
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

void PageTable::mark_created(const std::vector<uint32_t>& ids) {
  for (uint32_t id : ids) id_created_[id] = 1;
  stats_.pages_created += ids.size() * num_buffers_;
}

std::vector<uint32_t> PageTable::uncreate_free(size_t count) {
  count = std::min(count, free_ids_.size());
  std::vector<uint32_t> out(free_ids_.begin(), free_ids_.begin() + count);  // front: freed longest ago
  free_ids_.erase(free_ids_.begin(), free_ids_.begin() + count);
  for (uint32_t id : out) {
    id_created_[id] = 0;
    uncreated_.push_back(id);
  }
  if (!out.empty()) std::sort(uncreated_.begin(), uncreated_.end(), std::greater<uint32_t>());
  stats_.pages_created -= out.size() * num_buffers_;
  return out;
}

std::vector<uint32_t> PageTable::uncreate_unreferenced(const uint32_t* ids, size_t count) {
  std::vector<uint32_t> out;
  for (size_t k = 0; k < count; ++k) {
    const uint32_t id = ids[k];
    if (!id_created_[id] || refs(id) != 0) continue;
    id_created_[id] = 0;  // a repeated id is no longer created: released once
    out.push_back(id);
  }
  stats_.pages_created -= out.size() * num_buffers_;
  return out;
}

size_t PageTable::idle_ids() const {
  size_t idle = free_ids_.size();
  std::vector<uint32_t> free_reqid_maps(num_ids(), 0);
  for (size_t s = 0; s < reqid_page_ids_.size(); ++s)
    if (!reqid_allocated_[s])
      for (uint32_t id : reqid_page_ids_[s]) free_reqid_maps[id]++;
  for (size_t id = 0; id < free_reqid_maps.size(); ++id)
    idle += free_reqid_maps[id] > 0 && free_reqid_maps[id] == id_maps_[id] && id_holds_[id] == 0;
  return idle;
}

std::vector<uint32_t> PageTable::uncreated_among(const uint32_t* ids, size_t count) {
  std::vector<uint32_t> missing;
  for (size_t k = 0; k < count; ++k)
    if (!id_created_[ids[k]]) {
      missing.push_back(ids[k]);
      id_created_[ids[k]] = 2;  // dedupe marker, reset below
    }
  for (uint32_t id : missing) id_created_[id] = 0;
  return missing;
}

// ---- positions --------------------------------------------------------------------------

void PageTable::append(size_t reqid, const std::vector<uint32_t>& ids) {
  for (uint32_t id : ids) {
    reqid_page_ids_[reqid].push_back(id);
    add_map_ref(id);
    if (reqid_allocated_[reqid]) add_request_ref(id);
  }
  stats_.page_mappings += ids.size() * num_buffers_;
}

void PageTable::cut_runs(size_t reqid, size_t from, size_t to, std::vector<Cut>& cuts) const {
  const auto& ids = reqid_page_ids_[reqid];
  for (size_t p = from; p < to;) {
    if (ids[p] == kHole) {
      ++p;
      continue;
    }
    size_t end = p;
    while (end < to && ids[end] != kHole) ++end;
    cuts.push_back(Cut{reqid, p, std::vector<uint32_t>(ids.begin() + p, ids.begin() + end)});
    p = end;
  }
}

void PageTable::cut_tail(size_t reqid, size_t keep, std::vector<Cut>& cuts) {
  auto& ids = reqid_page_ids_[reqid];
  if (ids.size() <= keep) return;
  cut_runs(reqid, keep, ids.size(), cuts);
  drop_request_refs(reqid, keep, ids.size());
  ids.resize(keep);
  note_shrink();
}

void PageTable::unmap_pages_below(size_t reqid, size_t first, std::vector<Cut>& cuts) {
  auto& ids = reqid_page_ids_[reqid];
  const size_t upto = std::min(first, ids.size());
  cut_runs(reqid, 0, upto, cuts);
  drop_request_refs(reqid, 0, upto);
  std::fill(ids.begin(), ids.begin() + upto, kHole);
  if (upto > 0) note_shrink();
  if (first > ids.size()) ids.resize(first, kHole);
}

size_t PageTable::leading_holes(size_t reqid) const {
  const auto& ids = reqid_page_ids_[reqid];
  return static_cast<size_t>(
      std::partition_point(ids.begin(), ids.end(), [](uint32_t id) { return id == kHole; }) - ids.begin());
}

bool PageTable::maps_below(size_t reqid, size_t first) const {
  const auto& ids = reqid_page_ids_[reqid];
  const size_t upto = std::min(first, ids.size());
  return std::any_of(ids.begin(), ids.begin() + upto, [](uint32_t id) { return id != kHole; });
}

void PageTable::count_unmapped(size_t addrs) {
  stats_.page_mappings -= addrs;
  stats_.page_unmaps += addrs;
}

void PageTable::keep_orphan(Orphan orphan) {
  stats_.pages_orphaned += orphan.addrs.size();
  reqid_orphans_[orphan.reqid]++;
  orphans_.push_back(std::move(orphan));
}

void PageTable::add_orphan(Orphan orphan) {
  add_map_ref(orphan.id);
  stats_.page_mappings += orphan.addrs.size();
  stats_.pages_orphaned += orphan.addrs.size();
  reqid_orphans_[orphan.reqid]++;
  orphans_.push_back(std::move(orphan));
}

bool PageTable::settle_orphan(size_t k, size_t done) {
  Orphan& o = orphans_[k];
  o.addrs.erase(o.addrs.begin(), o.addrs.begin() + done);
  count_unmapped(done);
  stats_.pages_orphaned -= done;
  if (!o.addrs.empty()) return false;
  uint32_t id = o.id;
  reqid_orphans_[o.reqid]--;
  orphans_.erase(orphans_.begin() + k);
  drop_map_ref(id);
  return true;
}

// ---- prefix handles ---------------------------------------------------------------------

uint64_t PageTable::retain(std::vector<uint32_t> ids) {
  for (uint32_t id : ids) add_hold(id);
  uint64_t handle = next_handle_++;
  handles_.emplace(handle, std::move(ids));
  stats_.prefix_handles = handles_.size();
  return handle;
}

bool PageTable::release_handle(uint64_t handle) {
  auto it = handles_.find(handle);
  if (it == handles_.end()) return false;
  for (uint32_t id : it->second) drop_hold(id);
  handles_.erase(it);
  stats_.prefix_handles = handles_.size();
  return true;
}

const std::vector<uint32_t>* PageTable::handle_ids(uint64_t handle) const {
  auto it = handles_.find(handle);
  return it == handles_.end() ? nullptr : &it->second;
}

void PageTable::release_all_handles() {
  for (auto& [handle, ids] : handles_)
    for (uint32_t id : ids) drop_hold(id);
  handles_.clear();
}

void PageTable::clear() {
  note_shrink();
  for (size_t s = 0; s < reqid_page_ids_.size(); ++s) {
    reqid_page_ids_[s].clear();
    reqid_allocated_[s] = 0;
    reqid_tokens_[s] = 0;
    reqid_orphans_[s] = 0;
  }
  orphans_.clear();
  free_ids_.clear();
  uncreated_.clear();
  stats_.pages_mapped = stats_.pages_in_use = stats_.page_mappings = stats_.pages_orphaned = 0;
  stats_.pages_in_requests = 0;
  std::fill(id_request_maps_.begin(), id_request_maps_.end(), 0);
  stats_.pages_created = 0;
  stats_.reqids_allocated = stats_.prefix_handles = 0;
}

PageStats PageTable::stats() const {
  PageStats out = stats_;
  out.tokens_active = 0;
  for (int64_t tokens : reqid_tokens_) out.tokens_active += static_cast<size_t>(tokens);
  return out;
}

// ---- invariants -------------------------------------------------------------------------

std::string PageTable::check_invariants() const {
  const size_t nb = num_buffers_, n_ids = num_ids();
  std::vector<uint32_t> maps(n_ids, 0), holds(n_ids, 0), pooled(n_ids, 0), request_maps(n_ids, 0);
  size_t mappings = 0, allocated = 0;
  for (size_t s = 0; s < reqid_page_ids_.size(); ++s) {
    allocated += reqid_allocated_[s];
    const auto& slice_ids = reqid_page_ids_[s];
    const auto first_mapped = std::find_if(slice_ids.begin(), slice_ids.end(), [](uint32_t id) { return id != kHole; });
    if (std::find(first_mapped, slice_ids.end(), kHole) != slice_ids.end())
      return "reqid " + std::to_string(s) + " has a hole after a mapped position (holes form a prefix)";
    for (uint32_t id : reqid_page_ids_[s]) {
      if (id == kHole) {
        if (!external_ids_) return "reqid " + std::to_string(s) + " has a hole, but its ids are managed";
        continue;
      }
      if (id >= n_ids) return "reqid " + std::to_string(s) + " holds id " + std::to_string(id) + " out of range";
      if (!id_created_[id]) return "reqid " + std::to_string(s) + " maps uncreated id " + std::to_string(id);
      maps[id]++;
      request_maps[id] += reqid_allocated_[s];
      mappings += nb;
    }
  }
  size_t orphaned = 0;
  std::vector<uint32_t> per_reqid(reqid_page_ids_.size(), 0);
  for (const Orphan& o : orphans_) {
    if (o.addrs.empty()) return "an orphan without addresses";
    maps[o.id]++;
    per_reqid[o.reqid]++;
    orphaned += o.addrs.size();
    mappings += o.addrs.size();
  }
  if (per_reqid != reqid_orphans_) return "orphan counts per reqid disagree";
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
  size_t mapped = 0, in_use = 0, created = 0, in_requests = 0;
  for (size_t id = 0; id < n_ids; ++id) {
    if (request_maps[id] != id_request_maps_[id])
      return "id " + std::to_string(id) + ": request references disagree with the allocated reqids";
    in_requests += request_maps[id] > 0;
    if (maps[id] != id_maps_[id]) return "id " + std::to_string(id) + ": " + std::to_string(id_maps_[id]) +
                                          " mapping references counted, " + std::to_string(maps[id]) + " in the table";
    if (holds[id] != id_holds_[id]) return "id " + std::to_string(id) + ": hold count disagrees with the handles";
    bool used = maps[id] + holds[id] > 0;
    if (!external_ids_ && used == (pooled[id] != 0))
      return "id " + std::to_string(id) + (used ? " is in use and in the pool" : " is neither in use nor in the pool");
    mapped += maps[id] > 0;
    in_use += used;
    created += id_created_[id] != 0;
  }
  const PageStats& st = stats_;
  if (st.pages_mapped != mapped * nb) return "pages_mapped counter is off";
  if (st.pages_in_requests != in_requests * nb) return "pages_in_requests counter is off";
  if (st.pages_in_use != in_use * nb) return "pages_in_use counter is off";
  if (st.page_mappings != mappings) return "page_mappings counter is off";
  if (st.pages_orphaned != orphaned) return "pages_orphaned counter is off";
  if (st.pages_created != created * nb) return "pages_created counter is off";
  if (st.reqids_allocated != allocated) return "reqids_allocated counter is off";
  if (st.prefix_handles != handles_.size()) return "prefix_handles counter is off";
  return "";
}

}  // namespace vattn
