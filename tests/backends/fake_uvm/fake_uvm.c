/* A test-only stand-in for the nvidia-uvm module patched by driver_patch/,
 * loaded with LD_PRELOAD: it interposes ioctl(2) and answers, on descriptors
 * of the file named by $FAKE_UVM_DEVICE, the stock ioctls vattn and the CUDA
 * driver issue (UVM_INITIALIZE, UVM_REGISTER_GPU, UVM_REGISTER_GPU_VASPACE,
 * UVM_CREATE_EXTERNAL_RANGE, UVM_FREE) and the five VATTN_UVM_* ioctls, on
 * host memory: an allocation is a memfd, a mapping is an mmap of it at the
 * VA. Every other descriptor goes to the real ioctl.
 *
 * The argument layouts are written down here by byte offset, on purpose not
 * taken from csrc/backends/vattn_uvm_ioctl.h: tests compare this table with
 * the header (fake_uvm_field), so a header change the module would not see
 * the same way fails a test.
 *
 * Like the module, state belongs to the open file description (the VA space),
 * shared by dup()ed descriptors: the file offset of the stand-in file, set by
 * UVM_INITIALIZE, names it. The rules enforced are the patched module's
 * (uvm_vattn.c): what each call refuses and in which order, batched MAP and
 * UNMAP that stop at the first failing entry and report `done`, allocations
 * that live while a handle or a mapping holds them.
 *
 * Environment (read at each call):
 *   FAKE_UVM_DEVICE      the stand-in device file (required)
 *   FAKE_UVM_STOCK=1     behave as the stock module: VATTN_UVM_* fail ENOSYS
 *   FAKE_UVM_ABI         ABI version QUERY reports (default 1)
 *   FAKE_UVM_PAGE_SIZES  mask of page sizes a GPU serves (default all four)
 *   FAKE_UVM_TOTAL_MEM   bytes of GPU memory allocations may use (default 1 GiB)
 *   FAKE_UVM_VA_LIMIT    first VA the GPU cannot address (default 2^57)
 *   FAKE_UVM_FRESH_MAPS=1  a broken module: MAP puts new zeroed memory at the
 *                        VA instead of the allocation's, so a page mapped at
 *                        two addresses is two memories (driver_patch/verify.py
 *                        must notice)
 * Control functions (fake_uvm_*) inject failures and report what is alive.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

/* ---- the ABI, by number and byte offset ------------------------------------ */

#define CMD_INITIALIZE            0x30000001ul
#define CMD_REGISTER_GPU_VASPACE  25ul
#define CMD_FREE                  34ul
#define CMD_REGISTER_GPU          37ul
#define CMD_CREATE_EXTERNAL_RANGE 73ul
#define CMD_VATTN_QUERY           0x30564101ul
#define CMD_VATTN_CREATE          0x30564102ul
#define CMD_VATTN_MAP             0x30564103ul
#define CMD_VATTN_UNMAP           0x30564104ul
#define CMD_VATTN_RELEASE         0x30564105ul

#define ABI_VERSION 1u
#define MAX_BATCH 4096u
#define ACCESS_READ_WRITE 3u
#define QUERY_GPU_REGISTERED 0x1u
#define QUERY_GPU_VA_SPACE 0x2u
#define QUERY_RANGE_EXTERNAL 0x4u
#define PAGE_64K 0x10000ull
#define PAGE_128K 0x20000ull
#define PAGE_256K 0x40000ull
#define PAGE_2M 0x200000ull
#define ALL_PAGE_SIZES (PAGE_64K | PAGE_128K | PAGE_256K | PAGE_2M)

enum {
  NV_OK = 0x00,
  NV_ERR_ILLEGAL_ACTION = 0x16,
  NV_ERR_INVALID_ADDRESS = 0x1E,
  NV_ERR_INVALID_ARGUMENT = 0x1F,
  NV_ERR_INVALID_DEVICE = 0x26,
  NV_ERR_INVALID_OBJECT_HANDLE = 0x33,
  NV_ERR_NO_MEMORY = 0x51,
  NV_ERR_NOT_SUPPORTED = 0x56,
  NV_ERR_OUT_OF_RANGE = 0x5B,
  NV_ERR_UVM_ADDRESS_IN_USE = 0x68,
};

typedef struct {
  const char* name;  /* "STRUCT.field", or "STRUCT" for the size */
  size_t offset;
  size_t size;
} Field;

static const Field kFields[] = {
    {"VATTN_UVM_QUERY_PARAMS", 0, 56},
    {"VATTN_UVM_QUERY_PARAMS.gpuUuid", 0, 16},
    {"VATTN_UVM_QUERY_PARAMS.rangeBase", 16, 8},
    {"VATTN_UVM_QUERY_PARAMS.rangeLength", 24, 8},
    {"VATTN_UVM_QUERY_PARAMS.pageSizes", 32, 8},
    {"VATTN_UVM_QUERY_PARAMS.abiVersion", 40, 4},
    {"VATTN_UVM_QUERY_PARAMS.flags", 44, 4},
    {"VATTN_UVM_QUERY_PARAMS.rmStatus", 48, 4},
    {"VATTN_UVM_CREATE_PARAMS", 0, 40},
    {"VATTN_UVM_CREATE_PARAMS.gpuUuid", 0, 16},
    {"VATTN_UVM_CREATE_PARAMS.pageSize", 16, 8},
    {"VATTN_UVM_CREATE_PARAMS.handle", 24, 8},
    {"VATTN_UVM_CREATE_PARAMS.flags", 32, 4},
    {"VATTN_UVM_CREATE_PARAMS.rmStatus", 36, 4},
    {"VATTN_UVM_MAP_ENTRY", 0, 16},
    {"VATTN_UVM_MAP_ENTRY.va", 0, 8},
    {"VATTN_UVM_MAP_ENTRY.handle", 8, 8},
    {"VATTN_UVM_MAP_PARAMS", 0, 32},
    {"VATTN_UVM_MAP_PARAMS.entries", 0, 8},
    {"VATTN_UVM_MAP_PARAMS.count", 8, 8},
    {"VATTN_UVM_MAP_PARAMS.done", 16, 8},
    {"VATTN_UVM_MAP_PARAMS.access", 24, 4},
    {"VATTN_UVM_MAP_PARAMS.rmStatus", 28, 4},
    {"VATTN_UVM_UNMAP_PARAMS", 0, 48},
    {"VATTN_UVM_UNMAP_PARAMS.gpuUuid", 0, 16},
    {"VATTN_UVM_UNMAP_PARAMS.addrs", 16, 8},
    {"VATTN_UVM_UNMAP_PARAMS.count", 24, 8},
    {"VATTN_UVM_UNMAP_PARAMS.done", 32, 8},
    {"VATTN_UVM_UNMAP_PARAMS.flags", 40, 4},
    {"VATTN_UVM_UNMAP_PARAMS.rmStatus", 44, 4},
    {"VATTN_UVM_RELEASE_PARAMS", 0, 16},
    {"VATTN_UVM_RELEASE_PARAMS.handle", 0, 8},
    {"VATTN_UVM_RELEASE_PARAMS.flags", 8, 4},
    {"VATTN_UVM_RELEASE_PARAMS.rmStatus", 12, 4},
    {"INITIALIZE_PARAMS", 0, 16},
    {"INITIALIZE_PARAMS.flags", 0, 8},
    {"INITIALIZE_PARAMS.rmStatus", 8, 4},
    {"RANGE_PARAMS", 0, 24},
    {"RANGE_PARAMS.base", 0, 8},
    {"RANGE_PARAMS.length", 8, 8},
    {"RANGE_PARAMS.rmStatus", 16, 4},
    {"REGISTER_GPU_PARAMS", 0, 40},
    {"REGISTER_GPU_PARAMS.gpuUuid", 0, 16},
    {"REGISTER_GPU_PARAMS.rmStatus", 36, 4},
    {"REGISTER_GPU_VASPACE_PARAMS", 0, 32},
    {"REGISTER_GPU_VASPACE_PARAMS.gpuUuid", 0, 16},
    {"REGISTER_GPU_VASPACE_PARAMS.rmStatus", 28, 4},
};

static const Field* field(const char* name) {
  for (size_t i = 0; i < sizeof(kFields) / sizeof(kFields[0]); ++i)
    if (strcmp(kFields[i].name, name) == 0) return &kFields[i];
  abort(); /* a typo in this file, not a test outcome */
}

static uint64_t get(const void* params, const char* name) {
  const Field* f = field(name);
  uint64_t v = 0;
  if (f->size == 8) {
    memcpy(&v, (const char*)params + f->offset, 8);
  } else {
    uint32_t v32;
    memcpy(&v32, (const char*)params + f->offset, 4);
    v = v32;
  }
  return v;
}

static void put(void* params, const char* name, uint64_t v) {
  const Field* f = field(name);
  if (f->size == 8) {
    memcpy((char*)params + f->offset, &v, 8);
  } else {
    uint32_t v32 = (uint32_t)v;
    memcpy((char*)params + f->offset, &v32, 4);
  }
}

static const uint8_t* uuid_of(const void* params, const char* name) {
  return (const uint8_t*)params + field(name)->offset;
}

/* ---- state ------------------------------------------------------------------ */

typedef struct {
  uint8_t uuid[16];
  int has_va_space;
} Gpu;

typedef struct {
  uint64_t handle; /* 0: free slot */
  int va_space;
  int gpu;
  uint64_t size;
  int fd;         /* the memory; -1 once released */
  int refs;       /* 1 for the handle + one per mapping */
  int in_table;   /* handle not yet released */
} Alloc;

typedef struct {
  uint64_t va, size; /* size 0: free slot */
  int va_space;
  int alloc;
  int gpu;
} Mapping;

typedef struct {
  uint64_t base, length; /* length 0: free slot */
  int va_space;
} Range;

#define MAX_VA_SPACES 4096
#define MAX_GPUS 8
#define MAX_ALLOCS 65536
#define MAX_MAPPINGS 262144
#define MAX_RANGES 1024

typedef struct {
  int used;
  Gpu gpus[MAX_GPUS];
  int num_gpus;
  uint64_t last_handle;
} VaSpace;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static VaSpace va_spaces[MAX_VA_SPACES + 1]; /* index = file offset; 0 = not initialised */
static int num_va_spaces = 0;
static Alloc allocs[MAX_ALLOCS];
static Mapping mappings[MAX_MAPPINGS];
static Range ranges[MAX_RANGES];
static long live_allocs = 0, live_mappings = 0, live_ranges = 0;
static uint64_t bytes_in_use = 0;
static long calls[8];

/* Failure injection: the next `skip` units of `call` succeed, then `times`
 * (-1: all) fail. With err != 0 a unit is a call, which returns -1 with errno
 * err before doing anything. Otherwise the unit returns NV_STATUS `status`,
 * and is one entry for MAP and UNMAP (so a batch fails part-way), one call
 * for the others. */
static char fail_call[64];
static long fail_skip = 0, fail_times = 0;
static uint32_t fail_status = 0;
static int fail_errno = 0;

static int injected(const char* call, uint32_t* status, int* err) {
  if (fail_times == 0 || strcmp(call, fail_call) != 0) return 0;
  if (fail_skip > 0) {
    fail_skip--;
    return 0;
  }
  if (fail_times > 0) fail_times--;
  *status = fail_status;
  *err = fail_errno;
  return 1;
}

static uint64_t env_u64(const char* name, uint64_t fallback) {
  const char* v = getenv(name);
  return (v && *v) ? strtoull(v, NULL, 0) : fallback;
}

/* ---- control API for tests -------------------------------------------------- */

void fake_uvm_fail(const char* call, long skip, long times, unsigned status, int err) {
  pthread_mutex_lock(&mu);
  strncpy(fail_call, call, sizeof(fail_call) - 1);
  fail_skip = skip;
  fail_times = times;
  fail_status = status;
  fail_errno = err;
  pthread_mutex_unlock(&mu);
}
void fake_uvm_clear_failures(void) { fake_uvm_fail("", 0, 0, 0, 0); }
long fake_uvm_live_allocs(void) { return live_allocs; }
long fake_uvm_live_mappings(void) { return live_mappings; }
long fake_uvm_live_ranges(void) { return live_ranges; }
unsigned long long fake_uvm_bytes_in_use(void) { return bytes_in_use; }
/* Calls seen per command: 0 QUERY, 1 CREATE, 2 MAP, 3 UNMAP, 4 RELEASE,
 * 5 CREATE_EXTERNAL_RANGE, 6 FREE, 7 others. */
long fake_uvm_calls(int which) { return which >= 0 && which < 8 ? calls[which] : -1; }
/* Handle mapped at va (0 when nothing is). */
unsigned long long fake_uvm_handle_at(unsigned long long va) {
  unsigned long long h = 0;
  pthread_mutex_lock(&mu);
  for (long i = 0; i < MAX_MAPPINGS; ++i)
    if (mappings[i].size && va >= mappings[i].va && va < mappings[i].va + mappings[i].size)
      h = allocs[mappings[i].alloc].handle;
  pthread_mutex_unlock(&mu);
  return h;
}
/* Writes up to max mapped VAs into out; returns how many there are. */
long fake_uvm_mapped_vas(unsigned long long* out, long max) {
  long n = 0;
  pthread_mutex_lock(&mu);
  for (long i = 0; i < MAX_MAPPINGS; ++i) {
    if (!mappings[i].size) continue;
    if (n < max) out[n] = mappings[i].va;
    n++;
  }
  pthread_mutex_unlock(&mu);
  return n;
}
/* The stand-in's own idea of a struct's size or a field's offset and size:
 * returns 0 and fills them, or -1 for an unknown name. */
int fake_uvm_field(const char* name, long* offset, long* size) {
  for (size_t i = 0; i < sizeof(kFields) / sizeof(kFields[0]); ++i) {
    if (strcmp(kFields[i].name, name) == 0) {
      *offset = (long)kFields[i].offset;
      *size = (long)kFields[i].size;
      return 0;
    }
  }
  return -1;
}
/* Name of the i-th entry of that table, NULL past the end. */
const char* fake_uvm_field_name(long i) {
  return i >= 0 && i < (long)(sizeof(kFields) / sizeof(kFields[0])) ? kFields[i].name : NULL;
}
/* Command numbers as the stand-in decodes them, by name. */
unsigned long fake_uvm_command(const char* name) {
  static const struct { const char* name; unsigned long cmd; } cmds[] = {
      {"VATTN_UVM_QUERY", CMD_VATTN_QUERY},     {"VATTN_UVM_CREATE", CMD_VATTN_CREATE},
      {"VATTN_UVM_MAP", CMD_VATTN_MAP},         {"VATTN_UVM_UNMAP", CMD_VATTN_UNMAP},
      {"VATTN_UVM_RELEASE", CMD_VATTN_RELEASE},
  };
  for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); ++i)
    if (strcmp(cmds[i].name, name) == 0) return cmds[i].cmd;
  return 0;
}

/* ---- helpers (mu held) ------------------------------------------------------ */

static int readable(const void* p, size_t n) {
  /* process_vm_readv reports EFAULT for an address we cannot read, where
   * the module's copy_from_user would fail, without faulting here. */
  if (n == 0) return 1;
  char buf[4096];
  for (size_t off = 0; off < n; off += sizeof(buf)) {
    size_t len = n - off < sizeof(buf) ? n - off : sizeof(buf);
    struct iovec local = {buf, len}, remote = {(char*)p + off, len};
    if (process_vm_readv(getpid(), &local, 1, &remote, 1, 0) != (ssize_t)len) return 0;
  }
  return 1;
}

static int find_gpu(VaSpace* vs, const uint8_t* uuid) {
  for (int i = 0; i < vs->num_gpus; ++i)
    if (memcmp(vs->gpus[i].uuid, uuid, 16) == 0) return i;
  return -1;
}

static int uuid_is_zero(const uint8_t* uuid) {
  for (int i = 0; i < 16; ++i)
    if (uuid[i]) return 0;
  return 1;
}

static long find_alloc(int vs, uint64_t handle) {
  if (!handle) return -1;
  for (long i = 0; i < MAX_ALLOCS; ++i)
    if (allocs[i].handle == handle && allocs[i].va_space == vs && allocs[i].in_table) return i;
  return -1;
}

/* The external range of vs holding [va, va + size), or -1. */
static long find_range(int vs, uint64_t va, uint64_t size) {
  for (long i = 0; i < MAX_RANGES; ++i)
    if (ranges[i].length && ranges[i].va_space == vs && va >= ranges[i].base &&
        va - ranges[i].base < ranges[i].length && size <= ranges[i].length - (va - ranges[i].base))
      return i;
  return -1;
}

static void alloc_put(long a) {
  if (--allocs[a].refs > 0) return;
  close(allocs[a].fd);
  bytes_in_use -= allocs[a].size;
  live_allocs--;
  memset(&allocs[a], 0, sizeof(allocs[a]));
  allocs[a].fd = -1;
}

static void unmap_at(long m) {
  /* Anonymous PROT_NONE memory back over it: the range stays reserved. */
  mmap((void*)(uintptr_t)mappings[m].va, mappings[m].size, PROT_NONE,
       MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  long a = mappings[m].alloc;
  memset(&mappings[m], 0, sizeof(mappings[m]));
  live_mappings--;
  alloc_put(a);
}

/* ---- the ioctls (mu held) --------------------------------------------------- */

static uint32_t do_query(int vs, void* p) {
  put(p, "VATTN_UVM_QUERY_PARAMS.abiVersion", env_u64("FAKE_UVM_ABI", ABI_VERSION));
  put(p, "VATTN_UVM_QUERY_PARAMS.flags", 0);
  put(p, "VATTN_UVM_QUERY_PARAMS.pageSizes", 0);
  const uint8_t* uuid = uuid_of(p, "VATTN_UVM_QUERY_PARAMS.gpuUuid");
  uint32_t flags = 0;
  if (!uuid_is_zero(uuid)) {
    int g = find_gpu(&va_spaces[vs], uuid);
    if (g >= 0) {
      flags |= QUERY_GPU_REGISTERED;
      if (va_spaces[vs].gpus[g].has_va_space) flags |= QUERY_GPU_VA_SPACE;
      put(p, "VATTN_UVM_QUERY_PARAMS.pageSizes", env_u64("FAKE_UVM_PAGE_SIZES", ALL_PAGE_SIZES));
    }
  }
  uint64_t base = get(p, "VATTN_UVM_QUERY_PARAMS.rangeBase"), length = get(p, "VATTN_UVM_QUERY_PARAMS.rangeLength");
  if (length && base + length > base && find_range(vs, base, length) >= 0) flags |= QUERY_RANGE_EXTERNAL;
  put(p, "VATTN_UVM_QUERY_PARAMS.flags", flags);
  return NV_OK;
}

static uint32_t do_create(int vs, void* p) {
  put(p, "VATTN_UVM_CREATE_PARAMS.handle", 0);
  uint64_t size = get(p, "VATTN_UVM_CREATE_PARAMS.pageSize");
  if (get(p, "VATTN_UVM_CREATE_PARAMS.flags") || !(size == PAGE_64K || size == PAGE_128K || size == PAGE_256K ||
                                                    size == PAGE_2M))
    return NV_ERR_INVALID_ARGUMENT;
  int g = find_gpu(&va_spaces[vs], uuid_of(p, "VATTN_UVM_CREATE_PARAMS.gpuUuid"));
  if (g < 0) return NV_ERR_INVALID_DEVICE;
  if (!(env_u64("FAKE_UVM_PAGE_SIZES", ALL_PAGE_SIZES) & size)) return NV_ERR_NOT_SUPPORTED;
  if (bytes_in_use + size > env_u64("FAKE_UVM_TOTAL_MEM", 1ull << 30)) return NV_ERR_NO_MEMORY;
  long a = 0;
  while (a < MAX_ALLOCS && allocs[a].handle) a++;
  if (a == MAX_ALLOCS) return NV_ERR_NO_MEMORY;
  int fd = memfd_create("fake-uvm-page", MFD_CLOEXEC); /* zero-filled, like the module's memsets */
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
    if (fd >= 0) close(fd);
    return NV_ERR_NO_MEMORY;
  }
  allocs[a] = (Alloc){++va_spaces[vs].last_handle, vs, g, size, fd, 1, 1};
  live_allocs++;
  bytes_in_use += size;
  put(p, "VATTN_UVM_CREATE_PARAMS.handle", allocs[a].handle);
  return NV_OK;
}

static uint32_t map_one(int vs, uint64_t va, uint64_t handle) {
  long a = find_alloc(vs, handle);
  if (a < 0) return NV_ERR_INVALID_OBJECT_HANDLE;
  uint64_t size = allocs[a].size;
  if (va == 0 || va % size || va + size < va) return NV_ERR_INVALID_ADDRESS;
  if (find_range(vs, va, size) < 0) return NV_ERR_INVALID_ADDRESS;
  if (!va_spaces[vs].gpus[allocs[a].gpu].has_va_space) return NV_ERR_INVALID_DEVICE;
  if (va + size > env_u64("FAKE_UVM_VA_LIMIT", 1ull << 57)) return NV_ERR_OUT_OF_RANGE;
  long free_slot = -1;
  for (long m = 0; m < MAX_MAPPINGS; ++m) {
    if (!mappings[m].size) {
      if (free_slot < 0) free_slot = m;
      continue;
    }
    if (mappings[m].va_space == vs && mappings[m].gpu == allocs[a].gpu && va < mappings[m].va + mappings[m].size &&
        mappings[m].va < va + size)
      return NV_ERR_UVM_ADDRESS_IN_USE;
  }
  if (free_slot < 0) return NV_ERR_NO_MEMORY;
  void* at = env_u64("FAKE_UVM_FRESH_MAPS", 0)
                 ? mmap((void*)(uintptr_t)va, size, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_SHARED | MAP_ANONYMOUS, -1, 0)
                 : mmap((void*)(uintptr_t)va, size, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_SHARED, allocs[a].fd, 0);
  if (at == MAP_FAILED) return NV_ERR_NO_MEMORY;
  mappings[free_slot] = (Mapping){va, size, vs, (int)a, allocs[a].gpu};
  allocs[a].refs++;
  live_mappings++;
  return NV_OK;
}

static uint32_t do_map(int vs, void* p) {
  put(p, "VATTN_UVM_MAP_PARAMS.done", 0);
  uint64_t count = get(p, "VATTN_UVM_MAP_PARAMS.count");
  if (get(p, "VATTN_UVM_MAP_PARAMS.access") != ACCESS_READ_WRITE || count > MAX_BATCH) return NV_ERR_INVALID_ARGUMENT;
  if (count == 0) return NV_OK;
  size_t entry = field("VATTN_UVM_MAP_ENTRY")->size;
  const char* entries = (const char*)(uintptr_t)get(p, "VATTN_UVM_MAP_PARAMS.entries");
  if (!readable(entries, count * entry)) return NV_ERR_INVALID_ARGUMENT;
  for (uint64_t i = 0; i < count; ++i) {
    uint32_t status = NV_OK;
    int e = 0;
    injected("VATTN_UVM_MAP", &status, &e); /* per entry; errno injections were handled per call */
    if (status == NV_OK)
      status = map_one(vs, get(entries + i * entry, "VATTN_UVM_MAP_ENTRY.va"),
                       get(entries + i * entry, "VATTN_UVM_MAP_ENTRY.handle"));
    if (status != NV_OK) return status;
    put(p, "VATTN_UVM_MAP_PARAMS.done", i + 1);
  }
  return NV_OK;
}

static uint32_t unmap_one(int vs, int gpu, uint64_t va) {
  if (find_range(vs, va, 1) < 0) return NV_ERR_INVALID_ADDRESS;
  for (long m = 0; m < MAX_MAPPINGS; ++m) {
    if (mappings[m].size && mappings[m].va_space == vs && mappings[m].gpu == gpu && mappings[m].va == va) {
      unmap_at(m);
      return NV_OK;
    }
  }
  return NV_ERR_INVALID_ADDRESS;
}

static uint32_t do_unmap(int vs, void* p) {
  put(p, "VATTN_UVM_UNMAP_PARAMS.done", 0);
  uint64_t count = get(p, "VATTN_UVM_UNMAP_PARAMS.count");
  if (get(p, "VATTN_UVM_UNMAP_PARAMS.flags") || count > MAX_BATCH) return NV_ERR_INVALID_ARGUMENT;
  if (count == 0) return NV_OK;
  const char* addrs = (const char*)(uintptr_t)get(p, "VATTN_UVM_UNMAP_PARAMS.addrs");
  if (!readable(addrs, count * 8)) return NV_ERR_INVALID_ARGUMENT;
  int g = find_gpu(&va_spaces[vs], uuid_of(p, "VATTN_UVM_UNMAP_PARAMS.gpuUuid"));
  if (g < 0) return NV_ERR_INVALID_DEVICE;
  for (uint64_t i = 0; i < count; ++i) {
    uint32_t status = NV_OK;
    int e = 0;
    injected("VATTN_UVM_UNMAP", &status, &e); /* per entry; errno injections were handled per call */
    uint64_t va;
    memcpy(&va, addrs + i * 8, 8);
    if (status == NV_OK) status = unmap_one(vs, g, va);
    if (status != NV_OK) return status;
    put(p, "VATTN_UVM_UNMAP_PARAMS.done", i + 1);
  }
  return NV_OK;
}

static uint32_t do_release(int vs, void* p) {
  if (get(p, "VATTN_UVM_RELEASE_PARAMS.flags")) return NV_ERR_INVALID_ARGUMENT;
  long a = find_alloc(vs, get(p, "VATTN_UVM_RELEASE_PARAMS.handle"));
  if (a < 0) return NV_ERR_INVALID_OBJECT_HANDLE;
  allocs[a].in_table = 0;
  alloc_put(a);
  return NV_OK;
}

static uint32_t do_create_range(int vs, void* p) {
  uint64_t base = get(p, "RANGE_PARAMS.base"), length = get(p, "RANGE_PARAMS.length");
  if (!length || base % 4096 || length % 4096 || base + length < base) return NV_ERR_INVALID_ADDRESS;
  long free_slot = -1;
  for (long i = 0; i < MAX_RANGES; ++i) {
    if (!ranges[i].length) {
      if (free_slot < 0) free_slot = i;
      continue;
    }
    if (ranges[i].va_space == vs && base < ranges[i].base + ranges[i].length && ranges[i].base < base + length)
      return NV_ERR_UVM_ADDRESS_IN_USE;
  }
  if (free_slot < 0) return NV_ERR_NO_MEMORY;
  ranges[free_slot] = (Range){base, length, vs};
  live_ranges++;
  return NV_OK;
}

static uint32_t do_free(int vs, void* p) {
  uint64_t base = get(p, "RANGE_PARAMS.base");
  for (long i = 0; i < MAX_RANGES; ++i) {
    if (!ranges[i].length || ranges[i].va_space != vs || ranges[i].base != base) continue;
    for (long m = 0; m < MAX_MAPPINGS; ++m) /* UvmFree unmaps what is still mapped inside */
      if (mappings[m].size && mappings[m].va_space == vs && mappings[m].va >= base &&
          mappings[m].va < base + ranges[i].length)
        unmap_at(m);
    memset(&ranges[i], 0, sizeof(ranges[i]));
    live_ranges--;
    return NV_OK;
  }
  return NV_ERR_INVALID_ADDRESS;
}

static uint32_t do_register_gpu(int vs, void* p) {
  const uint8_t* uuid = uuid_of(p, "REGISTER_GPU_PARAMS.gpuUuid");
  VaSpace* v = &va_spaces[vs];
  if (find_gpu(v, uuid) >= 0) return NV_OK;
  if (v->num_gpus == MAX_GPUS) return NV_ERR_NO_MEMORY;
  memcpy(v->gpus[v->num_gpus].uuid, uuid, 16);
  v->gpus[v->num_gpus++].has_va_space = 0;
  return NV_OK;
}

static uint32_t do_register_gpu_va_space(int vs, void* p) {
  int g = find_gpu(&va_spaces[vs], uuid_of(p, "REGISTER_GPU_VASPACE_PARAMS.gpuUuid"));
  if (g < 0) return NV_ERR_INVALID_DEVICE;
  va_spaces[vs].gpus[g].has_va_space = 1;
  return NV_OK;
}

/* ---- dispatch --------------------------------------------------------------- */

static int (*real_ioctl)(int, unsigned long, ...) = NULL;

static int is_stand_in(int fd) {
  const char* dev = getenv("FAKE_UVM_DEVICE");
  if (!dev || !*dev || fd < 0) return 0;
  char want[PATH_MAX], link[64], target[PATH_MAX];
  if (!realpath(dev, want)) return 0;
  snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof(target) - 1);
  if (n <= 0) return 0;
  target[n] = '\0';
  return strcmp(want, target) == 0;
}

static const char* status_field(unsigned long cmd) {
  switch (cmd) {
    case CMD_INITIALIZE: return "INITIALIZE_PARAMS";
    case CMD_REGISTER_GPU: return "REGISTER_GPU_PARAMS";
    case CMD_REGISTER_GPU_VASPACE: return "REGISTER_GPU_VASPACE_PARAMS";
    case CMD_CREATE_EXTERNAL_RANGE:
    case CMD_FREE: return "RANGE_PARAMS";
    case CMD_VATTN_QUERY: return "VATTN_UVM_QUERY_PARAMS";
    case CMD_VATTN_CREATE: return "VATTN_UVM_CREATE_PARAMS";
    case CMD_VATTN_MAP: return "VATTN_UVM_MAP_PARAMS";
    case CMD_VATTN_UNMAP: return "VATTN_UVM_UNMAP_PARAMS";
    case CMD_VATTN_RELEASE: return "VATTN_UVM_RELEASE_PARAMS";
    default: return NULL;
  }
}

static const char* call_name(unsigned long cmd, int* counter) {
  switch (cmd) {
    case CMD_VATTN_QUERY: *counter = 0; return "VATTN_UVM_QUERY";
    case CMD_VATTN_CREATE: *counter = 1; return "VATTN_UVM_CREATE";
    case CMD_VATTN_MAP: *counter = 2; return "VATTN_UVM_MAP";
    case CMD_VATTN_UNMAP: *counter = 3; return "VATTN_UVM_UNMAP";
    case CMD_VATTN_RELEASE: *counter = 4; return "VATTN_UVM_RELEASE";
    case CMD_CREATE_EXTERNAL_RANGE: *counter = 5; return "UVM_CREATE_EXTERNAL_RANGE";
    case CMD_FREE: *counter = 6; return "UVM_FREE";
    default: *counter = 7; return "other";
  }
}

static int fake_ioctl(int fd, unsigned long cmd, void* p) {
  int is_vattn = cmd >= CMD_VATTN_QUERY && cmd <= CMD_VATTN_RELEASE;
  const char* params = status_field(cmd);
  if (!params || (is_vattn && env_u64("FAKE_UVM_STOCK", 0))) {
    errno = ENOSYS; /* the module's answer to a number it does not route */
    return -1;
  }
  if (!readable(p, field(params)->size)) {
    errno = EFAULT;
    return -1;
  }
  char status_name[96];
  snprintf(status_name, sizeof(status_name), "%s.rmStatus", params);

  pthread_mutex_lock(&mu);
  int counter;
  const char* call = call_name(cmd, &counter);
  calls[counter]++;
  off_t pos = lseek(fd, 0, SEEK_CUR);
  int vs = pos > 0 && pos <= num_va_spaces ? (int)pos : 0;
  uint32_t status = NV_OK;
  int err = 0;
  if (cmd == CMD_INITIALIZE) {
    if (!vs) {
      if (num_va_spaces == MAX_VA_SPACES) {
        status = NV_ERR_NO_MEMORY;
      } else {
        vs = ++num_va_spaces;
        va_spaces[vs].used = 1;
        lseek(fd, vs, SEEK_SET);
      }
    }
  } else if (!vs) {
    status = NV_ERR_ILLEGAL_ACTION; /* every call before UVM_INITIALIZE */
  } else if ((fail_errno || (cmd != CMD_VATTN_MAP && cmd != CMD_VATTN_UNMAP)) && injected(call, &status, &err)) {
    /* an injected failure of the whole call: status or errno */
  } else {
    switch (cmd) {
      case CMD_REGISTER_GPU: status = do_register_gpu(vs, p); break;
      case CMD_REGISTER_GPU_VASPACE: status = do_register_gpu_va_space(vs, p); break;
      case CMD_CREATE_EXTERNAL_RANGE: status = do_create_range(vs, p); break;
      case CMD_FREE: status = do_free(vs, p); break;
      case CMD_VATTN_QUERY: status = do_query(vs, p); break;
      case CMD_VATTN_CREATE: status = do_create(vs, p); break;
      case CMD_VATTN_MAP: status = do_map(vs, p); break;
      case CMD_VATTN_UNMAP: status = do_unmap(vs, p); break;
      case CMD_VATTN_RELEASE: status = do_release(vs, p); break;
    }
  }
  pthread_mutex_unlock(&mu);
  if (err) {
    errno = err;
    return -1;
  }
  put(p, status_name, status);
  return 0;
}

int ioctl(int fd, unsigned long request, ...) {
  va_list ap;
  va_start(ap, request);
  void* arg = va_arg(ap, void*);
  va_end(ap);
  if (is_stand_in(fd)) return fake_ioctl(fd, request, arg);
  if (!real_ioctl) real_ioctl = (int (*)(int, unsigned long, ...))dlsym(RTLD_NEXT, "ioctl");
  return real_ioctl(fd, request, arg);
}
