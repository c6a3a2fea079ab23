// Host backend: the page semantics of vmm_backend.h on CPU memory.
//   pool        = one memfd of num_pages * page_size bytes (sparse until created)
//   create      = fallocate the page's slice (commits memory), then write its zeros
//   reserve     = mmap(PROT_NONE, MAP_NORESERVE) (address space only)
//   map         = mmap(MAP_FIXED | MAP_SHARED, memfd, page offset); one call per
//                 run of adjacent addresses backed by adjacent pages
//   populate    = madvise(MADV_POPULATE_READ) over each run of adjacent addresses
//   unmap       = map PROT_NONE anonymous memory back over it (the range stays
//                 reserved); one call per run of adjacent addresses
// A MAP_FIXED mmap either replaces the whole range or fails leaving it as it was
// (it may fail with ENOMEM when splitting a mapping would pass vm.max_map_count),
// so a run is the unit of success and failure.
#include "backends/host_backend.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backends/backend_registry.h"
#include "common/errors.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14's value, for C libraries whose headers predate it
#endif

namespace vattn {

size_t host_granularity() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

int HostSystemCalls::memfd_create(const char* name, unsigned int flags) { return ::memfd_create(name, flags); }

int HostSystemCalls::ftruncate(int fd, off_t bytes) { return ::ftruncate(fd, bytes); }

int HostSystemCalls::fallocate(int fd, off_t offset, off_t bytes) { return ::fallocate(fd, 0, offset, bytes); }

void* HostSystemCalls::mmap_unmap(void* addr, size_t bytes) {
  return mmap(addr, bytes, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
}

void* HostSystemCalls::reserve_again(void* addr, size_t bytes) {
  return mmap(addr, bytes, PROT_NONE, MAP_FIXED_NOREPLACE | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
}

namespace {

// ---- the pool -----------------------------------------------------------------

// Owns the memfd; closing it frees every page not mapped anywhere.
class MemfdPool {
 public:
  MemfdPool(size_t bytes, HostSystemCalls& calls) {
    // Growing a file past RLIMIT_FSIZE raises SIGXFSZ, which kills the process:
    // refuse before asking.
    struct rlimit limit;
    if (getrlimit(RLIMIT_FSIZE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY &&
        bytes > limit.rlim_cur)
      throw DriverError("ftruncate(memfd)",
                        "the page pool needs " + std::to_string(bytes) +
                            " bytes but RLIMIT_FSIZE (ulimit -f) allows " +
                            std::to_string(limit.rlim_cur) +
                            "; lower physical_memory or raise the limit");
    fd_ = calls.memfd_create("vattn-kv-pool", MFD_CLOEXEC);
    if (fd_ < 0) throw_errno("memfd_create", errno);
    if (calls.ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
      int err = errno;
      close(fd_);
      throw_errno("ftruncate(memfd)", err);
    }
  }
  ~MemfdPool() {
    if (fd_ >= 0) close(fd_);
  }
  MemfdPool(const MemfdPool&) = delete;
  MemfdPool& operator=(const MemfdPool&) = delete;
  int fd() const { return fd_; }
  // Fork child: the parent's file; closed here so the child never pins it.
  void forget() noexcept {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

class HostBackend final : public VmmBackend {
 public:
  HostBackend(size_t page_size, size_t num_pages, std::shared_ptr<HostSystemCalls> calls)
      : page_size_(page_size),
        num_pages_(num_pages),
        calls_(std::move(calls)),
        pool_(std::make_unique<MemfdPool>(page_size * num_pages, *calls_)) {}

  std::string name() const override { return "host"; }
  size_t granularity() const override { return host_granularity(); }
  size_t page_size() const override { return page_size_; }
  size_t num_pages() const override { return num_pages_; }
  DLDevice dl_device() const override { return DLDevice{kDLCPU, 0}; }

  uintptr_t reserve(size_t bytes) override {
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      if (err == ENOMEM)
        throw DriverError("mmap(reserve)", "ENOMEM: no free range of " + std::to_string(bytes) +
                                               " bytes of address space (RLIMIT_AS, ulimit -v, "
                                               "may be lower); lower max_batch_size or "
                                               "max_context_len");
      throw_errno("mmap(reserve)", err);
    }
    return reinterpret_cast<uintptr_t>(p);
  }

  bool free_reservation(uintptr_t base, size_t bytes) noexcept override {
    // One munmap over whole mappings never needs a split, so it cannot hit
    // vm.max_map_count; it also drops any page an unmap failed to remove.
    // A lost range (unmap_run) is skipped: another mapping may hold it now.
    bool ok = true;
    outside_holes(base, bytes, [&](uintptr_t at, size_t n) {
      ok = munmap(reinterpret_cast<void*>(at), n) == 0 && ok;
    });
    return ok;
  }

  void create_pages(const uint32_t* ids, size_t count) override {
    check_pool();
    for (size_t i = 0; i < count; ++i) {
      if (calls_->fallocate(pool_->fd(), offset(ids[i]), static_cast<off_t>(page_size_)) != 0) {
        int err = errno;
        release_pages(ids, i + 1);  // a partial fallocate may have committed some
        if (err == ENOSPC || err == ENOMEM)
          throw OutOfMemory("fallocate", "errno " + std::to_string(err) + " (" + std::strerror(err) +
                                             "): the host cannot commit another page");
        throw_errno("fallocate", err);
      }
    }
    for (size_t i = 0; i < count; ++i) clear(ids[i]);
  }

  size_t release_pages(const uint32_t* ids, size_t count, uint8_t* failed = nullptr) noexcept override {
    if (failed) std::fill(failed, failed + count, uint8_t{0});
    if (!pool_ || pool_->fd() < 0) return 0;  // the pool is gone, and its memory with it
    size_t kept = 0;
    for (size_t i = 0; i < count; ++i) {
      // A page whose hole punch fails keeps its memory; a later fallocate of
      // it (create_pages) finds it committed already.
      if (fallocate(pool_->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset(ids[i]),
                    static_cast<off_t>(page_size_)) != 0) {
        ++kept;
        if (failed) failed[i] = 1;
      }
    }
    return kept;
  }

  void map(const PageMapping* mappings, size_t count, size_t* done) override {
    *done = 0;
    check_pool();
    for (size_t i = 0; i < count;) {
      size_t n = 1;  // a run: adjacent addresses backed by adjacent pages
      while (i + n < count && mappings[i + n].addr == mappings[i].addr + n * page_size_ &&
             mappings[i + n].page == mappings[i].page + n)
        ++n;
      void* want = reinterpret_cast<void*>(mappings[i].addr);
      if (has_holes_.load(std::memory_order_relaxed) && in_hole(mappings[i].addr, n * page_size_))
        throw DriverError("mmap(map page)", "this part of the cache's address range was lost to another "
                                            "mapping after a failed unmap; it cannot be used");
      void* got = mmap(want, n * page_size_, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_SHARED, pool_->fd(),
                       offset(mappings[i].page));
      if (got == MAP_FAILED) {
        int err = errno;
        if (err == ENOMEM)
          throw DriverError("mmap(map page)",
                            "ENOMEM: the process may have reached vm.max_map_count mappings "
                            "(each mapped page can be one mapping; use a larger page_size)");
        throw_errno("mmap(map page)", err);
      }
      i += n;
      *done = i;
    }
  }

  // The map leaves page-table entries to first touch, a fault per OS page: a decode writes a page over
  // many steps, a fault at a time, where making them at once would put a whole page's on the step that
  // maps it. A framework that writes its blocks right after mapping them (PageManager::map_pages) has
  // them made here in one pass instead: about 0.3 us per 4 KiB against 1.2-1.4 for the faults on a Zen 4
  // (docs/benchmarks.md, "Mapping: the host backend"). MADV_POPULATE_READ maps up to 16 pages a fault
  // where _WRITE takes one (twice the time, in a one-off probe there), and a shared memfd mapping needs
  // no write notification, so its read-populated entries are writable: the first write takes no fault.
  void populate(const uintptr_t* addrs, size_t count) noexcept override {
    if (!populate_works_.load(std::memory_order_relaxed)) return;
    for (size_t i = 0; i < count;) {
      size_t n = 1;
      while (i + n < count && addrs[i + n] == addrs[i] + n * page_size_) ++n;
      if (madvise(reinterpret_cast<void*>(addrs[i]), n * page_size_, MADV_POPULATE_READ) != 0 && errno == EINVAL) {
        populate_works_.store(false, std::memory_order_relaxed);  // a kernel before 5.14: first touch does it
        return;
      }
      i += n;
    }
  }

  void unmap(const uintptr_t* addrs, size_t count, size_t* done) override {
    *done = 0;
    bool lost = false;
    for (size_t i = 0; i < count;) {
      size_t n = 1;
      while (i + n < count && addrs[i + n] == addrs[i] + n * page_size_) ++n;
      lost = !unmap_run(addrs[i], n * page_size_) || lost;
      i += n;
      *done = i;  // a lost range's pages are gone too: the table must not keep them
    }
    if (lost)
      throw DriverError("mmap(unmap page)", "the pages were unmapped but an address range could not be "
                                            "reserved again; that range of the cache is lost");
  }

  void copy(uintptr_t dst, uintptr_t src, size_t bytes) override {
    std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
  }

  void synchronize() override {}  // CPU work is synchronous with the caller
  bool reads_done(uint64_t) noexcept override { return true; }

  void close_pool() noexcept override { pool_.reset(); }

  void detach_after_fork(uintptr_t base, size_t bytes) noexcept override {
    // The child's copies of the parent's shared mappings go; touching the
    // range in the child faults instead of writing the parent's pages.
    outside_holes(base, bytes, [](uintptr_t at, size_t n) {
      mmap(reinterpret_cast<void*>(at), n, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    });
    if (pool_) pool_->forget();
  }

 private:
  void check_pool() const {
    if (!pool_ || pool_->fd() < 0) throw ClosedError("the host page pool was closed");
  }

  off_t offset(uint32_t page) const { return static_cast<off_t>(page) * page_size_; }

  // fallocate commits a page's memory but leaves the kernel's zeroing of it to its first use: in a
  // forward's fault, or in map_pages' populate (which took ten times as long on such pages as on pages
  // used before, 16 MiB of 64 KiB pages on a Zen 4, one-off). Writing the zeros here puts that work
  // where the page is created: at start-up for a pool created whole (as a dense cache is zeroed when it
  // is allocated), or in the mapper's creation rounds. A write that fails leaves it to the first use.
  void clear(uint32_t page) noexcept {
    static const char zeros[64 << 10] = {};
    for (size_t at = 0; at < page_size_;) {
      const size_t n = std::min(sizeof(zeros), page_size_ - at);
      const ssize_t wrote = pwrite(pool_->fd(), zeros, n, offset(page) + static_cast<off_t>(at));
      if (wrote <= 0) return;
      at += static_cast<size_t>(wrote);
    }
  }

  // Puts reserved, inaccessible memory back over [addr, addr + len): one
  // mmap that replaces the pages, so the range never has a hole another
  // mapping could take. At vm.max_map_count the kernel refuses any new
  // mapping; then munmap (which needs none unless it splits one) frees the
  // pages first and the reservation is restored over the hole at once,
  // refusing to replace anything that took the hole in between.
  // Returns false when the pages went but the range could not be reserved
  // again (recorded as lost: never mapped or unmapped by vattn again).
  bool unmap_run(uintptr_t addr, size_t len) {
    void* want = reinterpret_cast<void*>(addr);
    if (calls_->mmap_unmap(want, len) != MAP_FAILED) return true;
    int err = errno;
    if (err != ENOMEM) throw_errno("mmap(unmap page)", err);
    if (munmap(want, len) != 0)
      throw DriverError("mmap(unmap page)",
                        "ENOMEM: unmapping would split a mapping and the process is at "
                        "vm.max_map_count; the page stays mapped and is retried later");
    void* got = calls_->reserve_again(want, len);
    if (got == want) return true;
    if (got != MAP_FAILED) munmap(got, len);  // an old kernel placed it elsewhere
    // The pages are unmapped, but the reservation has a hole now, which another mapping of the
    // process may take: never map, unmap or free there.
    std::lock_guard<std::mutex> lock(holes_mu_);
    holes_.push_back({addr, len});
    has_holes_ = true;
    return false;
  }

  // fn(at, n) for each piece of [base, base + bytes) outside the lost ranges, in order.
  template <typename Fn>
  void outside_holes(uintptr_t base, size_t bytes, Fn fn) noexcept {
    std::vector<std::pair<uintptr_t, size_t>> holes;
    if (has_holes_) {
      std::lock_guard<std::mutex> lock(holes_mu_);
      holes = holes_;
    }
    std::sort(holes.begin(), holes.end());
    uintptr_t at = base;
    const uintptr_t end = base + bytes;
    for (auto [lo, n] : holes) {
      if (lo + n <= at || lo >= end) continue;
      if (lo > at) fn(at, lo - at);
      at = std::max(at, lo + n);
    }
    if (at < end) fn(at, end - at);
  }

  bool in_hole(uintptr_t addr, size_t len) {
    std::lock_guard<std::mutex> lock(holes_mu_);
    for (auto [lo, n] : holes_)
      if (addr < lo + n && lo < addr + len) return true;
    return false;
  }

  size_t page_size_;
  size_t num_pages_;
  std::shared_ptr<HostSystemCalls> calls_;  // see host_backend.h
  std::unique_ptr<MemfdPool> pool_;  // null once closed
  std::mutex holes_mu_;
  std::vector<std::pair<uintptr_t, size_t>> holes_;  // unmapped, not reserved again (see unmap_run)
  std::atomic<bool> has_holes_{false};
  std::atomic<bool> populate_works_{true};  // false once the kernel refused MADV_POPULATE_READ
};

}  // namespace

std::shared_ptr<VmmBackend> make_host_backend(size_t page_size, size_t num_pages,
                                              std::shared_ptr<HostSystemCalls> calls) {
  if (page_size == 0 || page_size % host_granularity() != 0)
    throw std::invalid_argument("page_size must be a positive multiple of " +
                                std::to_string(host_granularity()) + " bytes, got " +
                                std::to_string(page_size));
  if (num_pages == 0 || num_pages > UINT32_MAX)
    throw std::invalid_argument("num_pages must be in [1, 2^32), got " + std::to_string(num_pages));
  size_t bytes = 0;
  if (__builtin_mul_overflow(page_size, num_pages, &bytes) || bytes > (size_t{1} << 62))
    throw std::invalid_argument("the page pool of " + std::to_string(num_pages) + " pages of " +
                                std::to_string(page_size) + " bytes is too large");
  if (!calls) calls = std::make_shared<HostSystemCalls>();
  return std::make_shared<HostBackend>(page_size, num_pages, std::move(calls));
}

namespace {
std::shared_ptr<VmmBackend> make_host_from_params(const BackendParams& p) {
  return make_host_backend(p.page_size, p.num_pages);
}

ProbeData probe_granularity(const ProbeData&) {
  return {{"granularity", static_cast<int64_t>(host_granularity())}};
}
}  // namespace

VATTN_REGISTER_BACKEND(host, make_host_from_params,
                       {"granularity", probe_granularity,
                        "granularity: the OS page size in bytes; host page sizes are its multiples", {}});

}  // namespace vattn
