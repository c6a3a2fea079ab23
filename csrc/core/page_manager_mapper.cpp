// PageManager: the background mapper. It plans a batch under mu (the policy
// decides, the table records what leaves the pool or the prefixes), runs the
// batch's driver calls without mu, and commits under mu; see the locking
// discipline in page_manager.h.
#include <algorithm>
#include <exception>
#include <stdexcept>

#include "common/errors.h"
#include "core/page_manager.h"

namespace vattn {

PageManager::Batch PageManager::plan_batch() {
  Batch batch;
  MapperPlan plan = plan_mapper_batch(table_, geometry_, policy_, reclaim_floor_ids_, mapper_limits());
  switch (plan.kind) {
    case MapperPlan::Kind::kIdle:
      break;
    case MapperPlan::Kind::kReclaim:
      for (auto [s, keep] : plan.reclaim) batch.reads = std::max(batch.reads, reads_of(s));
      for (auto [s, keep] : plan.reclaim) table_.cut_tail(s, keep, batch.cuts);
      batch.unmap_addrs = addresses_of(batch.cuts);
      break;
    case MapperPlan::Kind::kGrow:
      for (auto [s, add] : plan.grows)
        batch.jobs.push_back(MapJob{s, table_.mapped(s), table_.claim(add, batch.to_create), add});
      batch.mappings = mappings_for(batch.jobs);
      break;
    case MapperPlan::Kind::kCreate:
      batch.to_create = table_.take_uncreated(plan.create_ids);
      break;
  }
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
    create_ids(batch.to_create, false);  // all or nothing; OutOfPages when none can be created now
    batch.created = true;
  }
  if (!batch.mappings.empty()) backend_->map(batch.mappings.data(), batch.mappings.size(), done);
}

void PageManager::commit_batch(Batch& batch, size_t done, std::exception_ptr error) {
  PageStats& stats = table_.counters();
  stats.mapper_batches++;
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (const OutOfPages&) {
      // No page can be created now: not an error. The mapper creates nothing
      // more until new work comes (a step or a freed request may change
      // that); a step that needs pages tries itself and answers false.
      stats.creations_refused++;
      refused_epoch_ = work_epoch_;
    } catch (...) {
      if (budget_ && !budget_->unusable_reason().empty()) {
        // The budget was removed or damaged under the manager: speculative
        // pages are simply not made (as when refused); a step that needs
        // pages raises the reason itself.
        stats.creations_refused++;
        refused_epoch_ = work_epoch_;
      } else {
        stats.mapper_errors++;
        mapper_error_ = error;
      }
    }
  }
  if (!batch.cuts.empty()) {
    const size_t before = table_.available();
    finish_unmap(batch.cuts, batch.unmap_addrs, error ? done : batch.unmap_addrs.size());
    const size_t pages = (table_.available() - before) * config_.num_buffers;
    stats.reclaimed_pages += pages;
    stats.background_reclaimed_pages += pages;
    return;
  }
  if (batch.created) table_.mark_created(batch.to_create);
  if (batch.jobs.empty()) {  // a create batch: its pages join the pool (or go back uncreated)
    table_.return_fresh(batch.to_create);
    return;
  }
  if (!batch.to_create.empty() && !batch.created) {  // creation failed: nothing was mapped
    for (MapJob& job : batch.jobs) table_.return_fresh(job.ids);
    return;
  }
  finish_map(batch.jobs, batch.mappings, error ? done : batch.mappings.size(), true);
}

void PageManager::mapper_loop() {
  Lock lock(sync_->mu);
  while (true) {
    mapper_idle_ = true;
    sync_->batch_done.notify_all();
    sync_->wake.wait(lock, [&] { return stop_ || (!background_paused() && work_epoch_ != mapper_seen_epoch_); });
    if (stop_) break;
    mapper_idle_ = false;
    mapper_seen_epoch_ = work_epoch_;
    table_.counters().mapper_wakeups++;
    while (!stop_ && !mapper_error_ && !background_paused()) {
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
  check_process();
  Lock lock(sync_->mu);
  if (!policy_.background) return;
  sync_->batch_done.wait(lock, [&] {
    return stop_ || (!inflight_ && (background_paused() || (mapper_idle_ && mapper_seen_epoch_ == work_epoch_)));
  });
}

void PageManager::pause_mapper(bool paused) {
  check_process();
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

void PageManager::pause_for_capture(bool begin) {
  check_process();
  Lock lock(sync_->mu);
  if (begin) {
    ++capture_pauses_;
    // The keeper's releases run under mu, so holding it here means none is
    // under way; the mapper's batch runs without mu: wait for it to land.
    sync_->batch_done.wait(lock, [&] { return !inflight_; });
  } else if (capture_pauses_ > 0) {
    if (--capture_pauses_ == 0) {
      work_epoch_++;  // the work deferred during the capture
      sync_->wake.notify_one();
    }
  }
}

}  // namespace vattn
