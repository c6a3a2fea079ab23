// PageManager: the background mapper. It plans a round under mu (the policy
// decides, the table records what leaves the pool or the prefixes), runs the
// round's driver calls without mu, and commits under mu; see the locking
// discipline in page_manager.h.
#include <algorithm>
#include <exception>
#include <stdexcept>

#include "common/errors.h"
#include "core/page_manager.h"

namespace vattn {

PageManager::Round PageManager::plan_round() {
  Round round;
  MapperPlan plan = plan_mapper_round(table_, geometry_, policy_, reclaim_floor_ids_, mapper_limits());
  switch (plan.kind) {
    case MapperPlan::Kind::kIdle:
      break;
    case MapperPlan::Kind::kReclaim:
      for (auto [s, keep] : plan.reclaim) round.reads = std::max(round.reads, reads_of(s));
      for (auto [s, keep] : plan.reclaim) table_.cut_tail(s, keep, round.cuts);
      round.unmap_addrs = addresses_of(round.cuts);
      break;
    case MapperPlan::Kind::kGrow:
      for (auto [s, add] : plan.grows)
        round.jobs.push_back(MapJob{s, table_.mapped(s), table_.claim(add, round.to_create), add});
      round.mappings = mappings_for(round.jobs);
      break;
    case MapperPlan::Kind::kCreate:
      round.to_create = table_.take_uncreated(plan.create_ids);
      break;
  }
  return round;
}

void PageManager::run_round(Round& round, size_t* done) {
  *done = 0;
  if (!round.cuts.empty()) {
    backend_->wait_reads(round.reads);  // see unmap_tails_locked
    backend_->unmap(round.unmap_addrs.data(), round.unmap_addrs.size(), done);
    return;
  }
  if (!round.to_create.empty()) {
    create_ids(round.to_create, false);  // all or nothing; OutOfPages when none can be created now
    round.created = true;
  }
  if (!round.mappings.empty()) backend_->map(round.mappings.data(), round.mappings.size(), done);
}

void PageManager::commit_round(Round& round, size_t done, std::exception_ptr error) {
  PageStats& stats = table_.counters();
  stats.mapper_rounds++;
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
  if (!round.cuts.empty()) {
    const size_t before = table_.available();
    finish_unmap(round.cuts, round.unmap_addrs, error ? done : round.unmap_addrs.size());
    const size_t pages = (table_.available() - before) * config_.num_buffers;
    stats.reclaimed_pages += pages;
    stats.background_reclaimed_pages += pages;
    return;
  }
  if (round.created) table_.mark_created(round.to_create);
  if (round.jobs.empty()) {  // a create round: its pages join the pool (or go back uncreated)
    table_.return_fresh(round.to_create);
    return;
  }
  if (!round.to_create.empty() && !round.created) {  // creation failed: nothing was mapped
    for (MapJob& job : round.jobs) table_.return_fresh(job.ids);
    return;
  }
  finish_map(round.jobs, round.mappings, error ? done : round.mappings.size(), true);
}

void PageManager::mapper_loop() {
  Lock lock(sync_->mu);
  while (true) {
    mapper_idle_ = true;
    sync_->round_done.notify_all();
    sync_->wake.wait(lock, [&] { return stop_ || (!background_paused() && work_epoch_ != mapper_seen_epoch_); });
    if (stop_) break;
    mapper_idle_ = false;
    mapper_seen_epoch_ = work_epoch_;
    table_.counters().mapper_wakeups++;
    while (!stop_ && !mapper_error_ && !background_paused()) {
      Round round = plan_round();
      if (round.empty()) break;
      inflight_ = true;
      lock.unlock();
      size_t done = 0;
      std::exception_ptr error;
      try {
        run_round(round, &done);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      commit_round(round, done, error);
      inflight_ = false;
      sync_->round_done.notify_all();
    }
  }
  mapper_idle_ = true;
  sync_->round_done.notify_all();
}

void PageManager::wait_idle() {
  check_process();
  Lock lock(sync_->mu);
  check_open();
  if (!policy_.background) return;
  sync_->round_done.wait(lock, [&] {
    return stop_ || (!inflight_ && (background_paused() || (mapper_idle_ && mapper_seen_epoch_ == work_epoch_)));
  });
  if (stop_) throw ClosedError("wait_idle: the KV cache manager was cleaned up while waiting");
}

void PageManager::pause_mapper(bool paused) {
  check_process();
  Lock lock(sync_->mu);
  if (paused) check_open();  // unpausing a closed manager is a no-op (a capture block that closed it)
  if (paused && paused_) throw std::logic_error("the mapper is already paused (graph_capture is not reentrant)");
  paused_ = paused;
  if (paused) {
    sync_->round_done.wait(lock, [&] { return !inflight_; });
  } else {
    if (capture_pauses_ == 0) retry_unreleased_locked();  // releases the closed gate deferred have run now
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
    // under way; the mapper's round runs without mu: wait for it to land.
    sync_->round_done.wait(lock, [&] { return !inflight_; });
  } else if (capture_pauses_ > 0) {
    if (--capture_pauses_ == 0) {
      if (!paused_) retry_unreleased_locked();  // releases the closed gate deferred have run now
      work_epoch_++;  // the work deferred during the capture
      sync_->wake.notify_one();
    }
  }
}

}  // namespace vattn
