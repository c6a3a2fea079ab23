/* A test-only stand-in for libcuda.so.1: the driver entry points vattn uses,
 * implemented on host memory with the rules the real driver enforces where
 * vattn could get them wrong. Three files: this one (devices, contexts,
 * failure injection, latency), fake_cuda_memory.c (reservations,
 * allocations, mappings, device memory) and fake_cuda_streams.c (streams,
 * events, graph capture, device accesses). Values and layouts follow cuda.h
 * of CUDA 13.0 (fake_cuda.h).
 *   - every call that needs a context needs a live one current on the
 *     calling thread; contexts are a per-thread stack (cuCtxSetCurrent
 *     replaces its top, NULL pops it); the primary context is created by
 *     the first cuDevicePrimaryCtxRetain and destroyed when the release of
 *     the last reference (or cuDevicePrimaryCtxReset) comes, even where it is
 *     still current (those threads then get CUDA_ERROR_CONTEXT_IS_DESTROYED);
 *   - a device access (a fake kernel or copy, fake_cuda_streams.c) of an
 *     address not mapped with access, or a page unmapped while a queued
 *     access still uses it, is an MMU fault: the context is poisoned and
 *     every later call in it returns CUDA_ERROR_ILLEGAL_ADDRESS, as on a GPU;
 *   - cuMemCreate checks its properties (type, location, handle types, the
 *     Win32 metadata, allocFlags, flags) and the size against the
 *     granularity; device memory is finite and other processes can take it
 *     (FAKE_CUDA_TOTAL_MEM, fake_cuda_other_process_alloc): cuMemCreate then
 *     fails with CUDA_ERROR_OUT_OF_MEMORY and cuMemGetInfo reports it;
 *   - cuMemAddressReserve takes alignment 0 ("the driver's choice", which
 *     cuda.h does not promise to be more than the host page: the fake aligns
 *     such a reservation to an odd multiple of 4 KiB, so code that relies on
 *     more fails here) or a power of two; cuMemMap needs a granularity-aligned
 *     address inside a reservation, offset 0 and flags 0;
 *   - a new mapping has no access until cuMemSetAccess;
 *   - cuMemUnmap must cover exactly one earlier cuMemMap range, or with
 *     FAKE_CUDA_UNMAP_SPANS=1 one or more whole adjacent ones (what the real
 *     driver does there is not documented: vattn probes it at run time);
 *   - memory management calls are "potentially unsafe" during a graph
 *     capture (fake_cuda_streams.c has the rules);
 *   - FAKE_CUDA_MAP_DELAY_US makes every cuMemMap that long, and
 *     FAKE_CUDA_CALL_LATENCY_US (or fake_cuda_set_latency) every memory,
 *     stream and event call: a slow driver, so races resolve differently.
 * Device pointers are host addresses, so tests can also read and write
 * mapped memory directly (no fault model there: a stray host access is a
 * segfault, which is why tests use the checked accesses).
 *
 * Control functions (fake_cuda_*) let tests inject failures, play a framework
 * that holds contexts and streams of its own, and count what is still alive.
 * Load it with VATTN_CUDA_DRIVER_LIB=/path/to/libfakecuda.so.
 */
#include "fake_cuda.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

pthread_mutex_t fc_mu = PTHREAD_MUTEX_INITIALIZER;
int fc_initialized = 0;

#define MAX_DEVICES 16
#define MAX_CONTEXTS 4096
static struct CUctx_st contexts[MAX_CONTEXTS];
static int num_contexts = 0;
static CUcontext primary[MAX_DEVICES];     /* NULL: inactive */
static int primary_refs[MAX_DEVICES];
static long primary_creations = 0;
#define MAX_STACK 32
static __thread CUcontext ctx_stack[MAX_STACK];
static __thread int ctx_depth = 0;
CUcontext fc_current(void) { return ctx_depth ? ctx_stack[ctx_depth - 1] : NULL; }
CUcontext fc_primary(int device) { return device >= 0 && device < MAX_DEVICES ? primary[device] : NULL; }
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

size_t fc_env_size(const char* name, size_t fallback) {
  const char* v = getenv(name);
  return (v && *v) ? (size_t)strtoull(v, NULL, 0) : fallback;
}
int fc_device_count(void) { return (int)fc_env_size("FAKE_CUDA_DEVICE_COUNT", 1); }
long fc_sync_calls = 0;
static long faults = 0;

/* ---- failure injection and latency ---- */

/* The next `skip` calls of `name` succeed, then `times` calls (-1: all)
 * return `result`. */
static char fail_name[64];
static long fail_skip = 0, fail_times = 0;
static CUresult fail_result = 0;

static long injectable_calls = 0;  /* every call that passes INJECT: a driver-work counter for tests */
int fc_should_fail(const char* name, CUresult* rc) {
  int fail = 0;
  pthread_mutex_lock(&fc_mu);
  injectable_calls++;
  if (fail_times != 0 && strcmp(name, fail_name) == 0) {
    if (fail_skip > 0) {
      fail_skip--;
    } else {
      fail = 1;
      *rc = fail_result;
      if (fail_times > 0) fail_times--;
    }
  }
  pthread_mutex_unlock(&fc_mu);
  return fail;
}

/* Microseconds every call of `latency_name` ("*": every call) takes;
 * FAKE_CUDA_CALL_LATENCY_US sets "*" until a test sets it. */
static char latency_name[64] = "*";
static long latency_us = -1;  /* -1: from the environment */
void fc_latency(const char* name) {
  long us = latency_us >= 0 ? latency_us : (long)fc_env_size("FAKE_CUDA_CALL_LATENCY_US", 0);
  if (us > 0 && (strcmp(latency_name, "*") == 0 || strcmp(latency_name, name) == 0)) usleep((useconds_t)us);
}

CUresult fc_need_context(void) {
  if (!fc_initialized) return CUDA_ERROR_NOT_INITIALIZED;
  CUcontext c = fc_current();
  if (c == NULL) return CUDA_ERROR_INVALID_CONTEXT;
  if (!c->alive) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  if (c->poisoned) return CUDA_ERROR_ILLEGAL_ADDRESS;
  return CUDA_SUCCESS;
}

/* Caller holds fc_mu. */
static CUcontext new_context(int device, int is_primary) {
  if (num_contexts == MAX_CONTEXTS) return NULL;
  CUcontext c = &contexts[num_contexts++];
  c->device = device;
  c->alive = 1;
  c->primary = is_primary;
  c->poisoned = 0;
  c->fault_addr = 0;
  return c;
}

void fc_poison_locked(CUcontext ctx, uintptr_t addr) {
  if (ctx && !ctx->poisoned) {
    ctx->poisoned = 1;
    ctx->fault_addr = addr;
  }
  faults++;
}


/* ---- control API for tests ---------------------------------------------- */

void fake_cuda_fail(const char* name, long skip, long times, int result) {
  pthread_mutex_lock(&fc_mu);
  strncpy(fail_name, name, sizeof(fail_name) - 1);
  fail_skip = skip;
  fail_times = times;
  fail_result = result;
  pthread_mutex_unlock(&fc_mu);
}
void fake_cuda_clear_failures(void) { fake_cuda_fail("", 0, 0, 0); }
/* Every call of `name` ("*": every memory, stream and event call) takes `us`
 * microseconds; us < 0 goes back to FAKE_CUDA_CALL_LATENCY_US. */
void fake_cuda_set_latency(const char* name, long us) {
  pthread_mutex_lock(&fc_mu);
  strncpy(latency_name, name, sizeof(latency_name) - 1);
  latency_us = us;
  pthread_mutex_unlock(&fc_mu);
}
long fake_cuda_primary_refs(void) { return primary_refs[0]; }
long fake_cuda_primary_creations(void) { return primary_creations; }
long fake_cuda_calls(void) {
  pthread_mutex_lock(&fc_mu);
  long n = injectable_calls;
  pthread_mutex_unlock(&fc_mu);
  return n;
}
long fake_cuda_threads_left_with_context(void) { return threads_left_with_context; }

/* A context of the caller's own (what cuCtxCreate makes, not made current). */
CUcontext fake_cuda_create_context(int device) {
  pthread_mutex_lock(&fc_mu);
  CUcontext c = new_context(device, 0);
  pthread_mutex_unlock(&fc_mu);
  return c;
}
void fake_cuda_destroy_context(CUcontext c) { c->alive = 0; }
int fake_cuda_context_alive(CUcontext c) { return c && c->alive; }
int fake_cuda_context_depth(void) { return ctx_depth; }
/* Faults so far (device accesses of unmapped or inaccessible memory). */
long fake_cuda_faults(void) { return faults; }
/* 1 when c (NULL: device 0's primary context) is poisoned by a fault. */
int fake_cuda_context_poisoned(CUcontext c) {
  if (!c) c = primary[0];
  return c && c->poisoned;
}
/* The address the first fault of c (NULL: the primary context) hit. */
unsigned long long fake_cuda_fault_address(CUcontext c) {
  if (!c) c = primary[0];
  return c ? c->fault_addr : 0;
}

/* ---- driver API: devices and contexts ------------------------------------ */

CUresult cuInit(unsigned int flags) {
  (void)flags;
  INJECT("cuInit");
  fc_initialized = 1;
  return CUDA_SUCCESS;
}
CUresult cuDriverGetVersion(int* v) { *v = 13000; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int* n) {
  if (!fc_initialized) return CUDA_ERROR_NOT_INITIALIZED;
  *n = fc_device_count();
  return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  if (ordinal < 0 || ordinal >= fc_device_count()) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
  (void)d;
  strncpy(name, "Fake CUDA device (host memory)", (size_t)len);
  return CUDA_SUCCESS;
}
CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) { (void)d; *bytes = fc_total_mem(); return CUDA_SUCCESS; }
/* Device d's UUID: "vattn-fake-gpu" and the ordinal in the last byte, or
 * the d-th of FAKE_CUDA_UUIDS (comma-separated, 32 hex digits each), so a
 * test can give devices UUIDs of its own and number them as another process's
 * CUDA_VISIBLE_DEVICES would. */
typedef struct { char bytes[16]; } CUuuid;
static int fc_hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}
/* The d-th UUID of FAKE_CUDA_UUIDS into out: 1; 0 when it has none for d or it is malformed. */
static int fc_uuid_from_env(CUdevice d, char out[16]) {
  const char* v = getenv("FAKE_CUDA_UUIDS");
  if (!v || !*v) return 0;
  for (int i = 0; i < d; i++) {
    v = strchr(v, ',');
    if (!v) return 0;
    v++;
  }
  for (int i = 0; i < 16; i++) {
    int hi = fc_hex_digit(v[2 * i]), lo = hi < 0 ? -1 : fc_hex_digit(v[2 * i + 1]);
    if (hi < 0 || lo < 0) return 0;
    out[i] = (char)(hi << 4 | lo);
  }
  return v[32] == '\0' || v[32] == ',';
}
CUresult cuDeviceGetUuid_v2(CUuuid* uuid, CUdevice d) {
  if (!fc_initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (d < 0 || d >= fc_device_count()) return CUDA_ERROR_INVALID_DEVICE;
  const char* listed = getenv("FAKE_CUDA_UUIDS");
  if (listed && *listed) return fc_uuid_from_env(d, uuid->bytes) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
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
 * stock ones (csrc/backends/uvm_stock_ioctl.h). */
static int uvm_fd = -1;
static int uvm_registered[64];

int fc_uvm_call(unsigned long cmd, void* params, size_t status_offset) {
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
    if (uvm_fd < 0 || fc_uvm_call(0x30000001ul, init, 8) != 0) return CUDA_ERROR_UNKNOWN;
  }
  const char* mode = getenv("FAKE_CUDA_UVM_REGISTER");
  CUuuid uuid;
  cuDeviceGetUuid_v2(&uuid, d);
  unsigned char gpu[40] = {0}, va_space[32] = {0};
  memcpy(gpu, uuid.bytes, 16);
  memcpy(va_space, uuid.bytes, 16);
  if (!(mode && strcmp(mode, "none") == 0) && fc_uvm_call(37, gpu, 36) != 0) return CUDA_ERROR_UNKNOWN;
  if (!(mode && (strcmp(mode, "none") == 0 || strcmp(mode, "gpu") == 0)) && fc_uvm_call(25, va_space, 28) != 0)
    return CUDA_ERROR_UNKNOWN;
  uvm_registered[d] = 1;
  return CUDA_SUCCESS;
}

/* Test control: close the descriptor and register anew on the next context
 * retain, under the environment of that moment. */
void fake_cuda_uvm_reset(void) {
  pthread_mutex_lock(&fc_mu);
  if (uvm_fd >= 0) close(uvm_fd);
  uvm_fd = -1;
  memset(uvm_registered, 0, sizeof(uvm_registered));
  pthread_mutex_unlock(&fc_mu);
}

int fc_uvm_active(void) { return uvm_fd >= 0; }
int fc_uvm_external(void) {
  const char* v = getenv("FAKE_CUDA_UVM_EXTERNAL");
  return uvm_fd >= 0 && v && strcmp(v, "1") == 0;
}

static int bad_device(CUdevice d) { return d < 0 || d >= fc_device_count() || d >= MAX_DEVICES; }
CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice d) {
  if (!fc_initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (bad_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  INJECT("cuDevicePrimaryCtxRetain");
  if (uvm_register(d) != CUDA_SUCCESS) return CUDA_ERROR_UNKNOWN;
  CUresult rc = CUDA_SUCCESS;
  pthread_mutex_lock(&fc_mu);
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
  pthread_mutex_unlock(&fc_mu);
  return rc;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
  if (!fc_initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (bad_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  CUresult rc = CUDA_SUCCESS;
  pthread_mutex_lock(&fc_mu);
  if (primary_refs[d] == 0) {
    rc = CUDA_ERROR_INVALID_CONTEXT;  /* never retained (or reset since) */
  } else if (--primary_refs[d] == 0) {
    primary[d]->alive = 0;  /* destroyed, not popped from any thread's stack */
    primary[d] = NULL;
  }
  pthread_mutex_unlock(&fc_mu);
  return rc;
}
/* Destroys the primary context now, whoever holds references (the only way
 * out of a poisoned context short of ending the process); holders' later
 * calls get CUDA_ERROR_CONTEXT_IS_DESTROYED, their releases INVALID_CONTEXT. */
CUresult cuDevicePrimaryCtxReset_v2(CUdevice d) {
  if (!fc_initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (bad_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&fc_mu);
  if (primary[d]) primary[d]->alive = 0;
  primary[d] = NULL;
  primary_refs[d] = 0;
  pthread_mutex_unlock(&fc_mu);
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned int* flags, int* active) {
  if (!fc_initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (bad_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&fc_mu);
  *flags = 0;
  *active = primary[d] != NULL;
  pthread_mutex_unlock(&fc_mu);
  return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext* ctx) {
  if (!fc_initialized) return CUDA_ERROR_NOT_INITIALIZED;
  *ctx = fc_current();
  return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext ctx) {
  if (!fc_initialized) return CUDA_ERROR_NOT_INITIALIZED;
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
  if (!fc_initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (!ctx || !ctx->alive || ctx_depth == MAX_STACK) return CUDA_ERROR_INVALID_CONTEXT;
  ctx_stack[ctx_depth++] = ctx;
  watch_thread_exit();
  return CUDA_SUCCESS;
}
CUresult cuCtxPopCurrent_v2(CUcontext* ctx) {
  if (!fc_initialized) return CUDA_ERROR_NOT_INITIALIZED;
  if (ctx_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
  CUcontext top = ctx_stack[--ctx_depth];
  if (ctx) *ctx = top;
  return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult rc, const char** name) {
  switch (rc) {
#define NAME(code) case code: *name = #code; break;
    NAME(CUDA_SUCCESS) NAME(CUDA_ERROR_INVALID_VALUE) NAME(CUDA_ERROR_OUT_OF_MEMORY)
    NAME(CUDA_ERROR_NOT_INITIALIZED) NAME(CUDA_ERROR_NO_DEVICE) NAME(CUDA_ERROR_INVALID_DEVICE)
    NAME(CUDA_ERROR_INVALID_CONTEXT) NAME(CUDA_ERROR_NOT_MAPPED) NAME(CUDA_ERROR_INVALID_HANDLE)
    NAME(CUDA_ERROR_ILLEGAL_STATE) NAME(CUDA_ERROR_ILLEGAL_ADDRESS) NAME(CUDA_ERROR_CONTEXT_IS_DESTROYED)
    NAME(CUDA_ERROR_NOT_SUPPORTED) NAME(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    NAME(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED) NAME(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED)
    NAME(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) NAME(CUDA_ERROR_CAPTURED_EVENT)
    NAME(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD) NAME(CUDA_ERROR_UNKNOWN)
#undef NAME
    default: *name = NULL; return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}
