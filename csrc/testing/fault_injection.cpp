#include "testing/fault_injection.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "common/errors.h"
#include "common/released_gil.h"
#include "testing/testing.h"

namespace vattn {

// ---- FaultPlan -------------------------------------------------------------------

const std::vector<std::string>& FaultPlan::calls() {
  static const std::vector<std::string> names = {
      "reserve", "free_reservation", "create_pages", "release_pages", "map", "unmap", "copy", "synchronize",
      "wait_reads",
      "memfd_create", "ftruncate", "mmap_unmap", "fallocate", "reserve_again"};
  return names;
}

void FaultPlan::fail(const std::string& call, long skip, long times, int err) {
  if (times != 0) {
    bool known = false;
    for (const std::string& name : calls()) known = known || name == call;
    if (!known) {
      std::string list;
      for (const std::string& name : calls()) list += (list.empty() ? "" : ", ") + name;
      throw std::invalid_argument("call must be one of " + list + "; got '" + call + "'");
    }
    if (skip < 0) throw std::invalid_argument("skip must be >= 0, got " + std::to_string(skip));
  }
  std::lock_guard<std::mutex> lock(mu_);
  call_ = call;
  skip_ = skip;
  times_ = times;
  err_ = err;
  armed_ = times != 0;
}

bool FaultPlan::fails(const char* call, int* err) {
  if (!armed_.load(std::memory_order_relaxed)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  if (times_ == 0 || call_ != call) return false;
  if (skip_ > 0) {
    --skip_;
    return false;
  }
  if (times_ > 0 && --times_ == 0) armed_ = false;
  *err = err_;
  return true;
}

bool FaultPlan::next_fails(const char* call) {
  if (!armed_.load(std::memory_order_relaxed)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return times_ != 0 && skip_ == 0 && call_ == call;
}

void FaultPlan::pause() const {
  long us = delay_us_.load(std::memory_order_relaxed);
  if (us > 0) usleep(static_cast<useconds_t>(us));
}

// ---- FaultInjectingBackend ---------------------------------------------------------

void FaultInjectingBackend::check(const char* call) {
  int err = 0;
  if (plan_->fails(call, &err))
    throw DriverError(std::string(call) + " (injected)",
                      "errno " + std::to_string(err) + " (" + std::strerror(err) + ")");
}

uintptr_t FaultInjectingBackend::reserve(size_t bytes) {
  check("reserve");
  return inner_->reserve(bytes);
}

bool FaultInjectingBackend::free_reservation(uintptr_t base, size_t bytes) noexcept {
  int err = 0;
  if (plan_->fails("free_reservation", &err)) return false;  // the range stays reserved, as after a failed munmap
  return inner_->free_reservation(base, bytes);
}

void FaultInjectingBackend::create_pages(const uint32_t* ids, size_t count) {
  // One page per call, so a failure can come after some pages: those the
  // call created go back, as the contract says.
  for (size_t i = 0; i < count; ++i) {
    plan_->pause();
    try {
      check("create_pages");
      inner_->create_pages(ids + i, 1);
    } catch (...) {
      inner_->release_pages(ids, i);
      throw;
    }
  }
}

size_t FaultInjectingBackend::release_pages(const uint32_t* ids, size_t count, uint8_t* failed) noexcept {
  // One page per call: a page whose injected failure comes keeps its memory
  // in the inner backend, as after a failed hole punch (created there still).
  size_t kept = 0;
  for (size_t i = 0; i < count; ++i) {
    int err = 0;
    bool refused = plan_->fails("release_pages", &err) || inner_->release_pages(ids + i, 1) != 0;
    if (failed) failed[i] = refused ? 1 : 0;
    kept += refused;
  }
  return kept;
}

void FaultInjectingBackend::map(const PageMapping* mappings, size_t count, size_t* done) {
  *done = 0;
  const size_t page = inner_->page_size();
  while (*done < count) {
    const PageMapping* run = mappings + *done;
    size_t n = 1;  // consecutive addresses backed by consecutive pages
    while (*done + n < count && run[n].addr == run[0].addr + n * page && run[n].page == run[0].page + n) ++n;
    plan_->pause();
    check("map");
    size_t mapped = 0;
    try {
      inner_->map(run, n, &mapped);
    } catch (...) {
      *done += mapped;
      throw;
    }
    *done += n;
  }
}

void FaultInjectingBackend::unmap(const uintptr_t* addrs, size_t count, size_t* done) {
  *done = 0;
  const size_t page = inner_->page_size();
  while (*done < count) {
    const uintptr_t* run = addrs + *done;
    size_t n = 1;  // consecutive addresses
    while (*done + n < count && run[n] == run[0] + n * page) ++n;
    check("unmap");
    size_t unmapped = 0;
    try {
      inner_->unmap(run, n, &unmapped);
    } catch (...) {
      *done += unmapped;
      throw;
    }
    *done += n;
  }
}

void FaultInjectingBackend::copy(uintptr_t dst, uintptr_t src, size_t bytes) {
  check("copy");
  inner_->copy(dst, src, bytes);
}

void FaultInjectingBackend::synchronize() {
  check("synchronize");
  inner_->synchronize();
}

void FaultInjectingBackend::wait_reads(uint64_t ticket) {
  if (ticket != kNoReads) check("wait_reads");
  inner_->wait_reads(ticket);
}

// ---- FaultyHostCalls -------------------------------------------------------------

int FaultyHostCalls::memfd_create(const char* name, unsigned int flags) {
  int err = 0;
  if (plan_->fails("memfd_create", &err)) {
    errno = err;
    return -1;
  }
  return HostSystemCalls::memfd_create(name, flags);
}

int FaultyHostCalls::ftruncate(int fd, off_t bytes) {
  int err = 0;
  if (plan_->fails("ftruncate", &err)) {
    errno = err;
    return -1;
  }
  return HostSystemCalls::ftruncate(fd, bytes);
}

int FaultyHostCalls::fallocate(int fd, off_t offset, off_t bytes) {
  int err = 0;
  if (plan_->fails("fallocate", &err)) {
    errno = err;
    return -1;
  }
  return HostSystemCalls::fallocate(fd, offset, bytes);
}

void* FaultyHostCalls::mmap_unmap(void* addr, size_t bytes) {
  int err = 0;
  if (plan_->fails("mmap_unmap", &err)) {
    errno = err;
    return MAP_FAILED;
  }
  if (plan_->next_fails("reserve_again")) {  // it follows only this ENOMEM: the process at vm.max_map_count
    errno = ENOMEM;
    return MAP_FAILED;
  }
  return HostSystemCalls::mmap_unmap(addr, bytes);
}

void* FaultyHostCalls::reserve_again(void* addr, size_t bytes) {
  int err = 0;
  if (plan_->fails("reserve_again", &err)) {
    // Another mapping of the process takes the hole first (read-write, one byte set, left there for the
    // test to find intact): the reservation then fails as it would (EEXIST).
    void* other = mmap(addr, bytes, PROT_READ | PROT_WRITE, MAP_FIXED_NOREPLACE | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (other == addr) *static_cast<unsigned char*>(other) = 0xA5;
  }
  return HostSystemCalls::reserve_again(addr, bytes);
}

// ---- bindings --------------------------------------------------------------------

void bind_fault_injection(py::module_& m) {
  py::class_<FaultPlan, std::shared_ptr<FaultPlan>>(
      m, "FaultPlan", "Which backend calls fail and how slow pages are; shared by the backends built with it.")
      .def(py::init<>())
      .def("fail", &FaultPlan::fail, py::arg("call"), py::arg("skip") = 0, py::arg("times") = 1,
           py::arg("errno") = ENOMEM,
           "The next `skip` calls named `call` succeed, then `times` calls (-1: all) fail with `errno` "
           "(0 clears). Calls: the VmmBackend operations reserve, free_reservation, create_pages (per page), "
           "map (per run), unmap (per run), copy, synchronize, wait_reads; on the host backend also "
           "memfd_create, ftruncate, mmap_unmap, fallocate (one page's commit: ENOSPC / ENOMEM there is "
           "out of memory, which the page manager takes for a full pool) and reserve_again (mmap_unmap meets "
           "ENOMEM, as at vm.max_map_count, and in the hole its munmap fallback leaves another mapping lands "
           "first, read-write with 0xA5 in its first byte).")
      .def("clear", &FaultPlan::clear, "No call fails any more (the delay stays).")
      .def("delay", &FaultPlan::delay, py::arg("microseconds"),
           "Every map run and every page creation sleeps this long first (0: off).")
      .def_property_readonly_static("calls", [](py::object) { return FaultPlan::calls(); });
  m.def(
      "fault_injecting_backend",
      [](std::shared_ptr<VmmBackend> backend, std::shared_ptr<FaultPlan> plan) -> std::shared_ptr<VmmBackend> {
        if (!backend || !plan) throw std::invalid_argument("backend and plan must not be None");
        return std::make_shared<FaultInjectingBackend>(std::move(backend), std::move(plan));
      },
      py::arg("backend"), py::arg("plan"),
      "`backend` (any vattn._C.VmmBackend) with the failures and delays of `plan` injected.");
  m.def(
      "make_faulty_host_backend",
      [](size_t page_size, size_t num_pages, std::shared_ptr<FaultPlan> plan) -> std::shared_ptr<VmmBackend> {
        if (!plan) throw std::invalid_argument("plan must not be None");
        return without_gil([&]() -> std::shared_ptr<VmmBackend> {
          auto host = make_host_backend(page_size, num_pages, std::make_shared<FaultyHostCalls>(plan));
          return std::make_shared<FaultInjectingBackend>(std::move(host), std::move(plan));
        });
      },
      py::arg("page_size"), py::arg("num_pages"), py::arg("plan"),
      "A host backend (pages of page_size bytes, a pool of num_pages) whose calls and system calls fail "
      "or are slow as `plan` says.");
}

}  // namespace vattn
