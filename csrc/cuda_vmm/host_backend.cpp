// Host backend: the DESIGN.md section 2 semantics on CPU memory.
//   pool        = one memfd of num_pages * page_size bytes (sparse until created)
//   create      = fallocate the page's slice (commits memory)
//   reserve     = mmap(PROT_NONE, MAP_NORESERVE) (address space only)
//   map         = mmap(MAP_FIXED | MAP_SHARED, memfd, page offset)
//   unmap       = map PROT_NONE anonymous memory back over it (the range stays reserved)
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>

#include "errors.h"
#include "vmm_backend.h"

namespace vattn {

size_t host_granularity() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

namespace {

// Owns the memfd; closing it frees every page not mapped anywhere.
class MemfdPool {
 public:
  explicit MemfdPool(size_t bytes) {
    fd_ = memfd_create("vattn-kv-pool", MFD_CLOEXEC);
    if (fd_ < 0) throw_errno("memfd_create", errno);
    if (ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
      int err = errno;
      close(fd_);
      throw_errno("ftruncate", err);
    }
  }
  ~MemfdPool() { close(fd_); }
  MemfdPool(const MemfdPool&) = delete;
  MemfdPool& operator=(const MemfdPool&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

class HostBackend final : public VmmBackend {
 public:
  HostBackend(size_t page_size, size_t num_pages)
      : page_size_(page_size),
        num_pages_(num_pages),
        pool_(std::make_unique<MemfdPool>(page_size * num_pages)) {}

  std::string name() const override { return "host"; }
  size_t granularity() const override { return host_granularity(); }
  size_t page_size() const override { return page_size_; }
  size_t num_pages() const override { return num_pages_; }
  DLDevice dl_device() const override { return DLDevice{kDLCPU, 0}; }

  uintptr_t reserve(size_t bytes) override {
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw_errno("mmap(reserve)", errno);
    return reinterpret_cast<uintptr_t>(p);
  }

  void free_reservation(uintptr_t base, size_t bytes) noexcept override {
    munmap(reinterpret_cast<void*>(base), bytes);
  }

  void create_pages(const uint32_t* ids, size_t count) override {
    check_pool();
    for (size_t i = 0; i < count; ++i) {
      if (fallocate(pool_->fd(), 0, offset(ids[i]), static_cast<off_t>(page_size_)) != 0) {
        int err = errno;
        release_pages(ids, i + 1);  // a partial fallocate may have committed some
        throw_errno("fallocate", err);
      }
    }
  }

  void release_pages(const uint32_t* ids, size_t count) noexcept override {
    if (!pool_) return;
    for (size_t i = 0; i < count; ++i)
      fallocate(pool_->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset(ids[i]),
                static_cast<off_t>(page_size_));
  }

  void map(const PageMapping* mappings, size_t count) override {
    check_pool();
    for (size_t i = 0; i < count; ++i) {
      void* want = reinterpret_cast<void*>(mappings[i].addr);
      void* got = mmap(want, page_size_, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_SHARED,
                       pool_->fd(), offset(mappings[i].page));
      if (got == MAP_FAILED) {
        int err = errno;
        for (size_t j = 0; j < i; ++j) unmap_one(mappings[j].addr);
        if (err == ENOMEM)
          throw DriverError("mmap(map page)",
                            "ENOMEM: the process may have reached vm.max_map_count mappings "
                            "(each mapped page can be one mapping; use a larger page_size)");
        throw_errno("mmap(map page)", err);
      }
    }
  }

  void unmap(const uintptr_t* addrs, size_t count) override {
    for (size_t i = 0; i < count; ++i) {
      if (!unmap_one(addrs[i])) throw_errno("mmap(unmap page)", errno);
    }
  }

  void synchronize() override {}  // CPU work is synchronous with the caller

  void close_pool() noexcept override { pool_.reset(); }

 private:
  void check_pool() const {
    if (!pool_) throw ClosedError("the host page pool was closed");
  }

  off_t offset(uint32_t page) const { return static_cast<off_t>(page) * page_size_; }

  bool unmap_one(uintptr_t addr) noexcept {
    void* p = mmap(reinterpret_cast<void*>(addr), page_size_, PROT_NONE,
                   MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p != MAP_FAILED;
  }

  size_t page_size_;
  size_t num_pages_;
  std::unique_ptr<MemfdPool> pool_;  // null once closed
};

}  // namespace

std::shared_ptr<VmmBackend> make_host_backend(size_t page_size, size_t num_pages) {
  if (page_size == 0 || page_size % host_granularity() != 0)
    throw std::invalid_argument("page_size must be a positive multiple of " +
                                std::to_string(host_granularity()) + " bytes, got " +
                                std::to_string(page_size));
  if (num_pages == 0 || num_pages > UINT32_MAX)
    throw std::invalid_argument("num_pages must be in [1, 2^32), got " + std::to_string(num_pages));
  return std::make_shared<HostBackend>(page_size, num_pages);
}

}  // namespace vattn
