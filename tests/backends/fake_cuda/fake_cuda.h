/* The fake CUDA driver's shared declarations (tests/backends/fake_cuda): types
 * and values as cuda.h (CUDA 13.0) spells them, and the state that the memory
 * half (fake_cuda.c) and the stream half (fake_cuda_streams.c) share. */
#pragma once
#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;
typedef struct CUgraph_st* CUgraph;
typedef struct CUgraph_st* CUgraphExec; /* an instantiated graph: a copy of the nodes */
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

/* CUresult values used here (cuda.h's cudaError_enum). */
enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_NOT_MAPPED = 211,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_ILLEGAL_STATE = 401,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
  CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
  CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903,
  CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906,
  CUDA_ERROR_CAPTURED_EVENT = 907,
  CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
  CUDA_ERROR_UNKNOWN = 999,
};

/* cuMemCreate's properties (CUmemAllocationProp_v1) and their values. */
enum { CU_MEM_ALLOCATION_TYPE_PINNED = 0x1 };
enum {
  CU_MEM_LOCATION_TYPE_DEVICE = 0x1,
  CU_MEM_LOCATION_TYPE_HOST = 0x2,
  CU_MEM_LOCATION_TYPE_HOST_NUMA = 0x3,
  CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT = 0x4,
};
enum {
  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1,
  CU_MEM_HANDLE_TYPE_WIN32 = 0x2,
  CU_MEM_HANDLE_TYPE_WIN32_KMT = 0x4,
  CU_MEM_HANDLE_TYPE_FABRIC = 0x8,
};
enum { CU_MEM_ACCESS_FLAGS_PROT_NONE = 0x0, CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1, CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3 };
enum { CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1 };
enum { CU_MEM_ALLOCATION_COMP_GENERIC = 0x1 };
enum { CU_MEM_CREATE_USAGE_TILE_POOL = 0x1, CU_MEM_CREATE_USAGE_HW_DECOMPRESS = 0x2 };
/* Streams and capture. */
enum { CU_STREAM_NON_BLOCKING = 0x1 };
#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)
enum { CU_STREAM_CAPTURE_MODE_GLOBAL = 0, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1, CU_STREAM_CAPTURE_MODE_RELAXED = 2 };
enum { CU_STREAM_CAPTURE_STATUS_NONE = 0, CU_STREAM_CAPTURE_STATUS_ACTIVE = 1, CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2 };

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void* win32HandleMetaData;
  struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

/* ---- state shared by both halves (guarded by fc_mu unless said otherwise) ---- */

extern pthread_mutex_t fc_mu;
extern int fc_initialized;

/* Context objects are never freed, so a handle to a destroyed one stays
 * recognisable (alive = 0). poisoned: a device access faulted in it (sticky:
 * every later call in it returns CUDA_ERROR_ILLEGAL_ADDRESS). */
struct CUctx_st { int device; int alive; int primary; int poisoned; unsigned long long fault_addr; };
CUcontext fc_current(void);
CUcontext fc_primary(int device);  /* NULL while inactive */
int fc_device_count(void);

/* How a call that needs a context starts: the context current on this
 * thread, alive and not poisoned. */
CUresult fc_need_context(void);
#define NEED_CONTEXT()                         \
  do {                                         \
    CUresult need_rc_ = fc_need_context();     \
    if (need_rc_ != CUDA_SUCCESS) return need_rc_; \
  } while (0)

/* Failure injection and latency (fake_cuda.c). */
int fc_should_fail(const char* name, CUresult* rc);
void fc_latency(const char* name);
#define INJECT(name)                                            \
  do {                                                          \
    CUresult injected_;                                         \
    fc_latency(name);                                           \
    if (fc_should_fail(name, &injected_)) return injected_;     \
  } while (0)

/* Memory (fake_cuda.c): 1 when [addr, addr+bytes) is wholly mapped with at
 * least `need` access (PROT_READ or PROT_READWRITE). Caller holds fc_mu. */
int fc_accessible_locked(uintptr_t addr, size_t bytes, int need);
/* Marks ctx poisoned by a fault at addr. Caller holds fc_mu. */
void fc_poison_locked(CUcontext ctx, uintptr_t addr);

/* Streams (fake_cuda_streams.c). */
/* 1 when a queued, unfinished device access overlaps [lo, hi); its context
 * is returned in *ctx. Caller holds fc_mu. */
int fc_pending_access_locked(uintptr_t lo, uintptr_t hi, CUcontext* ctx);
/* The capture rules of a "potentially unsafe" call (memory management,
 * synchronous copies): CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the
 * conflicting captures invalidated, when this thread may not make one now. */
CUresult fc_capture_forbids_unsafe_call(void);
/* A release (cuMemRelease, cuMemAddressFree, cuEventDestroy) is being made:
 * counted when any capture is in progress, whatever its mode or thread
 * (fake_cuda_releases_during_capture), since a release in global mode from
 * any thread may invalidate a capture. */
void fc_note_release(void);
/* The legacy stream used while a blocking stream of ctx captures:
 * CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, and those captures invalidated. */
CUresult fc_capture_forbids_legacy_use(CUcontext ctx);
/* A device-to-device copy queued on the legacy stream (cuMemcpyDtoD). */
CUresult fc_legacy_copy(uintptr_t dst, uintptr_t src, size_t bytes);

/* Shared helpers (fake_cuda.c, fake_cuda_memory.c). */
size_t fc_env_size(const char* name, size_t fallback);
size_t fc_total_mem(void);
extern long fc_sync_calls;  /* cuCtxSynchronize calls */
int fc_uvm_external(void);
int fc_uvm_active(void);  /* a nvidia-uvm descriptor is open: its mappings count too */
int fc_uvm_call(unsigned long cmd, void* params, size_t status_offset);
