// The host backend: the page semantics of vmm_backend.h on CPU memory (a
// memfd pool, mmap reservations). See host_backend.cpp.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "backends/vmm_backend.h"

namespace vattn {

// Smallest host page size in bytes: the OS page size.
size_t host_granularity();

// A host backend of `num_pages` pages of `page_size` bytes (a multiple of
// host_granularity()).
std::shared_ptr<VmmBackend> make_host_backend(size_t page_size, size_t num_pages);

// Test hook: the next `skip` host calls named `call` (memfd_create, ftruncate,
// fallocate, mmap_reserve, mmap_map, mmap_unmap, munmap) succeed, then `times`
// calls (-1: all) fail with errno `err`. times = 0 clears it.
void host_inject_failure(const std::string& call, long skip, long times, int err);
// Test hook: every page map and page creation on the host sleeps this long.
void host_inject_delay(long microseconds);

}  // namespace vattn
