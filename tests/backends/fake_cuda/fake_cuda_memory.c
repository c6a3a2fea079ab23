/* The fake CUDA driver's memory: reservations, allocations, mappings and
 * access, device memory that other processes share (the rules: fake_cuda.c). */
#include "fake_cuda.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static size_t granularity(void) { return fc_env_size("FAKE_CUDA_GRANULARITY", 2u << 20); }
static int unmap_spans(void) { return fc_env_size("FAKE_CUDA_UNMAP_SPANS", 0) != 0; }
#define HOST_PAGE ((size_t)4096)

/* Device memory: total (FAKE_CUDA_TOTAL_MEM or fake_cuda_set_total_mem),
 * what this process created, what other processes hold. */
static size_t total_override = 0;
size_t fc_total_mem(void) { return total_override ? total_override : fc_env_size("FAKE_CUDA_TOTAL_MEM", (size_t)8 << 30); }
static size_t bytes_created = 0;
static size_t bytes_of_others = 0;
static size_t free_mem_locked(void) {
  size_t used = bytes_created + bytes_of_others;
  return fc_total_mem() > used ? fc_total_mem() - used : 0;
}

/* An allocation handle points at one of these; they are never freed, so a
 * released handle stays recognisable (alive = 0). */
typedef struct { int fd; size_t size; int alive; } Alloc;
#define MAX_ALLOCS 65536
static Alloc allocs[MAX_ALLOCS];
static int num_allocs = 0;
static Alloc* alloc_of(CUmemGenericAllocationHandle h) {
  Alloc* a = (Alloc*)(uintptr_t)h;
  return (a >= allocs && a < allocs + num_allocs && a->alive) ? a : NULL;
}

typedef struct { uintptr_t addr; size_t size; uintptr_t handle; int access; } Range;
#define MAX_RANGES 65536
static Range mappings[MAX_RANGES];
static int num_mappings = 0;
static Range reservations[1024];
static int num_reservations = 0;
static long live_handles = 0;
static long unmap_calls = 0;

/* 1 when the host's own mappings give [addr, addr+bytes) the protection that
 * `need` asks for: what nvidia-uvm (the stand-in of tests/backends/fake_uvm)
 * mapped into an external range, which this driver's tables do not hold. */
static int host_allows(uintptr_t addr, size_t bytes, int need) {
  FILE* f = fopen("/proc/self/maps", "r");
  if (!f) return 0;
  char line[512];
  uintptr_t at = addr, end = addr + bytes;
  while (at < end && fgets(line, sizeof(line), f)) {
    unsigned long lo, hi;
    char perms[8];
    if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3 || at < lo || at >= hi) continue;
    if (perms[0] != 'r' || (need == CU_MEM_ACCESS_FLAGS_PROT_READWRITE && perms[1] != 'w')) break;
    at = hi;
  }
  fclose(f);
  return at >= end;
}

int fc_accessible_locked(uintptr_t addr, size_t bytes, int need) {
  /* every byte must lie in a mapping with enough access; mappings do not overlap */
  uintptr_t at = addr, end = addr + bytes;
  while (at < end) {
    int found = 0;
    for (int j = 0; j < num_mappings; ++j) {
      if (at >= mappings[j].addr && at < mappings[j].addr + mappings[j].size) {
        if ((mappings[j].access & need) != need) return 0;
        at = mappings[j].addr + mappings[j].size;
        found = 1;
        break;
      }
    }
    if (!found) return fc_uvm_active() && host_allows(at, (size_t)(end - at), need);
  }
  return 1;
}

/* ---- control API ---- */

long fake_cuda_live_handles(void) { return live_handles; }
long fake_cuda_live_mappings(void) { return num_mappings; }
long fake_cuda_live_reservations(void) { return num_reservations; }
long fake_cuda_sync_calls(void) { return fc_sync_calls; }
/* Mappings that start inside [lo, hi). */
long fake_cuda_mappings_in(unsigned long long lo, unsigned long long hi) {
  long n = 0;
  pthread_mutex_lock(&fc_mu);
  for (int j = 0; j < num_mappings; ++j) n += mappings[j].addr >= lo && mappings[j].addr < hi;
  pthread_mutex_unlock(&fc_mu);
  return n;
}
long fake_cuda_unmap_calls(void) { return unmap_calls; }
/* Device memory: the total (0: back to FAKE_CUDA_TOTAL_MEM), and another
 * process taking or giving back bytes. The take fails (returns 0, nothing
 * taken) when fewer bytes are free. */
void fake_cuda_set_total_mem(unsigned long long bytes) {
  pthread_mutex_lock(&fc_mu);
  total_override = (size_t)bytes;
  pthread_mutex_unlock(&fc_mu);
}
int fake_cuda_other_process_alloc(unsigned long long bytes) {
  pthread_mutex_lock(&fc_mu);
  int ok = bytes <= free_mem_locked();
  if (ok) bytes_of_others += (size_t)bytes;
  pthread_mutex_unlock(&fc_mu);
  return ok;
}
void fake_cuda_other_process_free(unsigned long long bytes) {
  pthread_mutex_lock(&fc_mu);
  bytes_of_others -= bytes < bytes_of_others ? (size_t)bytes : bytes_of_others;
  pthread_mutex_unlock(&fc_mu);
}
unsigned long long fake_cuda_free_mem(void) {
  pthread_mutex_lock(&fc_mu);
  size_t f = free_mem_locked();
  pthread_mutex_unlock(&fc_mu);
  return f;
}

/* The allocation handle mapped at addr (0 when nothing is), so tests can check
 * a page table against what is really mapped, shared pages included. */
unsigned long long fake_cuda_handle_at(unsigned long long addr) {
  unsigned long long h = 0;
  pthread_mutex_lock(&fc_mu);
  for (int j = 0; j < num_mappings; ++j)
    if (addr >= mappings[j].addr && addr < mappings[j].addr + mappings[j].size) h = mappings[j].handle;
  pthread_mutex_unlock(&fc_mu);
  return h;
}
/* 1 when addr is mapped and cuMemSetAccess granted read-write access to it. */
int fake_cuda_accessible(unsigned long long addr) {
  pthread_mutex_lock(&fc_mu);
  int ok = fc_accessible_locked((uintptr_t)addr, 1, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  pthread_mutex_unlock(&fc_mu);
  return ok;
}

/* ---- driver API: memory --------------------------------------------------- */

CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  NEED_CONTEXT();
  pthread_mutex_lock(&fc_mu);
  *total = fc_total_mem();
  *free_bytes = free_mem_locked();
  pthread_mutex_unlock(&fc_mu);
  return CUDA_SUCCESS;
}

/* The checks cuda.h states for CUmemAllocationProp: a pinned allocation on
 * a device that exists (host locations are not modelled: NOT_SUPPORTED), a
 * handle-type mask of known bits (Win32 ones are Windows-only, fabric needs
 * an IMEX channel the fake has not), win32HandleMetaData zero unless a Win32
 * handle is asked for, allocFlags of known values. */
static CUresult check_prop(const CUmemAllocationProp* prop) {
  if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
  switch (prop->location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
      if (prop->location.id < 0 || prop->location.id >= fc_device_count()) return CUDA_ERROR_INVALID_DEVICE;
      break;
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
      return CUDA_ERROR_NOT_SUPPORTED;
    default:  /* HOST_NUMA_CURRENT is documented as INVALID_VALUE too */
      return CUDA_ERROR_INVALID_VALUE;
  }
  const int known = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_WIN32 |
                    CU_MEM_HANDLE_TYPE_WIN32_KMT | CU_MEM_HANDLE_TYPE_FABRIC;
  int types = prop->requestedHandleTypes;
  if (types & ~known) return CUDA_ERROR_INVALID_VALUE;
  if (types & (CU_MEM_HANDLE_TYPE_WIN32 | CU_MEM_HANDLE_TYPE_WIN32_KMT)) return CUDA_ERROR_INVALID_VALUE;
  if (types & CU_MEM_HANDLE_TYPE_FABRIC) return CUDA_ERROR_NOT_SUPPORTED;
  if (prop->win32HandleMetaData != NULL) return CUDA_ERROR_INVALID_VALUE;
  if (prop->allocFlags.compressionType > CU_MEM_ALLOCATION_COMP_GENERIC) return CUDA_ERROR_INVALID_VALUE;
  if (prop->allocFlags.gpuDirectRDMACapable > 1) return CUDA_ERROR_INVALID_VALUE;
  if (prop->allocFlags.usage & ~(CU_MEM_CREATE_USAGE_TILE_POOL | CU_MEM_CREATE_USAGE_HW_DECOMPRESS))
    return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp* prop, int option) {
  NEED_CONTEXT();
  if (!g || (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
    return CUDA_ERROR_INVALID_VALUE;
  CUresult rc = check_prop(prop);
  if (rc != CUDA_SUCCESS) return rc;
  *g = option == CU_MEM_ALLOC_GRANULARITY_MINIMUM ? granularity()
                                                  : fc_env_size("FAKE_CUDA_RECOMMENDED_GRANULARITY", granularity());
  return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags) {
  (void)addr;  /* a hint only */
  NEED_CONTEXT();
  INJECT("cuMemAddressReserve");
  CUresult unsafe = fc_capture_forbids_unsafe_call();
  if (unsafe != CUDA_SUCCESS) return unsafe;
  if (!ptr || size == 0 || size % HOST_PAGE || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (align & (align - 1)) return CUDA_ERROR_INVALID_VALUE;  /* 0 or a power of two */
  /* Alignment 0 promises nothing beyond the host page: give an odd multiple
   * of it, never a granularity-aligned address by luck. */
  size_t a = align ? (align < HOST_PAGE ? HOST_PAGE : align) : 2 * granularity();
  size_t skew = align ? 0 : HOST_PAGE;
  char* raw = mmap(NULL, size + a + skew, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  char* p = (char*)(((uintptr_t)raw + a - 1) & ~(uintptr_t)(a - 1)) + skew;
  if (p > raw) munmap(raw, (size_t)(p - raw));
  if (raw + size + a + skew > p + size) munmap(p + size, (size_t)(raw + size + a + skew - (p + size)));
  if (fc_uvm_external()) {
    uint64_t range[3] = {(uint64_t)(uintptr_t)p, size, 0};
    if (fc_uvm_call(73, range, 16) != 0) {
      munmap(p, size);
      return CUDA_ERROR_UNKNOWN;
    }
  }
  pthread_mutex_lock(&fc_mu);
  reservations[num_reservations].addr = (uintptr_t)p;
  reservations[num_reservations].size = size;
  num_reservations++;
  pthread_mutex_unlock(&fc_mu);
  *ptr = (CUdeviceptr)(uintptr_t)p;
  return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  NEED_CONTEXT();
  fc_note_release();
  CUresult unsafe = fc_capture_forbids_unsafe_call();
  if (unsafe != CUDA_SUCCESS) return unsafe;
  CUresult rc = CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&fc_mu);
  for (int i = 0; i < num_reservations; ++i) {
    if (reservations[i].addr == ptr && reservations[i].size == size) {
      for (int j = 0; j < num_mappings; ++j)  /* still mapped inside: refuse */
        if (mappings[j].addr >= ptr && mappings[j].addr < ptr + size) goto out;
      if (fc_uvm_external()) {
        uint64_t range[3] = {ptr, size, 0};
        fc_uvm_call(34, range, 16);
      }
      munmap((void*)(uintptr_t)ptr, size);
      reservations[i] = reservations[--num_reservations];
      rc = CUDA_SUCCESS;
      break;
    }
  }
out:
  pthread_mutex_unlock(&fc_mu);
  return rc;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                     unsigned long long flags) {
  NEED_CONTEXT();
  INJECT("cuMemCreate");
  CUresult unsafe = fc_capture_forbids_unsafe_call();
  if (unsafe != CUDA_SUCCESS) return unsafe;
  CUresult rc = check_prop(prop);
  if (rc != CUDA_SUCCESS) return rc;
  if (!handle || flags != 0 || size == 0 || size % granularity()) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&fc_mu);
  if (size > free_mem_locked() || num_allocs == MAX_ALLOCS) {
    pthread_mutex_unlock(&fc_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  Alloc* a = &allocs[num_allocs++];
  a->fd = -1;
  a->size = size;
  a->alive = 1;
  live_handles++;
  bytes_created += size;
  pthread_mutex_unlock(&fc_mu);
  int fd = memfd_create("fake-cuda-page", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
    if (fd >= 0) close(fd);
    pthread_mutex_lock(&fc_mu);
    a->alive = 0;
    live_handles--;
    bytes_created -= size;
    pthread_mutex_unlock(&fc_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  a->fd = fd;
  *handle = (CUmemGenericAllocationHandle)(uintptr_t)a;
  return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  NEED_CONTEXT();
  fc_note_release();
  INJECT("cuMemRelease");  /* a failed release keeps the allocation */
  CUresult unsafe = fc_capture_forbids_unsafe_call();
  if (unsafe != CUDA_SUCCESS) return unsafe;
  pthread_mutex_lock(&fc_mu);
  Alloc* a = alloc_of(handle);
  if (!a) {
    pthread_mutex_unlock(&fc_mu);
    return CUDA_ERROR_INVALID_VALUE;
  }
  a->alive = 0;
  live_handles--;
  bytes_created -= a->size;  /* the fake frees at release; mappings keep the pages */
  pthread_mutex_unlock(&fc_mu);
  close(a->fd);  /* existing mappings keep the memory, as in the real driver */
  return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  NEED_CONTEXT();
  INJECT("cuMemMap");
  CUresult unsafe = fc_capture_forbids_unsafe_call();
  if (unsafe != CUDA_SUCCESS) return unsafe;
  size_t delay_us = fc_env_size("FAKE_CUDA_MAP_DELAY_US", 0);
  if (delay_us) usleep((useconds_t)delay_us);
  pthread_mutex_lock(&fc_mu);
  Alloc* a = alloc_of(handle);
  int reserved = 0;
  for (int i = 0; i < num_reservations; ++i)
    reserved |= ptr >= reservations[i].addr && ptr + size <= reservations[i].addr + reservations[i].size;
  int overlaps = 0;
  for (int j = 0; j < num_mappings; ++j)
    overlaps |= ptr < mappings[j].addr + mappings[j].size && mappings[j].addr < ptr + size;
  /* offset: "currently must be zero"; flags: "must be zero now" (cuda.h) */
  if (!a || offset != 0 || flags != 0 || size == 0 || size > a->size || size % granularity() ||
      ptr % granularity() || !reserved || overlaps) {
    pthread_mutex_unlock(&fc_mu);
    return CUDA_ERROR_INVALID_VALUE;
  }
  void* p = mmap((void*)(uintptr_t)ptr, size, PROT_NONE, MAP_FIXED | MAP_SHARED, a->fd, 0);
  if (p == MAP_FAILED || num_mappings == MAX_RANGES) {
    pthread_mutex_unlock(&fc_mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  mappings[num_mappings].addr = ptr;
  mappings[num_mappings].size = size;
  mappings[num_mappings].handle = (uintptr_t)handle;
  mappings[num_mappings].access = CU_MEM_ACCESS_FLAGS_PROT_NONE;
  num_mappings++;
  pthread_mutex_unlock(&fc_mu);
  return CUDA_SUCCESS;
}

/* Bytes of [ptr, ptr+size) covered by mappings that lie wholly inside it; -1
 * when a mapping straddles an edge. Caller holds fc_mu. */
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
  CUresult unsafe = fc_capture_forbids_unsafe_call();
  if (unsafe != CUDA_SUCCESS) return unsafe;
  if (!desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
  int access = -1;
  for (size_t i = 0; i < count; ++i) {  /* the device's entry decides (one device is modelled) */
    int f = desc[i].flags;
    if (f != CU_MEM_ACCESS_FLAGS_PROT_NONE && f != CU_MEM_ACCESS_FLAGS_PROT_READ &&
        f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
      return CUDA_ERROR_INVALID_VALUE;
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
    if (desc[i].location.id < 0 || desc[i].location.id >= fc_device_count()) return CUDA_ERROR_INVALID_DEVICE;
    if (desc[i].location.id == fc_current()->device) access = f;
  }
  pthread_mutex_lock(&fc_mu);
  long c = covered(ptr, size);
  pthread_mutex_unlock(&fc_mu);
  if (c != (long)size || size == 0) return CUDA_ERROR_INVALID_VALUE;  /* must be fully mapped */
  if (access < 0) return CUDA_SUCCESS;  /* other devices only */
  int prot = access == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? PROT_READ | PROT_WRITE
             : access == CU_MEM_ACCESS_FLAGS_PROT_READ    ? PROT_READ
                                                           : PROT_NONE;
  if (mprotect((void*)(uintptr_t)ptr, size, prot) != 0) return CUDA_ERROR_UNKNOWN;
  pthread_mutex_lock(&fc_mu);
  for (int j = 0; j < num_mappings; ++j)
    if (mappings[j].addr >= ptr && mappings[j].addr < ptr + size) mappings[j].access = access;
  pthread_mutex_unlock(&fc_mu);
  return CUDA_SUCCESS;
}

/* 1 when [ptr, ptr+size) is exactly one mapping. Caller holds fc_mu. */
static int one_mapping(CUdeviceptr ptr, size_t size) {
  for (int j = 0; j < num_mappings; ++j)
    if (mappings[j].addr == ptr && mappings[j].size == size) return 1;
  return 0;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  NEED_CONTEXT();
  __sync_fetch_and_add(&unmap_calls, 1);
  INJECT("cuMemUnmap");
  CUresult unsafe = fc_capture_forbids_unsafe_call();
  if (unsafe != CUDA_SUCCESS) return unsafe;
  pthread_mutex_lock(&fc_mu);
  long c = covered(ptr, size);
  if (size == 0 || c != (long)size || (!unmap_spans() && !one_mapping(ptr, size))) {
    pthread_mutex_unlock(&fc_mu);
    return CUDA_ERROR_INVALID_VALUE;  /* must cover whole earlier mappings */
  }
  /* A queued access still using the range faults when it runs: the unmap
   * itself succeeds (nothing waits for it), the context is poisoned. */
  CUcontext victim = NULL;
  if (fc_pending_access_locked((uintptr_t)ptr, (uintptr_t)(ptr + size), &victim))
    fc_poison_locked(victim, (uintptr_t)ptr);
  for (int j = 0; j < num_mappings;) {
    if (mappings[j].addr >= ptr && mappings[j].addr < ptr + size)
      mappings[j] = mappings[--num_mappings];
    else
      ++j;
  }
  mmap((void*)(uintptr_t)ptr, size, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
       -1, 0);
  pthread_mutex_unlock(&fc_mu);
  return CUDA_SUCCESS;
}

/* A copy on the legacy default stream: a device access like any kernel's. */
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
  NEED_CONTEXT();
  INJECT("cuMemcpyDtoD");
  CUresult unsafe = fc_capture_forbids_unsafe_call();  /* a synchronous copy */
  if (unsafe != CUDA_SUCCESS) return unsafe;
  return fc_legacy_copy((uintptr_t)dst, (uintptr_t)src, bytes);
}

