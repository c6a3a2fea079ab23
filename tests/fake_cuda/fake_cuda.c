/* A test-only stand-in for libcuda.so.1: the driver entry points vattn uses,
 * implemented on host memory with the same rules the real driver enforces
 * where vattn could get them wrong:
 *   - every memory call needs a current context on the calling thread;
 *   - a new mapping has no access until cuMemSetAccess;
 *   - cuMemUnmap must cover exactly one or more whole earlier cuMemMap ranges.
 * Device pointers are host addresses, so tests can read and write them.
 *
 * Control functions (fake_cuda_*) let tests inject failures and count what is
 * still alive. Load it with VATTN_CUDA_DRIVER_LIB=/path/to/libfakecuda.so.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_NOT_MAPPED = 211,
  CUDA_ERROR_UNKNOWN = 999,
};

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void* win32HandleMetaData;
  struct { unsigned char a, b; unsigned short c; unsigned char r[4]; } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

/* ---- state -------------------------------------------------------------- */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int initialized = 0;
static struct CUctx_st { int device; } primary_ctx = {0};
static int primary_refs = 0;
static __thread CUcontext current_ctx = NULL;

static size_t env_size(const char* name, size_t fallback) {
  const char* v = getenv(name);
  return (v && *v) ? (size_t)strtoull(v, NULL, 0) : fallback;
}
static size_t granularity(void) { return env_size("FAKE_CUDA_GRANULARITY", 2u << 20); }
static size_t total_mem(void) { return env_size("FAKE_CUDA_TOTAL_MEM", (size_t)8 << 30); }
static int device_count(void) { return (int)env_size("FAKE_CUDA_DEVICE_COUNT", 1); }

typedef struct { int fd; size_t size; } Alloc;
typedef struct { uintptr_t addr; size_t size; uintptr_t handle; } Range;

#define MAX_RANGES 65536
static Range mappings[MAX_RANGES];
static int num_mappings = 0;
static Range reservations[1024];
static int num_reservations = 0;
static long live_handles = 0;
static size_t bytes_created = 0;
static long sync_calls = 0;

/* Failure injection: the next `skip` calls of `name` succeed, then `times`
 * calls (-1: all) return `result`. */
static char fail_name[64];
static long fail_skip = 0, fail_times = 0;
static CUresult fail_result = 0;

static int should_fail(const char* name, CUresult* rc) {
  int fail = 0;
  pthread_mutex_lock(&mu);
  if (fail_times != 0 && strcmp(name, fail_name) == 0) {
    if (fail_skip > 0) {
      fail_skip--;
    } else {
      fail = 1;
      *rc = fail_result;
      if (fail_times > 0) fail_times--;
    }
  }
  pthread_mutex_unlock(&mu);
  return fail;
}

#define INJECT(name)                      \
  do {                                    \
    CUresult injected_;                   \
    if (should_fail(name, &injected_)) return injected_; \
  } while (0)

#define NEED_CONTEXT()                                           \
  do {                                                           \
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;         \
    if (current_ctx == NULL) return CUDA_ERROR_INVALID_CONTEXT;  \
  } while (0)

/* ---- control API for tests ---------------------------------------------- */

void fake_cuda_fail(const char* name, long skip, long times, int result) {
  pthread_mutex_lock(&mu);
  strncpy(fail_name, name, sizeof(fail_name) - 1);
  fail_skip = skip;
  fail_times = times;
  fail_result = result;
  pthread_mutex_unlock(&mu);
}
void fake_cuda_clear_failures(void) { fake_cuda_fail("", 0, 0, 0); }
long fake_cuda_live_handles(void) { return live_handles; }
long fake_cuda_live_mappings(void) { return num_mappings; }
long fake_cuda_live_reservations(void) { return num_reservations; }
long fake_cuda_sync_calls(void) { return sync_calls; }
long fake_cuda_primary_refs(void) { return primary_refs; }
/* Mappings that start inside [lo, hi). */
long fake_cuda_mappings_in(unsigned long long lo, unsigned long long hi) {
  long n = 0;
  pthread_mutex_lock(&mu);
  for (int j = 0; j < num_mappings; ++j) n += mappings[j].addr >= lo && mappings[j].addr < hi;
  pthread_mutex_unlock(&mu);
  return n;
}
/* The allocation handle mapped at addr (0 when nothing is), so tests can check
 * a page table against what is really mapped, shared pages included. */
unsigned long long fake_cuda_handle_at(unsigned long long addr) {
  unsigned long long h = 0;
  pthread_mutex_lock(&mu);
  for (int j = 0; j < num_mappings; ++j)
    if (addr >= mappings[j].addr && addr < mappings[j].addr + mappings[j].size) h = mappings[j].handle;
  pthread_mutex_unlock(&mu);
  return h;
}

/* ---- driver API --------------------------------------------------------- */

CUresult cuInit(unsigned int flags) {
  (void)flags;
  INJECT("cuInit");
  initialized = 1;
  return CUDA_SUCCESS;
}
CUresult cuDriverGetVersion(int* v) { *v = 13000; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int* n) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  *n = device_count();
  return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  if (ordinal < 0 || ordinal >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
  (void)d;
  strncpy(name, "Fake CUDA device (host memory)", (size_t)len);
  return CUDA_SUCCESS;
}
CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) { (void)d; *bytes = total_mem(); return CUDA_SUCCESS; }
/* Device d's UUID: "vattn-fake-gpu" and the ordinal in the last byte. */
typedef struct { char bytes[16]; } CUuuid;
CUresult cuDeviceGetUuid_v2(CUuuid* uuid, CUdevice d) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
  memcpy(uuid->bytes, "vattn-fake-gpu\0\0", 16);
  uuid->bytes[15] = (char)d;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetUuid(CUuuid* uuid, CUdevice d) { return cuDeviceGetUuid_v2(uuid, d); }
/* The driver's own nvidia-uvm descriptor. With FAKE_CUDA_UVM_DEVICE set, a
 * context retain opens that file once, initialises it and registers the
 * device's GPU and GPU VA space in it, as libcuda does with /dev/nvidia-uvm
 * (tests/fake_uvm answers the ioctls). FAKE_CUDA_UVM_REGISTER=gpu registers
 * the GPU without its GPU VA space, =none nothing. FAKE_CUDA_UVM_EXTERNAL=1
 * makes every reservation an external range of that VA space, as a driver
 * that manages its reservations through UVM would. Argument layouts: the
 * stock ones (driver_patch/uvm_stock_ioctl.h). */
static int uvm_fd = -1;
static int uvm_registered[64];

static int uvm_call(unsigned long cmd, void* params, size_t status_offset) {
  if (ioctl(uvm_fd, cmd, params) != 0) return -1;
  uint32_t status;
  memcpy(&status, (char*)params + status_offset, 4);
  return status == 0 ? 0 : -1;
}

static CUresult uvm_register(CUdevice d) {
  const char* path = getenv("FAKE_CUDA_UVM_DEVICE");
  if (!path || !*path || d < 0 || d >= 64 || uvm_registered[d]) return CUDA_SUCCESS;
  if (uvm_fd < 0) {
    uvm_fd = open(path, O_RDWR | O_CLOEXEC);
    uint64_t init[2] = {0, 0};
    if (uvm_fd < 0 || uvm_call(0x30000001ul, init, 8) != 0) return CUDA_ERROR_UNKNOWN;
  }
  const char* mode = getenv("FAKE_CUDA_UVM_REGISTER");
  CUuuid uuid;
  cuDeviceGetUuid_v2(&uuid, d);
  unsigned char gpu[40] = {0}, va_space[32] = {0};
  memcpy(gpu, uuid.bytes, 16);
  memcpy(va_space, uuid.bytes, 16);
  if (!(mode && strcmp(mode, "none") == 0) && uvm_call(37, gpu, 36) != 0) return CUDA_ERROR_UNKNOWN;
  if (!(mode && (strcmp(mode, "none") == 0 || strcmp(mode, "gpu") == 0)) && uvm_call(25, va_space, 28) != 0)
    return CUDA_ERROR_UNKNOWN;
  uvm_registered[d] = 1;
  return CUDA_SUCCESS;
}

/* Test control: close the descriptor and register anew on the next context
 * retain, under the environment of that moment. */
void fake_cuda_uvm_reset(void) {
  pthread_mutex_lock(&mu);
  if (uvm_fd >= 0) close(uvm_fd);
  uvm_fd = -1;
  memset(uvm_registered, 0, sizeof(uvm_registered));
  pthread_mutex_unlock(&mu);
}

static int uvm_external(void) {
  const char* v = getenv("FAKE_CUDA_UVM_EXTERNAL");
  return uvm_fd >= 0 && v && strcmp(v, "1") == 0;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice d) {
  INJECT("cuDevicePrimaryCtxRetain");
  if (uvm_register(d) != CUDA_SUCCESS) return CUDA_ERROR_UNKNOWN;
  pthread_mutex_lock(&mu);
  primary_refs++;
  pthread_mutex_unlock(&mu);
  primary_ctx.device = d;
  *ctx = &primary_ctx;
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
  (void)d;
  pthread_mutex_lock(&mu);
  primary_refs--;
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext* ctx) { *ctx = current_ctx; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext ctx) { current_ctx = ctx; return CUDA_SUCCESS; }
CUresult cuCtxSynchronize(void) {
  NEED_CONTEXT();
  INJECT("cuCtxSynchronize");
  __sync_fetch_and_add(&sync_calls, 1);
  return CUDA_SUCCESS;
}
CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  NEED_CONTEXT();
  *total = total_mem();
  *free_bytes = total_mem() > bytes_created ? total_mem() - bytes_created : 0;
  return CUDA_SUCCESS;
}
CUresult cuMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp* prop, int option) {
  (void)option;
  NEED_CONTEXT();
  if (!prop || prop->location.type != 1) return CUDA_ERROR_INVALID_VALUE;
  *g = granularity();
  return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags) {
  (void)align; (void)addr; (void)flags;
  NEED_CONTEXT();
  INJECT("cuMemAddressReserve");
  if (size == 0 || size % granularity()) return CUDA_ERROR_INVALID_VALUE;
  void* p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  if (uvm_external()) {
    uint64_t range[3] = {(uint64_t)(uintptr_t)p, size, 0};
    if (uvm_call(73, range, 16) != 0) {
      munmap(p, size);
      return CUDA_ERROR_UNKNOWN;
    }
  }
  pthread_mutex_lock(&mu);
  reservations[num_reservations].addr = (uintptr_t)p;
  reservations[num_reservations].size = size;
  num_reservations++;
  pthread_mutex_unlock(&mu);
  *ptr = (CUdeviceptr)(uintptr_t)p;
  return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  NEED_CONTEXT();
  CUresult rc = CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < num_reservations; ++i) {
    if (reservations[i].addr == ptr && reservations[i].size == size) {
      for (int j = 0; j < num_mappings; ++j)  /* still mapped inside: refuse */
        if (mappings[j].addr >= ptr && mappings[j].addr < ptr + size) goto out;
      if (uvm_external()) {
        uint64_t range[3] = {ptr, size, 0};
        uvm_call(34, range, 16);
      }
      munmap((void*)(uintptr_t)ptr, size);
      reservations[i] = reservations[--num_reservations];
      rc = CUDA_SUCCESS;
      break;
    }
  }
out:
  pthread_mutex_unlock(&mu);
  return rc;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                     const CUmemAllocationProp* prop, unsigned long long flags) {
  (void)flags;
  NEED_CONTEXT();
  INJECT("cuMemCreate");
  if (!prop || size == 0 || size % granularity()) return CUDA_ERROR_INVALID_VALUE;
  if (bytes_created + size > total_mem()) return CUDA_ERROR_OUT_OF_MEMORY;
  int fd = memfd_create("fake-cuda-page", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
    if (fd >= 0) close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  Alloc* a = malloc(sizeof(Alloc));
  a->fd = fd;
  a->size = size;
  pthread_mutex_lock(&mu);
  live_handles++;
  bytes_created += size;
  pthread_mutex_unlock(&mu);
  *handle = (CUmemGenericAllocationHandle)(uintptr_t)a;
  return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  NEED_CONTEXT();
  if (!handle) return CUDA_ERROR_INVALID_VALUE;
  Alloc* a = (Alloc*)(uintptr_t)handle;
  pthread_mutex_lock(&mu);
  live_handles--;
  bytes_created -= a->size;
  pthread_mutex_unlock(&mu);
  close(a->fd);  /* existing mappings keep the memory, as in the real driver */
  free(a);
  return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  (void)flags;
  NEED_CONTEXT();
  INJECT("cuMemMap");
  Alloc* a = (Alloc*)(uintptr_t)handle;
  if (!a || offset + size > a->size || size % granularity()) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  for (int j = 0; j < num_mappings; ++j) {
    if (ptr < mappings[j].addr + mappings[j].size && mappings[j].addr < ptr + size) {
      pthread_mutex_unlock(&mu);
      return CUDA_ERROR_INVALID_VALUE;  /* already mapped */
    }
  }
  void* p = mmap((void*)(uintptr_t)ptr, size, PROT_NONE, MAP_FIXED | MAP_SHARED, a->fd, (off_t)offset);
  if (p == MAP_FAILED || num_mappings == MAX_RANGES) {
    pthread_mutex_unlock(&mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  mappings[num_mappings].addr = ptr;
  mappings[num_mappings].size = size;
  mappings[num_mappings].handle = (uintptr_t)handle;
  num_mappings++;
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}

/* Bytes of [ptr, ptr+size) covered by mappings that lie wholly inside it; -1
 * when a mapping straddles an edge. Caller holds mu. */
static long covered(CUdeviceptr ptr, size_t size) {
  long total = 0;
  for (int j = 0; j < num_mappings; ++j) {
    uintptr_t a = mappings[j].addr, e = a + mappings[j].size;
    if (e <= ptr || a >= ptr + size) continue;
    if (a < ptr || e > ptr + size) return -1;
    total += (long)mappings[j].size;
  }
  return total;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  NEED_CONTEXT();
  INJECT("cuMemSetAccess");
  if (!desc || count == 0 || desc->flags != 3) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  long c = covered(ptr, size);
  pthread_mutex_unlock(&mu);
  if (c != (long)size) return CUDA_ERROR_INVALID_VALUE;  /* must be fully mapped */
  if (mprotect((void*)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE) != 0) return CUDA_ERROR_UNKNOWN;
  return CUDA_SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  NEED_CONTEXT();
  INJECT("cuMemUnmap");
  pthread_mutex_lock(&mu);
  long c = covered(ptr, size);
  if (c != (long)size) {
    pthread_mutex_unlock(&mu);
    return CUDA_ERROR_INVALID_VALUE;  /* must cover whole earlier mappings */
  }
  for (int j = 0; j < num_mappings;) {
    if (mappings[j].addr >= ptr && mappings[j].addr < ptr + size)
      mappings[j] = mappings[--num_mappings];
    else
      ++j;
  }
  mmap((void*)(uintptr_t)ptr, size, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
       -1, 0);
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
  NEED_CONTEXT();
  INJECT("cuMemcpyDtoD");
  memmove((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, bytes);
  return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult rc, const char** name) {
  switch (rc) {
    case CUDA_SUCCESS: *name = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; break;
    case CUDA_ERROR_INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_NOT_MAPPED: *name = "CUDA_ERROR_NOT_MAPPED"; break;
    case CUDA_ERROR_UNKNOWN: *name = "CUDA_ERROR_UNKNOWN"; break;
    default: *name = NULL; return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}
