/* A test-only stand-in for libcuda.so.1: the driver entry points vattn uses,
 * implemented on host memory with the same rules the real driver enforces
 * where vattn could get them wrong:
 *   - every memory call needs a live context current on the calling thread;
 *   - contexts: a per-thread stack (cuCtxSetCurrent replaces its top, NULL
 *     pops it; push / pop); the primary context of a device is created by the
 *     first cuDevicePrimaryCtxRetain and destroyed when cuDevicePrimaryCtxRelease
 *     drops its reference count to 0, even where it is still current (those
 *     threads then get CUDA_ERROR_CONTEXT_IS_DESTROYED); a later retain makes a
 *     new context object;
 *   - cuMemAddressReserve takes alignment 0 or a power of two; a reservation
 *     is aligned to at least the granularity; cuMemMap needs an aligned
 *     address inside a reservation;
 *   - a new mapping has no access until cuMemSetAccess;
 *   - cuMemUnmap must cover exactly one earlier cuMemMap range, or with
 *     FAKE_CUDA_UNMAP_SPANS=1 one or more whole adjacent ones (what the real
 *     driver does there is not documented: vattn probes it at run time);
 *   - streams and events belong to the context current at their creation; an
 *     event can only be recorded on a stream of its own context. Tests queue
 *     "kernels" on a stream (fake_cuda_launch); an event covers the ones
 *     queued before its record, and waiting on it completes just those;
 *   - FAKE_CUDA_MAP_DELAY_US makes every cuMemMap that long (a slow driver).
 * Device pointers are host addresses, so tests can read and write them.
 *
 * Control functions (fake_cuda_*) let tests inject failures, play a framework
 * that holds contexts and streams of its own, and count what is still alive.
 * Load it with VATTN_CUDA_DRIVER_LIB=/path/to/libfakecuda.so.
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
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;
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
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
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

/* Context objects are never freed, so a handle to a destroyed one stays
 * recognisable (alive = 0). */
#define MAX_DEVICES 16
#define MAX_CONTEXTS 4096
struct CUctx_st { int device; int alive; int primary; };
static struct CUctx_st contexts[MAX_CONTEXTS];
static int num_contexts = 0;
static CUcontext primary[MAX_DEVICES];     /* NULL: inactive */
static int primary_refs[MAX_DEVICES];
static long primary_creations = 0;
#define MAX_STACK 32
static __thread CUcontext ctx_stack[MAX_STACK];
static __thread int ctx_depth = 0;
static CUcontext current(void) { return ctx_depth ? ctx_stack[ctx_depth - 1] : NULL; }
/* Threads that ended with a context still current (nobody restored theirs). */
static long threads_left_with_context = 0;
static pthread_key_t exit_key;
static pthread_once_t exit_key_once = PTHREAD_ONCE_INIT;
static void at_thread_exit(void* unused) {
  (void)unused;
  if (ctx_depth > 0) __sync_fetch_and_add(&threads_left_with_context, 1);
}
static void make_exit_key(void) { pthread_key_create(&exit_key, at_thread_exit); }
static void watch_thread_exit(void) {
  pthread_once(&exit_key_once, make_exit_key);
  pthread_setspecific(exit_key, (void*)1);
}

#define MAX_STREAMS 1024
/* launched: kernels queued (fake_cuda_launch); completed: how many of them a
 * wait has seen finish. */
struct CUstream_st { CUcontext ctx; int alive; long syncs; long records; long launched; long completed; };
static struct CUstream_st streams[MAX_STREAMS];
static int num_streams = 0;
static struct CUstream_st legacy_stream = {NULL, 1, 0, 0, 0, 0}; /* handles 0, 1 and 2 */
#define MAX_EVENTS 4096
struct CUevent_st { CUcontext ctx; int alive; struct CUstream_st* recorded_on; long covers; };
static struct CUevent_st events[MAX_EVENTS];
static int num_events = 0;
static long live_events = 0;

static size_t env_size(const char* name, size_t fallback) {
  const char* v = getenv(name);
  return (v && *v) ? (size_t)strtoull(v, NULL, 0) : fallback;
}
static size_t granularity(void) { return env_size("FAKE_CUDA_GRANULARITY", 2u << 20); }
static int unmap_spans(void) { return env_size("FAKE_CUDA_UNMAP_SPANS", 0) != 0; }
static size_t total_mem(void) { return env_size("FAKE_CUDA_TOTAL_MEM", (size_t)8 << 30); }
static int device_count(void) { return (int)env_size("FAKE_CUDA_DEVICE_COUNT", 1); }

typedef struct { int fd; size_t size; } Alloc;
typedef struct { uintptr_t addr; size_t size; uintptr_t handle; int access; } Range;

#define MAX_RANGES 65536
static Range mappings[MAX_RANGES];
static int num_mappings = 0;
static Range reservations[1024];
static int num_reservations = 0;
static long live_handles = 0;
static size_t bytes_created = 0;
static long sync_calls = 0;
static long unmap_calls = 0;

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

#define NEED_CONTEXT()                                                 \
  do {                                                                 \
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;               \
    if (current() == NULL) return CUDA_ERROR_INVALID_CONTEXT;          \
    if (!current()->alive) return CUDA_ERROR_CONTEXT_IS_DESTROYED;     \
  } while (0)

/* Caller holds mu. */
static CUcontext new_context(int device, int is_primary) {
  if (num_contexts == MAX_CONTEXTS) return NULL;
  CUcontext c = &contexts[num_contexts++];
  c->device = device;
  c->alive = 1;
  c->primary = is_primary;
  return c;
}

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
/* Mappings that start inside [lo, hi). */
long fake_cuda_mappings_in(unsigned long long lo, unsigned long long hi) {
  long n = 0;
  pthread_mutex_lock(&mu);
  for (int j = 0; j < num_mappings; ++j) n += mappings[j].addr >= lo && mappings[j].addr < hi;
  pthread_mutex_unlock(&mu);
  return n;
}
long fake_cuda_unmap_calls(void) { return unmap_calls; }
long fake_cuda_primary_refs(void) { return primary_refs[0]; }
long fake_cuda_primary_creations(void) { return primary_creations; }
long fake_cuda_live_events(void) { return live_events; }
long fake_cuda_threads_left_with_context(void) { return threads_left_with_context; }
/* A context of the caller's own (what cuCtxCreate makes, not made current). */
CUcontext fake_cuda_create_context(int device) {
  pthread_mutex_lock(&mu);
  CUcontext c = new_context(device, 0);
  pthread_mutex_unlock(&mu);
  return c;
}
void fake_cuda_destroy_context(CUcontext c) { c->alive = 0; }
int fake_cuda_context_alive(CUcontext c) { return c && c->alive; }
int fake_cuda_context_depth(void) { return ctx_depth; }
/* Times the stream (0, 1, 2: the legacy default stream) was waited on, by
 * cuStreamSynchronize or cuEventSynchronize of an event recorded on it. */
long fake_cuda_stream_syncs(CUstream s) {
  return ((uintptr_t)s <= 2 ? &legacy_stream : s)->syncs;
}
long fake_cuda_stream_records(CUstream s) {
  return ((uintptr_t)s <= 2 ? &legacy_stream : s)->records;
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

/* 1 when addr is mapped and cuMemSetAccess granted access to it. */
int fake_cuda_accessible(unsigned long long addr) {
  int ok = 0;
  pthread_mutex_lock(&mu);
  for (int j = 0; j < num_mappings; ++j)
    if (addr >= mappings[j].addr && addr < mappings[j].addr + mappings[j].size) ok = mappings[j].access;
  pthread_mutex_unlock(&mu);
  return ok;
}
/* Queues one kernel on the stream; returns how many it holds now. */
long fake_cuda_launch(CUstream s) {
  return __sync_add_and_fetch(&((uintptr_t)s <= 2 ? &legacy_stream : s)->launched, 1);
}
/* Kernels of the stream that some wait has seen complete. */
long fake_cuda_stream_completed(CUstream s) {
  return ((uintptr_t)s <= 2 ? &legacy_stream : s)->completed;
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
 * (tests/backends/fake_uvm answers the ioctls). FAKE_CUDA_UVM_REGISTER=gpu registers
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

static int bad_device(CUdevice d) { return d < 0 || d >= device_count() || d >= MAX_DEVICES; }
CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice d) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (bad_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  INJECT("cuDevicePrimaryCtxRetain");
  if (uvm_register(d) != CUDA_SUCCESS) return CUDA_ERROR_UNKNOWN;
  CUresult rc = CUDA_SUCCESS;
  pthread_mutex_lock(&mu);
  if (primary[d] == NULL) {
    primary[d] = new_context(d, 1);
    primary_creations++;
  }
  if (primary[d] == NULL) {
    rc = CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    primary_refs[d]++;
    *ctx = primary[d];
  }
  pthread_mutex_unlock(&mu);
  return rc;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (bad_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  CUresult rc = CUDA_SUCCESS;
  pthread_mutex_lock(&mu);
  if (primary_refs[d] == 0) {
    rc = CUDA_ERROR_INVALID_CONTEXT;  /* never retained */
  } else if (--primary_refs[d] == 0) {
    primary[d]->alive = 0;  /* destroyed, not popped from any thread's stack */
    primary[d] = NULL;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}
CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned int* flags, int* active) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (bad_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  *flags = 0;
  *active = primary[d] != NULL;
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext* ctx) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  *ctx = current();
  return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext ctx) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  INJECT("cuCtxSetCurrent");
  if (ctx == NULL) {  /* pops the top (a no-op on an empty stack) */
    if (ctx_depth) ctx_depth--;
    return CUDA_SUCCESS;
  }
  if (!ctx->alive) return CUDA_ERROR_INVALID_CONTEXT;
  if (ctx_depth == 0) ctx_depth = 1;
  ctx_stack[ctx_depth - 1] = ctx;  /* replaces the top */
  watch_thread_exit();
  return CUDA_SUCCESS;
}
CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!ctx || !ctx->alive || ctx_depth == MAX_STACK) return CUDA_ERROR_INVALID_CONTEXT;
  ctx_stack[ctx_depth++] = ctx;
  watch_thread_exit();
  return CUDA_SUCCESS;
}
CUresult cuCtxPopCurrent_v2(CUcontext* ctx) {
  if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (ctx_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
  CUcontext top = ctx_stack[--ctx_depth];
  if (ctx) *ctx = top;
  return CUDA_SUCCESS;
}
CUresult cuCtxSynchronize(void) {
  NEED_CONTEXT();
  INJECT("cuCtxSynchronize");
  __sync_fetch_and_add(&sync_calls, 1);
  pthread_mutex_lock(&mu);  /* the whole device: every stream's kernels */
  for (int i = 0; i < num_streams; ++i) streams[i].completed = streams[i].launched;
  legacy_stream.completed = legacy_stream.launched;
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}

/* ---- streams and events ---- */

/* The stream behind a handle, or NULL when it is not a live stream. */
static struct CUstream_st* stream_of(CUstream h) {
  if ((uintptr_t)h <= 2) return &legacy_stream;
  for (int i = 0; i < num_streams; ++i)
    if (h == &streams[i]) return streams[i].alive ? h : NULL;
  return NULL;
}
static CUcontext stream_context(struct CUstream_st* s) { return s == &legacy_stream ? current() : s->ctx; }

CUresult cuStreamCreate(CUstream* out, unsigned int flags) {
  (void)flags;
  NEED_CONTEXT();
  CUresult rc = CUDA_SUCCESS;
  pthread_mutex_lock(&mu);
  if (num_streams == MAX_STREAMS) {
    rc = CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    struct CUstream_st* s = &streams[num_streams++];
    s->ctx = current();
    s->alive = 1;
    s->syncs = s->records = s->launched = s->completed = 0;
    *out = s;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}
CUresult cuStreamDestroy_v2(CUstream h) {
  NEED_CONTEXT();
  struct CUstream_st* s = stream_of(h);
  if (!s || s == &legacy_stream) return CUDA_ERROR_INVALID_HANDLE;
  s->alive = 0;
  return CUDA_SUCCESS;
}
CUresult cuStreamSynchronize(CUstream h) {
  NEED_CONTEXT();
  INJECT("cuStreamSynchronize");
  struct CUstream_st* s = stream_of(h);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  __sync_fetch_and_add(&s->syncs, 1);
  pthread_mutex_lock(&mu);
  s->completed = s->launched;
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}
CUresult cuEventCreate(CUevent* out, unsigned int flags) {
  (void)flags;
  NEED_CONTEXT();
  INJECT("cuEventCreate");
  CUresult rc = CUDA_SUCCESS;
  pthread_mutex_lock(&mu);
  if (num_events == MAX_EVENTS) {
    rc = CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    struct CUevent_st* e = &events[num_events++];
    e->ctx = current();
    e->alive = 1;
    e->recorded_on = NULL;
    e->covers = 0;
    live_events++;
    *out = e;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}
CUresult cuEventRecord(CUevent e, CUstream h) {
  NEED_CONTEXT();
  INJECT("cuEventRecord");
  struct CUstream_st* s = stream_of(h);
  if (!e || !e->alive || !s) return CUDA_ERROR_INVALID_HANDLE;
  if (stream_context(s) != e->ctx) return CUDA_ERROR_INVALID_HANDLE;  /* not the same context */
  e->recorded_on = s;
  e->covers = s->launched;
  __sync_fetch_and_add(&s->records, 1);
  return CUDA_SUCCESS;
}
CUresult cuEventSynchronize(CUevent e) {
  NEED_CONTEXT();
  INJECT("cuEventSynchronize");
  if (!e || !e->alive) return CUDA_ERROR_INVALID_HANDLE;
  if (e->recorded_on) {
    struct CUstream_st* s = e->recorded_on;
    __sync_fetch_and_add(&s->syncs, 1);
    pthread_mutex_lock(&mu);
    if (s->completed < e->covers) s->completed = e->covers;
    pthread_mutex_unlock(&mu);
  }
  return CUDA_SUCCESS;
}
CUresult cuEventDestroy_v2(CUevent e) {
  NEED_CONTEXT();
  if (!e || !e->alive) return CUDA_ERROR_INVALID_HANDLE;
  e->alive = 0;
  pthread_mutex_lock(&mu);
  live_events--;
  pthread_mutex_unlock(&mu);
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
  (void)addr;
  NEED_CONTEXT();
  INJECT("cuMemAddressReserve");
  if (size == 0 || size % granularity() || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (align & (align - 1)) return CUDA_ERROR_INVALID_VALUE;  /* 0 or a power of two */
  if (align < granularity()) align = granularity();
  /* Over-reserve, then trim to an aligned range of exactly `size` bytes. */
  char* raw = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  char* p = (char*)(((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1));
  if (p > raw) munmap(raw, (size_t)(p - raw));
  if (raw + size + align > p + size) munmap(p + size, (size_t)(raw + size + align - (p + size)));
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
  if (!a || offset + size > a->size || size % granularity() || ptr % granularity())
    return CUDA_ERROR_INVALID_VALUE;
  size_t delay_us = env_size("FAKE_CUDA_MAP_DELAY_US", 0);
  if (delay_us) usleep((useconds_t)delay_us);
  pthread_mutex_lock(&mu);
  int reserved = 0;
  for (int i = 0; i < num_reservations; ++i)
    reserved |= ptr >= reservations[i].addr && ptr + size <= reservations[i].addr + reservations[i].size;
  if (!reserved) {
    pthread_mutex_unlock(&mu);
    return CUDA_ERROR_INVALID_VALUE;  /* not inside a reservation */
  }
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
  mappings[num_mappings].access = 0;
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
  pthread_mutex_lock(&mu);
  for (int j = 0; j < num_mappings; ++j)
    if (mappings[j].addr >= ptr && mappings[j].addr < ptr + size) mappings[j].access = 1;
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}

/* 1 when [ptr, ptr+size) is exactly one mapping. Caller holds mu. */
static int one_mapping(CUdeviceptr ptr, size_t size) {
  for (int j = 0; j < num_mappings; ++j)
    if (mappings[j].addr == ptr && mappings[j].size == size) return 1;
  return 0;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  NEED_CONTEXT();
  __sync_fetch_and_add(&unmap_calls, 1);
  INJECT("cuMemUnmap");
  pthread_mutex_lock(&mu);
  long c = covered(ptr, size);
  if (c != (long)size || (!unmap_spans() && !one_mapping(ptr, size))) {
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
    case CUDA_ERROR_INVALID_HANDLE: *name = "CUDA_ERROR_INVALID_HANDLE"; break;
    case CUDA_ERROR_CONTEXT_IS_DESTROYED: *name = "CUDA_ERROR_CONTEXT_IS_DESTROYED"; break;
    case CUDA_ERROR_UNKNOWN: *name = "CUDA_ERROR_UNKNOWN"; break;
    default: *name = NULL; return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}
