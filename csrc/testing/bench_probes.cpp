// Measurement probes for benchmarks/vmm_latency.py: the raw syscall floor the
// host backend's map cost is compared with, and the raw CUDA driver calls the
// cuda backend's are compared with, timed in C++ so no interpreter overhead
// enters the floor.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda_driver.h"
#include "common/errors.h"
#include "common/released_gil.h"
#include "testing/testing.h"

namespace vattn {

// Seconds per page of mmap(MAP_FIXED | MAP_SHARED, memfd) for `count` pages of
// `page_size` bytes at consecutive addresses, one call per page, mapping page i
// to a scattered pool offset so the kernel cannot merge neighbours, as the host
// backend maps. Element 0: map; 1: the first touch after it (a byte written per
// OS page: the faults of the entries the map left to first touch); 2: unmap
// (mmap PROT_NONE anonymous over it, as the host backend unmaps). The pool's
// pages are written once before the timing: the kernel zeroes a fallocated
// page at its first use, which a pool used before (a cache's after start-up)
// no longer pays.
std::vector<double> raw_mmap_seconds(size_t page_size, size_t count) {
  int fd = memfd_create("vattn-bench", MFD_CLOEXEC);
  if (fd < 0) throw_errno("memfd_create", errno);
  const size_t pool = page_size * count;
  if (ftruncate(fd, static_cast<off_t>(pool)) != 0 || fallocate(fd, 0, 0, static_cast<off_t>(pool)) != 0) {
    int err = errno;
    close(fd);
    throw_errno("fallocate", err);
  }
  const size_t os_page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  auto write_each_os_page = [&](void* at, char value) {
    for (size_t b = 0; b < pool; b += os_page) static_cast<volatile char*>(at)[b] = value;
  };
  void* all = mmap(nullptr, pool, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (all == MAP_FAILED) {
    int err = errno;
    close(fd);
    throw_errno("mmap(pool)", err);
  }
  write_each_os_page(all, 0);
  munmap(all, pool);
  void* base = mmap(nullptr, pool, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
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
  write_each_os_page(base, 1);
  auto t2 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < count; ++i)
    mmap(addr(i), page_size, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  auto t3 = std::chrono::steady_clock::now();
  munmap(base, pool);
  close(fd);
  std::chrono::duration<double> map_s = t1 - t0, touch_s = t2 - t1, unmap_s = t3 - t2;
  return {map_s.count() / count, touch_s.count() / count, unmap_s.count() / count};
}

namespace {

using namespace cu;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0, size_t count) {
  return std::chrono::duration<double>(Clock::now() - t0).count() / static_cast<double>(count);
}

}  // namespace

// Seconds per page of the raw driver calls behind the cuda backend, on
// `count` pages of `page_size` bytes of `device`: [create (cuMemCreate),
// map (cuMemMap + cuMemSetAccess, one page per call each), unmap (cuMemUnmap,
// one page per call), release (cuMemRelease)]. Pages go to consecutive
// addresses of one reservation from a scattered handle order, as in the
// backend's batched map. The primary context is pushed for the measurement
// and popped after; everything is released on the way out.
std::vector<double> raw_cuda_seconds(const std::string& driver_path, int device, size_t page_size, size_t count) {
  if (count == 0) throw std::invalid_argument("count must be >= 1, got 0");
  const DriverApi& api = load_driver(driver_path);
  auto check = [&](const char* call, CUresult rc) {
    if (rc != CUDA_SUCCESS) throw DriverError(call, error_name(api, rc));
  };
  CUdevice dev = 0;
  check("cuDeviceGet", api.cuDeviceGet(&dev, device));
  CUcontext ctx = nullptr;
  check("cuDevicePrimaryCtxRetain", api.cuDevicePrimaryCtxRetain(&ctx, dev));
  CUresult pushed = api.cuCtxPushCurrent(ctx);
  if (pushed != CUDA_SUCCESS) {
    api.cuDevicePrimaryCtxRelease(dev);
    check("cuCtxPushCurrent", pushed);
  }
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  std::vector<CUmemGenericAllocationHandle> handles(count, 0);
  std::vector<bool> mapped(count, false);
  CUdeviceptr base = 0;
  std::vector<double> out;
  CUresult rc = CUDA_SUCCESS;
  const char* failed = "";
  auto run = [&](const char* call, CUresult r) {
    if (r != CUDA_SUCCESS && rc == CUDA_SUCCESS) {
      rc = r;
      failed = call;
    }
    return r == CUDA_SUCCESS;
  };
  size_t granularity = 0;
  if (run("cuMemGetAllocationGranularity",
          api.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)) &&
      run("cuMemAddressReserve", api.cuMemAddressReserve(&base, page_size * count, granularity, 0, 0))) {
    auto t0 = Clock::now();
    for (size_t i = 0; i < count && run("cuMemCreate", api.cuMemCreate(&handles[i], page_size, &prop, 0)); ++i) {
    }
    out.push_back(seconds_since(t0, count));
    t0 = Clock::now();
    for (size_t i = 0; i < count && rc == CUDA_SUCCESS; ++i) {
      CUdeviceptr addr = base + i * page_size;
      if (!run("cuMemMap", api.cuMemMap(addr, page_size, 0, handles[(i * 7919) % count], 0))) break;
      mapped[i] = true;
      run("cuMemSetAccess", api.cuMemSetAccess(addr, page_size, &access, 1));
    }
    out.push_back(seconds_since(t0, count));
    t0 = Clock::now();
    for (size_t i = 0; i < count; ++i)
      if (mapped[i] && run("cuMemUnmap", api.cuMemUnmap(base + i * page_size, page_size))) mapped[i] = false;
    out.push_back(seconds_since(t0, count));
    t0 = Clock::now();
    for (auto& h : handles)
      if (h && run("cuMemRelease", api.cuMemRelease(h))) h = 0;
    out.push_back(seconds_since(t0, count));
  }
  // Whatever a failure left behind goes before the context is popped.
  for (size_t i = 0; i < count; ++i)
    if (mapped[i]) api.cuMemUnmap(base + i * page_size, page_size);
  for (auto h : handles)
    if (h) api.cuMemRelease(h);
  if (base) api.cuMemAddressFree(base, page_size * count);
  CUcontext popped = nullptr;
  api.cuCtxPopCurrent(&popped);
  api.cuDevicePrimaryCtxRelease(dev);
  check(failed, rc);
  return out;
}

// Keeps `threads` threads (the calling one and threads - 1 helpers) on their cores until `seconds` from the
// call, touching no memory beyond their stacks: benchmarks/vllm_serving.py --pad-attention stretches an
// attention call's time with it, so that what the call's length does to the work after it can be told from
// what the kernel's reads do. The helpers are started once and wait on a condition variable between calls
// (a call costs a wake-up, not a thread's start); all spin to one deadline, so a late helper ends with the
// calling thread and the call returns without waiting for it.
namespace {

class SpinHelpers {
 public:
  static SpinHelpers& instance() {
    static SpinHelpers* helpers = new SpinHelpers();  // never destroyed: its detached threads outlive exit
    return *helpers;
  }

  void spin_until(Clock::time_point deadline, int helpers) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (static_cast<int>(started_) < helpers) {
        std::thread([this, index = started_] { run(index); }).detach();
        ++started_;
      }
      deadline_ = deadline;
      active_ = helpers;
      ++generation_;
    }
    wake_.notify_all();
    spin(deadline);
  }

 private:
  static void spin(Clock::time_point deadline) {
    while (Clock::now() < deadline) {
    }
  }

  void run(size_t index) {
    uint64_t seen = 0;
    for (;;) {
      Clock::time_point deadline;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (static_cast<int>(index) >= active_) continue;
        deadline = deadline_;
      }
      spin(deadline);
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  size_t started_ = 0;
  uint64_t generation_ = 0;
  int active_ = 0;
  Clock::time_point deadline_;
};

}  // namespace

void busy_wait(double seconds, int threads) {
  if (!(seconds >= 0.0 && seconds <= 60.0))
    throw std::invalid_argument("seconds must be in [0, 60], got " + std::to_string(seconds));
  if (threads < 1 || threads > 64)
    throw std::invalid_argument("threads must be in [1, 64], got " + std::to_string(threads));
  SpinHelpers::instance().spin_until(
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds)), threads - 1);
}

void bind_bench_probes(py::module_& m) {
  m.def("busy_wait", gil_released(&busy_wait), py::arg("seconds"), py::arg("threads") = 1,
        "Spins `threads` threads (1-64: the calling one, and threads - 1 helpers started once) until `seconds` "
        "(0-60) from the call, touching no memory, with the GIL released.");
  m.def("raw_cuda_seconds", gil_released(&raw_cuda_seconds), py::arg("driver_path"), py::arg("device"),
        py::arg("page_size"), py::arg("count"),
        "Benchmark floor: [create, map + set access, unmap, release] seconds per page of raw CUDA driver calls.");
  m.def("raw_mmap_seconds", gil_released(&raw_mmap_seconds), py::arg("page_size"), py::arg("count"),
        "Benchmark floor: [map, first touch, unmap] seconds per page of raw mmap calls on a memfd.");
}

}  // namespace vattn
