// The host backend: the page semantics of vmm_backend.h on CPU memory (a
// memfd pool, mmap reservations). See host_backend.cpp.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <memory>

#include "backends/vmm_backend.h"

namespace vattn {

// Smallest host page size in bytes: the OS page size.
size_t host_granularity();

// The system calls inside one host operation whose failure the backend
// handles itself, so a test can fail exactly those (vattn._testing): creating
// the pool (a failed ftruncate closes the memfd again), the mmap that
// unmaps pages (at vm.max_map_count it falls back to munmap and reserves the
// range again) and the fallocate that commits a page (ENOSPC / ENOMEM there is
// out of memory, which the page manager treats as a full pool). Failures at the operations' own boundaries need no seam:
// a decorator around any VmmBackend injects those. The default calls the kernel.
class HostSystemCalls {
 public:
  virtual ~HostSystemCalls() = default;
  virtual int memfd_create(const char* name, unsigned int flags);
  virtual int ftruncate(int fd, off_t bytes);
  // Commits [offset, offset + bytes) of the pool (fallocate mode 0).
  virtual int fallocate(int fd, off_t offset, off_t bytes);
  // Puts PROT_NONE anonymous memory over [addr, addr + bytes) (MAP_FIXED).
  virtual void* mmap_unmap(void* addr, size_t bytes);
  // Reserves [addr, addr + bytes) again after munmap left it a hole: PROT_NONE, MAP_FIXED_NOREPLACE (it
  // fails where another mapping of the process took the hole meanwhile).
  virtual void* reserve_again(void* addr, size_t bytes);
};

// A host backend of `num_pages` pages of `page_size` bytes (a multiple of
// host_granularity()). `calls`: the system calls above (null: the kernel's).
std::shared_ptr<VmmBackend> make_host_backend(size_t page_size, size_t num_pages,
                                              std::shared_ptr<HostSystemCalls> calls = nullptr);

}  // namespace vattn
