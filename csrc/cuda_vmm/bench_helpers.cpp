// Measurement helpers for benchmarks/vmm_latency.py: the raw syscall floor the
// host backend's map cost is compared with, timed in C++ so no interpreter
// overhead enters either number.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <vector>

#include "errors.h"

namespace vattn {

// Seconds per call of mmap(MAP_FIXED | MAP_SHARED, memfd) for `count` pages of
// `page_size` bytes at consecutive addresses, mapping page i to a scattered
// pool offset so the kernel cannot merge neighbours. Element 0: map, 1: unmap
// (mmap PROT_NONE anonymous over it), as the host backend does.
std::vector<double> raw_mmap_seconds(size_t page_size, size_t count) {
  int fd = memfd_create("vattn-bench", MFD_CLOEXEC);
  if (fd < 0) throw_errno("memfd_create", errno);
  if (ftruncate(fd, static_cast<off_t>(page_size * count)) != 0 ||
      fallocate(fd, 0, 0, static_cast<off_t>(page_size * count)) != 0) {
    int err = errno;
    close(fd);
    throw_errno("fallocate", err);
  }
  void* base = mmap(nullptr, page_size * count, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    int err = errno;
    close(fd);
    throw_errno("mmap(reserve)", err);
  }
  auto addr = [&](size_t i) { return static_cast<char*>(base) + i * page_size; };
  auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < count; ++i) {
    size_t page = (i * 7919) % count;  // scattered offsets, like a recycled pool
    mmap(addr(i), page_size, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_SHARED, fd,
         static_cast<off_t>(page * page_size));
  }
  auto t1 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < count; ++i)
    mmap(addr(i), page_size, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  auto t2 = std::chrono::steady_clock::now();
  munmap(base, page_size * count);
  close(fd);
  std::chrono::duration<double> map_s = t1 - t0, unmap_s = t2 - t1;
  return {map_s.count() / count, unmap_s.count() / count};
}

}  // namespace vattn
