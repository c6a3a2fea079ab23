#include "backends/vmm_backend.h"

#include <pthread.h>

#include <atomic>
#include <cstring>
#include <exception>
#include <set>

#include "common/errors.h"

namespace vattn {

// ---- fork ----------------------------------------------------------------------
//
// Every live CacheMemory is registered. In the child of a fork() each one is
// detached before any other code runs there: a child must never write the
// parent's pages (host mappings are MAP_SHARED, so a plain write would) nor
// call the parent's driver context. The registry mutex is held across fork()
// so the child sees a consistent set.

namespace {

std::atomic<uint64_t> g_fork_generation{1};
pthread_mutex_t g_registry_mu = PTHREAD_MUTEX_INITIALIZER;
std::set<CacheMemory*>* g_registry = nullptr;  // never freed: used at exit and in children
pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;

void fork_prepare() { pthread_mutex_lock(&g_registry_mu); }
void fork_parent() { pthread_mutex_unlock(&g_registry_mu); }

void register_atfork() {
  g_registry = new std::set<CacheMemory*>();
  pthread_atfork(fork_prepare, fork_parent, fork_child_detach_all);
}

void registry_add(CacheMemory* m) {
  pthread_once(&g_atfork_once, register_atfork);
  pthread_mutex_lock(&g_registry_mu);
  g_registry->insert(m);
  pthread_mutex_unlock(&g_registry_mu);
}

void registry_remove(CacheMemory* m) {
  pthread_mutex_lock(&g_registry_mu);
  g_registry->erase(m);
  pthread_mutex_unlock(&g_registry_mu);
}

}  // namespace

uint64_t fork_generation() { return g_fork_generation.load(std::memory_order_relaxed); }

void fork_child_detach_all() noexcept {
  g_fork_generation.fetch_add(1);
  for (CacheMemory* m : *g_registry) m->backend_->detach_after_fork(m->base_, m->bytes_);
  g_registry->clear();  // the child owns none of them
  pthread_mutex_unlock(&g_registry_mu);
}

// ---- CacheMemory ---------------------------------------------------------------

CacheMemory::CacheMemory(std::shared_ptr<VmmBackend> backend, size_t bytes)
    : backend_(std::move(backend)), bytes_(bytes), generation_(fork_generation()) {
  base_ = backend_->reserve(bytes);
  registry_add(this);
}

CacheMemory::~CacheMemory() {
  if (!in_creator_process()) return;  // the parent's memory; detached at fork
  registry_remove(this);
  try {
    teardown();
  } catch (...) {
    // Destructors never throw; teardown did all it could.
  }
}

void CacheMemory::hand_over(std::vector<uintptr_t> mapped) {
  std::lock_guard<std::mutex> lock(mu_);
  handed_over_.insert(handed_over_.end(), mapped.begin(), mapped.end());
}

void CacheMemory::on_teardown(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!torn_down_) {
      on_teardown_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

namespace {

// Unmaps `mapped` (skipping past any address that fails: it stays mapped, and
// the range then cannot be freed on CUDA), releases the pool, runs
// `after_release`, frees the range. Throws the first driver error after
// doing all it can.
void release_memory(VmmBackend& backend, uintptr_t base, size_t bytes, std::vector<uintptr_t>& mapped,
                    std::vector<std::function<void()>>& after_release) {
  std::exception_ptr first_error;
  try {
    backend.synchronize();
  } catch (...) {
    first_error = std::current_exception();
  }
  size_t at = 0;
  while (at < mapped.size()) {
    size_t done = 0;
    try {
      backend.unmap(mapped.data() + at, mapped.size() - at, &done);
      at = mapped.size();
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
      at += done + 1;
    }
  }
  mapped.clear();
  backend.close_pool();
  for (auto& fn : after_release) fn();
  after_release.clear();
  if (!backend.free_reservation(base, bytes) && !first_error)
    first_error = std::make_exception_ptr(
        DriverError("free reservation", "the address range could not be freed (pages still mapped)"));
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace

void CacheMemory::teardown() {
  std::lock_guard<std::mutex> lock(mu_);
  if (torn_down_ || !in_creator_process()) return;
  torn_down_ = true;
  // During a CUDA graph capture every step of this is a driver call the
  // capture forbids: the backend keeps the whole of it for the capture's
  // end (the backend outlives what it keeps: it runs it at the latest
  // when it goes). Its errors then have no caller to reach.
  VmmBackend* backend = backend_.get();
  std::function<void()> later = [backend, base = base_, bytes = bytes_, mapped = handed_over_,
                                 after = on_teardown_]() mutable {
    try {
      release_memory(*backend, base, bytes, mapped, after);
    } catch (...) {
    }
  };
  if (backend_->defer_until_open(later)) {
    handed_over_.clear();
    on_teardown_.clear();
    return;
  }
  release_memory(*backend_, base_, bytes_, handed_over_, on_teardown_);
}

}  // namespace vattn
