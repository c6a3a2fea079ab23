// cuda_uvm backend: small pages through the patched nvidia-uvm (driver_patch/).
//   reserve = cuMemAddressReserve (rounded up to the driver's granularity),
//             then UVM_CREATE_EXTERNAL_RANGE over it unless the CUDA driver
//             already made the reservation an external range of its VA space
//   create  = VATTN_UVM_CREATE: one physical page of page_size on the device
//   map     = VATTN_UVM_MAP: batched, read-write for the device, in order,
//             reporting how many entries it mapped
//   unmap   = VATTN_UVM_UNMAP: batched, same reporting
//   release = VATTN_UVM_RELEASE (the memory goes with its last mapping)
//
// Which descriptor: pages must appear in the page tables of the CUDA
// context's GPU VA space, and that GPU VA space is registered with exactly one
// UVM VA space, the one behind the CUDA driver's own /dev/nvidia-uvm
// descriptor. A descriptor of our own would be a VA space of its own with no
// GPU VA space (registering the context's would need the CUDA driver's RM
// handles, and RM lets one UVM VA space own it). So the backend finds the
// CUDA driver's descriptor ($VATTN_UVM_FD, or the one descriptor open on the
// device that answers VATTN_UVM_QUERY with the GPU and its GPU VA space
// registered) and dup()s it: the duplicate keeps that VA space alive for as
// long as the backend maps pages in it. The device is opened by us only to
// detect the patch (uvm_patch_info).
//
// The address range comes from the CUDA driver (cuMemAddressReserve), so it
// is a valid device pointer for torch and never handed to another allocation;
// the patched module maps only inside external ranges, which is what
// cuMemAddressReserve creates when the driver uses UVM (otherwise we create
// one, and free it before cuMemAddressFree).
//
// Context scope, read fences and the graph-capture gate: cuda_sync.h, shared
// with the cuda backend (CudaDeviceBackend). The module's calls that map,
// unmap or create pass the gate like the driver's (inside
// KVCacheManager.graph_capture() they raise DriverError on every thread);
// they need no context. Page releases are the module's alone and go through
// during a capture; a reservation's cuMemAddressFree waits for its end.
#include "backends/cuda_uvm_backend.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "backends/backend_registry.h"
#include "backends/cuda_context.h"
#include "backends/cuda_driver.h"
#include "backends/cuda_sync.h"
#include "common/errors.h"
#include "backends/uvm_stock_ioctl.h"
#include "backends/vattn_uvm_ioctl.h"

namespace vattn {

namespace {

using namespace cu;

using Uuid = uint8_t[16];
static_assert(sizeof(Uuid) == sizeof(CUuuid), "cuDeviceGetUuid writes 16 bytes");

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

std::string hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

// ioctl(2), retried while the module refuses before doing anything (EINTR;
// EAGAIN while the system suspends). Returns 0 or -1 with errno set.
int uvm_ioctl(int fd, unsigned long cmd, void* params) {
  for (int attempt = 0;; ++attempt) {
    if (::ioctl(fd, cmd, params) == 0) return 0;
    if ((errno != EINTR && errno != EAGAIN) || attempt == 1000) return -1;
    if (errno == EAGAIN) usleep(1000);
  }
}

// Throws DriverError for a failed ioctl: errno when the call itself failed,
// else the NV_STATUS it returned.
void check_uvm(const char* call, int rc, uint32_t status) {
  if (rc != 0) throw_errno(std::string("ioctl(") + call + ")", errno);
  if (status != VATTN_UVM_STATUS_OK) throw DriverError(call, uvm_status_name(status));
}

struct QueryResult {
  int rc = -1;
  int err = 0;
  VATTN_UVM_QUERY_PARAMS params{};
};

QueryResult query(int fd, const uint8_t* uuid, uint64_t base = 0, uint64_t length = 0) {
  QueryResult q;
  if (uuid) std::memcpy(q.params.gpuUuid, uuid, sizeof(q.params.gpuUuid));
  q.params.rangeBase = base;
  q.params.rangeLength = length;
  q.rc = uvm_ioctl(fd, VATTN_UVM_QUERY, &q.params);
  q.err = q.rc == 0 ? 0 : errno;
  return q;
}

// Why a descriptor's module is not the patched one, or "" when it is.
std::string not_patched_reason(const QueryResult& q) {
  if (q.rc != 0) {
    if (q.err == ENOSYS || q.err == EINVAL || q.err == ENOTTY)
      return "the nvidia-uvm module does not know VATTN_UVM_QUERY (errno " + std::to_string(q.err) + ", " +
             std::strerror(q.err) + "): it is the stock module, without driver_patch/";
    return std::string("VATTN_UVM_QUERY failed: ") + std::strerror(q.err);
  }
  if (q.params.rmStatus != VATTN_UVM_STATUS_OK)
    return "VATTN_UVM_QUERY returned " + uvm_status_name(q.params.rmStatus);
  if (q.params.abiVersion != VATTN_UVM_ABI_VERSION)
    return "the patched nvidia-uvm speaks ABI " + std::to_string(q.params.abiVersion) + ", this vattn build ABI " +
           std::to_string(VATTN_UVM_ABI_VERSION) + ": rebuild one of them from the same driver_patch/";
  return "";
}

std::string canonical(const std::string& path) {
  char buf[PATH_MAX];
  return realpath(path.c_str(), buf) ? std::string(buf) : path;
}

// The CUDA driver's nvidia-uvm descriptor for the GPU `uuid`, duplicated
// (close-on-exec). Throws BackendUnavailable saying what was found instead.
int context_fd(const std::string& device, const uint8_t* uuid) {
  std::vector<int> candidates;
  std::string forced = env("VATTN_UVM_FD");
  if (!forced.empty()) {
    char* end = nullptr;
    long v = std::strtol(forced.c_str(), &end, 10);
    if (!end || *end || v < 0 || v > INT_MAX)
      throw BackendUnavailable("VATTN_UVM_FD must be a file descriptor number, got '" + forced + "'");
    candidates.push_back(static_cast<int>(v));
  } else {
    std::string want = canonical(device);
    DIR* dir = opendir("/proc/self/fd");
    if (!dir) throw BackendUnavailable("cannot list /proc/self/fd to find the CUDA driver's " + device + " descriptor");
    while (dirent* e = readdir(dir)) {
      char* end = nullptr;
      long fd = std::strtol(e->d_name, &end, 10);
      if (!end || *end || e->d_name[0] == '\0' || fd == dirfd(dir)) continue;
      char target[PATH_MAX];
      ssize_t n = readlink(("/proc/self/fd/" + std::string(e->d_name)).c_str(), target, sizeof(target) - 1);
      if (n <= 0) continue;
      target[n] = '\0';
      if (want == target) candidates.push_back(static_cast<int>(fd));
    }
    closedir(dir);
    std::sort(candidates.begin(), candidates.end());
  }
  std::string seen;
  for (int fd : candidates) {
    QueryResult q = query(fd, uuid);
    std::string why = not_patched_reason(q);
    if (why.empty() && (q.params.flags & VATTN_UVM_QUERY_GPU_VA_SPACE)) {
      int dup_fd = dup(fd);
      if (dup_fd < 0) throw_errno("dup(nvidia-uvm descriptor)", errno);
      fcntl(dup_fd, F_SETFD, FD_CLOEXEC);
      return dup_fd;
    }
    if (why.empty())
      why = (q.params.flags & VATTN_UVM_QUERY_GPU_REGISTERED) ? "the GPU is registered without a GPU VA space"
                                                              : "the GPU is not registered in its VA space";
    else if (q.rc == 0 && q.params.rmStatus == VATTN_UVM_STATUS_ILLEGAL_ACTION)
      why = "not an initialised VA space descriptor";
    seen += "; fd " + std::to_string(fd) + ": " + why;
  }
  if (candidates.empty())
    throw BackendUnavailable("the CUDA driver has no " + device +
                             " descriptor open in this process (is the CUDA context created, and the nvidia-uvm "
                             "module loaded?)");
  throw BackendUnavailable("no " + device + " descriptor holds this GPU's page tables" + seen +
                           " (see driver_patch/README.md)");
}

class CudaUvmBackend final : public CudaDeviceBackend {
 public:
  CudaUvmBackend(const DriverApi& api, int device, size_t page_size, size_t num_pages)
      : CudaDeviceBackend(api, device),
        device_(device),
        page_size_(page_size),
        handles_(num_pages, 0) {
    try {
      init();
    } catch (...) {
      if (fd_ >= 0) close(fd_);
      throw;  // the context reference goes with context_
    }
  }

  ~CudaUvmBackend() override {
    if (forked_) return;  // the parent's pages, descriptor and context
    // What waited for a capture's end runs now (nothing can open our gate
    // after this). Pages still created here: release them so nothing leaks
    // (errors are ignored, destructors never throw). The fences' events go
    // with sync_, then the context reference with context_ (base members,
    // in that order).
    sync_.run_deferred_now();
    release_all();
    if (fd_ >= 0) close(fd_);
  }

  std::string name() const override { return "cuda_uvm"; }
  size_t granularity() const override { return uvm_page_sizes().front(); }
  size_t page_size() const override { return page_size_; }
  size_t num_pages() const override { return handles_.size(); }
  DLDevice dl_device() const override { return DLDevice{kDLCUDA, device_}; }

  uintptr_t reserve(size_t bytes) override {
    CudaSync::Call call(sync_);
    size_t length = reserved_length(bytes);
    CUdeviceptr ptr = 0;
    check("cuMemAddressReserve",
          api_.cuMemAddressReserve(&ptr, length, std::max(cuda_granularity_, page_size_), 0, 0));
    uintptr_t base = static_cast<uintptr_t>(ptr);
    VATTN_STOCK_UVM_RANGE_PARAMS range{};
    range.base = base;
    range.length = length;
    int rc = uvm_ioctl(fd_, VATTN_STOCK_UVM_CREATE_EXTERNAL_RANGE, &range);
    if (rc == 0 && range.rmStatus == VATTN_UVM_STATUS_OK) {
      std::lock_guard<std::mutex> lock(mu_);
      own_ranges_.insert(base);
      return base;
    }
    int err = errno;
    if (rc == 0 && range.rmStatus == VATTN_UVM_STATUS_UVM_ADDRESS_IN_USE) {
      // The CUDA driver registered its reservation with UVM already: fine if
      // the whole reservation is one external range.
      QueryResult q = query(fd_, nullptr, base, length);
      if (q.rc == 0 && q.params.rmStatus == VATTN_UVM_STATUS_OK && (q.params.flags & VATTN_UVM_QUERY_RANGE_EXTERNAL))
        return base;
    }
    api_.cuMemAddressFree(ptr, length);
    if (rc != 0) throw_errno("ioctl(UVM_CREATE_EXTERNAL_RANGE)", err);
    throw DriverError("UVM_CREATE_EXTERNAL_RANGE", uvm_status_name(range.rmStatus) + " for the reservation at " +
                                                       hex(base) + " of " + std::to_string(length) + " bytes");
  }

  // During a capture the range is freed once it ends: true then.
  bool free_reservation(uintptr_t base, size_t bytes) noexcept override {
    if (forked_) return false;
    std::function<void()> free_range = [this, base, bytes] { free_range_now(base, bytes); };
    if (sync_.defer_until_open(free_range)) return true;
    return free_range_now(base, bytes);
  }

  void create_pages(const uint32_t* ids, size_t count) override {
    check_open();
    CudaSync::Call call(sync_, CudaSync::Scope::kGateOnly);
    std::vector<uint32_t> made;  // the pages this call created (not those kept after a failed release)
    for (size_t i = 0; i < count; ++i) {
      if (handles_[ids[i]]) continue;  // its release failed: the memory is still ours
      VATTN_UVM_CREATE_PARAMS p{};
      std::memcpy(p.gpuUuid, uuid_, sizeof(p.gpuUuid));
      p.pageSize = page_size_;
      int rc = uvm_ioctl(fd_, VATTN_UVM_CREATE, &p);
      if (rc != 0 || p.rmStatus != VATTN_UVM_STATUS_OK || p.handle == 0) {
        int err = errno;
        for (uint32_t id : made) release_handle(handles_[id]);
        if (rc != 0) throw_errno("ioctl(VATTN_UVM_CREATE)", err);
        if (p.rmStatus == VATTN_UVM_STATUS_OK) throw DriverError("VATTN_UVM_CREATE", "the module returned handle 0");
        if (p.rmStatus == VATTN_UVM_STATUS_NO_MEMORY)
          throw OutOfMemory("VATTN_UVM_CREATE", uvm_status_name(p.rmStatus));
        throw DriverError("VATTN_UVM_CREATE", uvm_status_name(p.rmStatus));
      }
      handles_[ids[i]] = p.handle;
      made.push_back(ids[i]);
    }
  }

  size_t release_pages(const uint32_t* ids, size_t count, uint8_t* failed = nullptr) noexcept override {
    if (failed) std::fill(failed, failed + count, uint8_t{0});
    if (forked_ || fd_ < 0) return 0;  // the parent's pages, or the descriptor (and its pages) gone
    CudaSync::QuietCall call(sync_, CudaSync::Scope::kGateOnly);
    size_t kept = 0;
    for (size_t i = 0; i < count; ++i)
      if (!release_handle(handles_[ids[i]])) {
        ++kept;
        if (failed) failed[i] = 1;
      }
    return kept;
  }

  void map(const PageMapping* mappings, size_t count, size_t* done) override {
    *done = 0;
    check_open();
    CudaSync::Call call(sync_, CudaSync::Scope::kGateOnly);
    std::vector<VATTN_UVM_MAP_ENTRY> entries;
    while (*done < count) {
      size_t n = std::min<size_t>(count - *done, VATTN_UVM_MAX_BATCH);
      entries.resize(n);
      for (size_t i = 0; i < n; ++i) {
        const PageMapping& m = mappings[*done + i];
        entries[i].va = m.addr;
        entries[i].handle = handles_[m.page];
      }
      VATTN_UVM_MAP_PARAMS p{};
      p.entries = reinterpret_cast<uintptr_t>(entries.data());
      p.count = n;
      p.access = VATTN_UVM_ACCESS_READ_WRITE;
      int rc = uvm_ioctl(fd_, VATTN_UVM_MAP, &p);
      // The module stops at the first failure: entries [0, p.done) are mapped
      // and the failing one was undone. When the call itself failed nothing
      // was done (p.done stays 0).
      *done += static_cast<size_t>(std::min<uint64_t>(p.done, n));
      check_uvm("VATTN_UVM_MAP", rc, p.rmStatus);
      if (p.done != n) throw DriverError("VATTN_UVM_MAP", "NV_OK after " + std::to_string(p.done) + " of " + std::to_string(n) + " entries");
    }
  }

  void unmap(const uintptr_t* addrs, size_t count, size_t* done) override {
    *done = 0;
    check_open();
    CudaSync::Call call(sync_, CudaSync::Scope::kGateOnly);
    std::vector<uint64_t> batch;
    while (*done < count) {
      size_t n = std::min<size_t>(count - *done, VATTN_UVM_MAX_BATCH);
      batch.assign(addrs + *done, addrs + *done + n);
      VATTN_UVM_UNMAP_PARAMS p{};
      std::memcpy(p.gpuUuid, uuid_, sizeof(p.gpuUuid));
      p.addrs = reinterpret_cast<uintptr_t>(batch.data());
      p.count = n;
      int rc = uvm_ioctl(fd_, VATTN_UVM_UNMAP, &p);
      *done += static_cast<size_t>(std::min<uint64_t>(p.done, n));
      check_uvm("VATTN_UVM_UNMAP", rc, p.rmStatus);
      if (p.done != n) throw DriverError("VATTN_UVM_UNMAP", "NV_OK after " + std::to_string(p.done) + " of " + std::to_string(n) + " entries");
    }
  }

  void copy(uintptr_t dst, uintptr_t src, size_t bytes) override {
    CudaSync::Call call(sync_);
    check("cuMemcpyDtoD", api_.cuMemcpyDtoD(static_cast<CUdeviceptr>(dst), static_cast<CUdeviceptr>(src), bytes));
    check("cuCtxSynchronize", api_.cuCtxSynchronize());  // device-to-device copies are asynchronous
  }

  void close_pool() noexcept override {
    if (forked_) return;
    CudaSync::QuietCall call(sync_, CudaSync::Scope::kGateOnly);
    release_all();
    pool_closed_ = true;
    close_fd_when_done();
  }

  void detach_after_fork(uintptr_t, size_t) noexcept override {
    // The parent's VA space, pages and context: the child never calls the
    // module or the driver for them, and leaves its copy of the descriptor.
    detach_sync_after_fork();
  }

 private:
  // UVM_FREE of a range we made an external range, then cuMemAddressFree.
  bool free_range_now(uintptr_t base, size_t bytes) noexcept {
    CudaSync::QuietCall call(sync_);
    if (!call.ok()) return false;
    bool own = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      own = own_ranges_.erase(base) > 0;
    }
    if (own) {
      // UvmFree unmaps whatever is still mapped in the range (the host backend
      // tolerates leftovers too), then the range goes.
      VATTN_STOCK_UVM_RANGE_PARAMS range{};
      range.base = base;
      uvm_ioctl(fd_, VATTN_STOCK_UVM_FREE, &range);
    }
    bool freed = api_.cuMemAddressFree(static_cast<CUdeviceptr>(base), reserved_length(bytes)) == CUDA_SUCCESS;
    close_fd_when_done();
    return freed;
  }

  void init() {
    // the CUDA driver registers the context's GPU VA space with UVM here
    ScopedContext context(api_, context_.get());
    context.check();
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = context_.device();
    check("cuMemGetAllocationGranularity",
          api_.cuMemGetAllocationGranularity(&cuda_granularity_, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    if (cuda_granularity_ == 0) cuda_granularity_ = size_t{2} << 20;
    read_uuid();
    fd_ = context_fd(uvm_device_path(), uuid_);
    QueryResult q = query(fd_, uuid_);
    std::string why = not_patched_reason(q);
    if (!why.empty()) throw BackendUnavailable(why);
    if (!(q.params.pageSizes & page_size_))
      throw BackendUnavailable("the patched nvidia-uvm serves page sizes " + sizes_text(q.params.pageSizes) +
                               " on CUDA device " + std::to_string(device_) + ", not " + std::to_string(page_size_) +
                               " bytes");
  }

  void read_uuid() {
    auto get = reinterpret_cast<GetUuidFn*>(dlsym(api_.handle, "cuDeviceGetUuid_v2"));  // MIG instances: their own UUID
    if (!get) get = reinterpret_cast<GetUuidFn*>(dlsym(api_.handle, "cuDeviceGetUuid"));
    if (!get) throw BackendUnavailable("CUDA driver " + api_.path + " has no cuDeviceGetUuid");
    CUuuid uuid{};
    check("cuDeviceGetUuid", get(&uuid, context_.device()));
    std::memcpy(uuid_, uuid.bytes, sizeof(uuid_));
  }

  static std::string sizes_text(uint64_t mask) {
    std::string out;
    for (size_t s : uvm_page_sizes())
      if (mask & s) out += (out.empty() ? "" : ", ") + std::to_string(s / 1024) + " KiB";
    return out.empty() ? "none" : out;
  }

  size_t reserved_length(size_t bytes) const {
    size_t g = std::max(cuda_granularity_, page_size_);
    return (bytes + g - 1) / g * g;
  }

  // False when the module refused: the handle is kept (its memory is still
  // allocated), for create_pages to reuse and close_pool to try again.
  bool release_handle(uint64_t& handle) noexcept {
    if (!handle) return true;
    VATTN_UVM_RELEASE_PARAMS p{};
    p.handle = handle;
    if (uvm_ioctl(fd_, VATTN_UVM_RELEASE, &p) != 0 || p.rmStatus != VATTN_UVM_STATUS_OK) return false;
    handle = 0;
    return true;
  }

  // Our duplicate keeps the CUDA driver's VA space alive; once the pool is
  // closed and our own ranges are freed nothing more goes through it.
  void close_fd_when_done() noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    if (pool_closed_ && own_ranges_.empty() && fd_ >= 0) {
      close(fd_);
      fd_ = -1;
    }
  }

  void release_all() noexcept {
    if (fd_ < 0) return;
    for (auto& h : handles_) release_handle(h);
  }

  void check_open() const {
    if (forked_) throw ForkedError("the cuda_uvm backend belongs to the parent process");
    if (fd_ < 0) throw ClosedError("the cuda_uvm backend has no nvidia-uvm descriptor");
  }

  void check(const char* call, CUresult rc) const {
    if (rc != CUDA_SUCCESS) throw DriverError(call, error_name(api_, rc));
  }

  int device_;
  size_t page_size_;
  size_t cuda_granularity_ = 0;  // the driver's; reservations are rounded up to it
  Uuid uuid_{};
  int fd_ = -1;                         // our duplicate of the CUDA driver's nvidia-uvm descriptor
  std::vector<uint64_t> handles_;       // VATTN_UVM_CREATE handle per page; 0 = not created
  std::mutex mu_;                       // guards own_ranges_ and closing fd_
  std::set<uintptr_t> own_ranges_;      // external ranges we created (freed with UVM_FREE)
  bool pool_closed_ = false;            // close_pool() ran: only reservations are left to free
};

}  // namespace

const std::vector<size_t>& uvm_page_sizes() {
  static const std::vector<size_t> sizes = {VATTN_UVM_PAGE_SIZE_64K, VATTN_UVM_PAGE_SIZE_128K,
                                            VATTN_UVM_PAGE_SIZE_256K, VATTN_UVM_PAGE_SIZE_2M};
  return sizes;
}

std::string uvm_device_path() {
  std::string path = env("VATTN_UVM_DEVICE");
  return path.empty() ? std::string("/dev/nvidia-uvm") : path;
}

std::string uvm_status_name(uint32_t status) {
  const char* name = nullptr;
  switch (status) {
    case VATTN_UVM_STATUS_OK: name = "NV_OK"; break;
    case VATTN_UVM_STATUS_ILLEGAL_ACTION: name = "NV_ERR_ILLEGAL_ACTION"; break;
    case VATTN_UVM_STATUS_INVALID_ADDRESS: name = "NV_ERR_INVALID_ADDRESS"; break;
    case VATTN_UVM_STATUS_INVALID_ARGUMENT: name = "NV_ERR_INVALID_ARGUMENT"; break;
    case VATTN_UVM_STATUS_INVALID_DEVICE: name = "NV_ERR_INVALID_DEVICE"; break;
    case VATTN_UVM_STATUS_INVALID_OBJECT_HANDLE: name = "NV_ERR_INVALID_OBJECT_HANDLE"; break;
    case VATTN_UVM_STATUS_NO_MEMORY: name = "NV_ERR_NO_MEMORY"; break;
    case VATTN_UVM_STATUS_NOT_SUPPORTED: name = "NV_ERR_NOT_SUPPORTED"; break;
    case VATTN_UVM_STATUS_OUT_OF_RANGE: name = "NV_ERR_OUT_OF_RANGE"; break;
    case VATTN_UVM_STATUS_UVM_ADDRESS_IN_USE: name = "NV_ERR_UVM_ADDRESS_IN_USE"; break;
    default: break;
  }
  return std::string(name ? name : "NV_STATUS") + " (" + hex(status) + ")";
}

UvmPatchInfo uvm_patch_info() {
  UvmPatchInfo info;
  info.device_path = uvm_device_path();
  int fd = open(info.device_path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    info.reason = "cannot open " + info.device_path + ": " + std::strerror(err) +
                  (err == ENOENT ? " (the nvidia-uvm module is not loaded)" : "");
    return info;
  }
  VATTN_STOCK_UVM_INITIALIZE_PARAMS init{};
  if (uvm_ioctl(fd, VATTN_STOCK_UVM_INITIALIZE, &init) != 0) {
    int err = errno;
    info.reason = (err == ENOTTY || err == EINVAL ? info.device_path + " is not an nvidia-uvm device (" : "(") +
                  std::string("UVM_INITIALIZE failed: ") + std::strerror(err) + ")";
  } else if (init.rmStatus != VATTN_UVM_STATUS_OK) {
    info.reason = "UVM_INITIALIZE returned " + uvm_status_name(init.rmStatus);
  } else {
    QueryResult q = query(fd, nullptr);
    if (q.rc == 0 && q.params.rmStatus == VATTN_UVM_STATUS_OK) info.abi_version = q.params.abiVersion;
    info.reason = not_patched_reason(q);
    info.available = info.reason.empty();
  }
  close(fd);
  return info;
}

namespace {

std::shared_ptr<VmmBackend> make_cuda_uvm_backend(const BackendParams& p) {
  const auto& sizes = uvm_page_sizes();
  if (std::find(sizes.begin(), sizes.end(), p.page_size) == sizes.end())
    throw std::invalid_argument("the cuda_uvm backend's page size must be 65536, 131072, 262144 or 2097152 bytes, got " +
                                std::to_string(p.page_size));
  if (p.num_pages == 0 || p.num_pages > UINT32_MAX)
    throw std::invalid_argument("num_pages must be in [1, 2^32), got " + std::to_string(p.num_pages));
  const DriverApi& api = load_driver(p.driver_path.empty() ? default_driver_path() : p.driver_path);
  check_device_exists(api, p.device_index);
  return std::make_shared<CudaUvmBackend>(api, p.device_index, p.page_size, p.num_pages);
}

ProbeData probe_patch_info(const ProbeData&) {
  UvmPatchInfo info = uvm_patch_info();
  return {{"available", info.available},
          {"device_path", info.device_path},
          {"abi_version", int64_t{info.abi_version}},
          {"reason", info.reason}};
}

ProbeData probe_abi(const ProbeData&) {
  std::vector<int64_t> sizes(uvm_page_sizes().begin(), uvm_page_sizes().end());
  return {{"abi_version", int64_t{VATTN_UVM_ABI_VERSION}}, {"page_sizes", sizes}};
}

}  // namespace

VATTN_REGISTER_BACKEND(
    cuda_uvm, make_cuda_uvm_backend,
    {"patch_info", probe_patch_info,
     "what the nvidia-uvm module at $VATTN_UVM_DEVICE (default /dev/nvidia-uvm) answers: available (the patched "
     "module, our ABI), device_path, abi_version (the module's; 0 when it did not answer), reason (why not); "
     "needs no GPU context",
     {}},
    {"abi", probe_abi, "what this build speaks: abi_version, page_sizes (bytes) of the patched module", {}});

}  // namespace vattn
