// One interface over the two virtual-memory backends (host memfd + mmap, and
// the CUDA driver's VMM). A backend knows address ranges and physical pages,
// nothing about requests, layers or tensors.
//
// Physical pages form one pool of `num_pages` pages of `page_size` bytes, named
// by index 0..num_pages-1. A page must be created before it is mapped and may be
// mapped at one address at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dlpack.h"

namespace vattn {

// One page-sized mapping: physical page `page` at virtual address `addr`.
struct PageMapping {
  uintptr_t addr;
  uint32_t page;
};

class VmmBackend {
 public:
  virtual ~VmmBackend() = default;

  virtual std::string name() const = 0;
  // Smallest page size in bytes the backend can map; page sizes are multiples of it.
  virtual size_t granularity() const = 0;
  virtual size_t page_size() const = 0;
  virtual size_t num_pages() const = 0;
  virtual DLDevice dl_device() const = 0;

  // Reserves `bytes` (a multiple of page_size) of address space; commits nothing.
  virtual uintptr_t reserve(size_t bytes) = 0;
  // Returns a reservation; every page in it must be unmapped. Never throws.
  virtual void free_reservation(uintptr_t base, size_t bytes) noexcept = 0;

  // Creates (commits) the physical pages `ids`. On failure the pages created
  // by this call are released again, then it throws.
  virtual void create_pages(const uint32_t* ids, size_t count) = 0;
  // Releases created, unmapped physical pages. Never throws.
  virtual void release_pages(const uint32_t* ids, size_t count) noexcept = 0;

  // Maps each page at its address, readable and writable. All or nothing: on
  // failure the mappings this call made are undone, then it throws.
  virtual void map(const PageMapping* mappings, size_t count) = 0;
  // Unmaps page-sized mappings at `addrs`. Callers first make sure no device
  // work still reads them (see synchronize). Throws DriverError on failure.
  virtual void unmap(const uintptr_t* addrs, size_t count) = 0;
  // Waits until device work that may read mapped pages has finished.
  virtual void synchronize() = 0;
  // Releases every physical page and the pool's own handles; no page may be
  // mapped. Afterwards the backend only frees reservations (tensor views may
  // outlive the pool). Never throws.
  virtual void close_pool() noexcept = 0;
};

// Host backend: memfd pool, mmap reservation. page_size: multiple of the OS page size.
std::shared_ptr<VmmBackend> make_host_backend(size_t page_size, size_t num_pages);
size_t host_granularity();

// CUDA backend on `device` through the driver library at `driver_path`.
std::shared_ptr<VmmBackend> make_cuda_backend(const std::string& driver_path, int device,
                                              size_t page_size, size_t num_pages);

// Device facts the Python layer needs before it builds a backend.
struct CudaDeviceInfo {
  int device_count = 0;
  int driver_version = 0;
  std::string name;
  size_t granularity = 0;
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};
CudaDeviceInfo cuda_device_info(const std::string& driver_path, int device);

// An address range owned jointly by the page manager and every tensor view of
// it (DLPack capsules hold a shared_ptr), so the range is never reused while a
// view exists. Its destructor returns the range to the backend.
class Reservation {
 public:
  Reservation(std::shared_ptr<VmmBackend> backend, size_t bytes);
  ~Reservation();
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;

  uintptr_t base() const { return base_; }
  size_t bytes() const { return bytes_; }
  DLDevice dl_device() const { return backend_->dl_device(); }

 private:
  std::shared_ptr<VmmBackend> backend_;
  uintptr_t base_;
  size_t bytes_;
};

}  // namespace vattn
