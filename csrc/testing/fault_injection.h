// Failing and slow backends for tests, out of the production extension:
//
// - FaultInjectingBackend wraps any VmmBackend and forwards every call,
//   failing or delaying the ones a FaultPlan names. It fails at the
//   granularity of the host backend's own system calls: one page of
//   create_pages (one fallocate), one run of map (consecutive addresses
//   backed by consecutive pages: one mmap) or of unmap (consecutive
//   addresses), one page of release_pages (one hole punch: the page keeps
//   its memory), so a failure part-way through a batch leaves exactly the
//   pages before it mapped, as the host backend's own failure would.
// - FaultyHostCalls fails the system calls inside one host operation that
//   the host backend recovers from itself (host_backend.h: creating the pool,
//   the mmap of an unmap, whose ENOMEM takes the munmap fallback) or
//   classifies (the fallocate of a page: ENOSPC / ENOMEM is out of memory).
//
// Both read one FaultPlan, which the test holds (vattn._testing.FaultPlan).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backends/host_backend.h"
#include "backends/vmm_backend.h"

namespace vattn {

// Which calls fail and how slow pages are. Thread-safe: the mapper thread
// and the test's threads consult one plan.
class FaultPlan {
 public:
  // The names fail() accepts: the VmmBackend operations the decorator
  // injects into, then the host system calls of FaultyHostCalls.
  static const std::vector<std::string>& calls();

  // The next `skip` calls named `call` succeed, then `times` calls (-1: all)
  // fail with errno `err`. times = 0 clears the plan. invalid_argument for a
  // name not in calls().
  void fail(const std::string& call, long skip, long times, int err);
  void clear() { fail("", 0, 0, 0); }
  // Every map run and every page creation sleeps this long first (0: off).
  void delay(long microseconds) { delay_us_ = microseconds; }

  // True, with the errno to report in *err, when this call of `call` fails.
  bool fails(const char* call, int* err);
  // Whether the next call of `call` fails (nothing counted).
  bool next_fails(const char* call);
  // Sleeps for the plan's delay (a map run or a page creation).
  void pause() const;

 private:
  std::mutex mu_;
  std::string call_;
  long skip_ = 0;
  long times_ = 0;
  int err_ = 0;
  std::atomic<bool> armed_{false};
  std::atomic<long> delay_us_{0};
};

class FaultInjectingBackend final : public VmmBackend {
 public:
  FaultInjectingBackend(std::shared_ptr<VmmBackend> inner, std::shared_ptr<FaultPlan> plan)
      : inner_(std::move(inner)), plan_(std::move(plan)) {}

  std::string name() const override { return inner_->name(); }
  size_t granularity() const override { return inner_->granularity(); }
  size_t page_size() const override { return inner_->page_size(); }
  size_t num_pages() const override { return inner_->num_pages(); }
  DLDevice dl_device() const override { return inner_->dl_device(); }

  uintptr_t reserve(size_t bytes) override;
  bool free_reservation(uintptr_t base, size_t bytes) noexcept override;
  void create_pages(const uint32_t* ids, size_t count) override;
  size_t release_pages(const uint32_t* ids, size_t count, uint8_t* failed = nullptr) noexcept override;
  void map(const PageMapping* mappings, size_t count, size_t* done) override;
  void populate(const uintptr_t* addrs, size_t count) noexcept override { inner_->populate(addrs, count); }
  void unmap(const uintptr_t* addrs, size_t count, size_t* done) override;
  void copy(uintptr_t dst, uintptr_t src, size_t bytes) override;
  void synchronize() override;
  uint64_t record_reads() noexcept override { return inner_->record_reads(); }
  bool reads_done(uint64_t ticket) noexcept override { return inner_->reads_done(ticket); }
  void wait_reads(uint64_t ticket) override;
  void close_pool() noexcept override { inner_->close_pool(); }
  void set_sync_streams(const std::vector<uintptr_t>& streams) override { inner_->set_sync_streams(streams); }
  void suspend_driver_calls() override { inner_->suspend_driver_calls(); }
  void resume_driver_calls() override { inner_->resume_driver_calls(); }
  void capture_begin() override { inner_->capture_begin(); }
  void capture_end() noexcept override { inner_->capture_end(); }
  std::vector<std::pair<std::string, std::string>> facts() const override { return inner_->facts(); }
  void detach_after_fork(uintptr_t base, size_t bytes) noexcept override { inner_->detach_after_fork(base, bytes); }

 private:
  // Throws the DriverError of an injected failure when `call` fails now.
  void check(const char* call);

  std::shared_ptr<VmmBackend> inner_;
  std::shared_ptr<FaultPlan> plan_;
};

class FaultyHostCalls final : public HostSystemCalls {
 public:
  explicit FaultyHostCalls(std::shared_ptr<FaultPlan> plan) : plan_(std::move(plan)) {}
  int memfd_create(const char* name, unsigned int flags) override;
  int ftruncate(int fd, off_t bytes) override;
  int fallocate(int fd, off_t offset, off_t bytes) override;
  void* mmap_unmap(void* addr, size_t bytes) override;
  void* reserve_again(void* addr, size_t bytes) override;

 private:
  std::shared_ptr<FaultPlan> plan_;
};

}  // namespace vattn
