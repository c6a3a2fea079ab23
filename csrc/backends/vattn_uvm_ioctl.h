/* SPDX-License-Identifier: MIT */
/*
 * vattn_uvm_ioctl.h: the small-page ioctls that driver_patch/ adds to
 * NVIDIA's nvidia-uvm module (open-gpu-kernel-modules 580.142).
 *
 * One source of truth: this file lives with vattn's C++ backend that
 * includes it (csrc/backends/cuda_uvm_backend.cpp) and is copied verbatim into
 * the module tree by the first patch of the series (kernel-open/nvidia-uvm/).
 * It compiles as kernel C (gnu11), user C (C11 and later) and C++ (C++11 and
 * later); every struct has fixed-width fields, explicit padding, and size and
 * offset asserts, so 32-bit and 64-bit callers and the kernel agree.
 *
 * Like every nvidia-uvm ioctl, these take a plain command number (not _IOWR)
 * and a pointer to a params struct; ioctl() itself returns 0 when the module
 * ran the command, and the outcome is the NV_STATUS in rmStatus. A module
 * without the patch answers these numbers with -1 and errno ENOSYS (or EINVAL
 * when it was loaded with uvm_enable_builtin_tests=1).
 *
 * The calls act on the UVM VA space of the file descriptor they are issued on:
 * the CUDA driver's own /dev/nvidia-uvm descriptor when pages must appear in a
 * CUDA context (that VA space holds the context's GPU page tables). A fresh
 * descriptor after UVM_INITIALIZE answers VATTN_UVM_QUERY, which is how a
 * caller detects the patch.
 *
 *   QUERY    ABI version, page sizes, and whether a GPU (by UUID) is registered
 *            with a GPU VA space in this VA space and a VA range lies inside one
 *            external range (UvmCreateExternalRange, as cuMemAddressReserve makes).
 *   CREATE   one physical allocation of pageSize bytes (64 KiB, 128 KiB,
 *            256 KiB or 2 MiB) in the GPU's memory, zeroed; returns a handle.
 *   MAP      maps whole allocations at VAs inside external ranges of this VA
 *            space, read-write for the owning GPU (cuMemMap + cuMemSetAccess);
 *            batched, in order, stops at the first failure and reports `done`.
 *   UNMAP    removes whole mappings made by MAP (cuMemUnmap); batched, `done`.
 *   RELEASE  drops the handle (cuMemRelease): the memory is freed when its last
 *            mapping goes.
 */
#ifndef VATTN_UVM_IOCTL_H
#define VATTN_UVM_IOCTL_H

#if defined(__KERNEL__)
#include <linux/types.h>
#include <linux/stddef.h>
#elif defined(__cplusplus)
#include <cstddef>
#include <cstdint>
#else
#include <stddef.h>
#include <stdint.h>
#endif

#if defined(__cplusplus)
#define VATTN_UVM_STATIC_ASSERT(expr, msg) static_assert(expr, msg)
#else
#define VATTN_UVM_STATIC_ASSERT(expr, msg) _Static_assert(expr, msg)
#endif

/* Bumped whenever a struct or a meaning below changes. */
#define VATTN_UVM_ABI_VERSION 1u

/* Command numbers: clear of nvidia-uvm's own (1..80, the test ioctls at
 * 200..~300, UVM_INITIALIZE = 0x30000001, UVM_DEINITIALIZE = 0x30000002). */
#define VATTN_UVM_IOCTL_BASE 0x30564100u
#define VATTN_UVM_QUERY      (VATTN_UVM_IOCTL_BASE + 1u)
#define VATTN_UVM_CREATE     (VATTN_UVM_IOCTL_BASE + 2u)
#define VATTN_UVM_MAP        (VATTN_UVM_IOCTL_BASE + 3u)
#define VATTN_UVM_UNMAP      (VATTN_UVM_IOCTL_BASE + 4u)
#define VATTN_UVM_RELEASE    (VATTN_UVM_IOCTL_BASE + 5u)

/* Page sizes (bytes) CREATE accepts; QUERY reports the subset a GPU supports
 * as a bit mask of these values. */
#define VATTN_UVM_PAGE_SIZE_64K  0x10000ull
#define VATTN_UVM_PAGE_SIZE_128K 0x20000ull
#define VATTN_UVM_PAGE_SIZE_256K 0x40000ull
#define VATTN_UVM_PAGE_SIZE_2M   0x200000ull
#define VATTN_UVM_PAGE_SIZES_ALL                                                      \
    (VATTN_UVM_PAGE_SIZE_64K | VATTN_UVM_PAGE_SIZE_128K | VATTN_UVM_PAGE_SIZE_256K | \
     VATTN_UVM_PAGE_SIZE_2M)

/* Most entries one MAP or UNMAP call takes. */
#define VATTN_UVM_MAX_BATCH 4096u

/* MAP access: the value of CU_MEM_ACCESS_FLAGS_PROT_READWRITE. The only one
 * accepted today; mappings are read-write-atomic for the owning GPU. */
#define VATTN_UVM_ACCESS_READ_WRITE 3u

/* QUERY flags (OUT). */
#define VATTN_UVM_QUERY_GPU_REGISTERED   0x1u /* gpuUuid is registered in this VA space */
#define VATTN_UVM_QUERY_GPU_VA_SPACE     0x2u /* ... with a GPU VA space (its page tables) */
#define VATTN_UVM_QUERY_RANGE_EXTERNAL   0x4u /* [rangeBase, +rangeLength) lies in one external range */

/* The NV_STATUS values (nvstatuscodes.h) these ioctls return. The patched
 * module checks at build time that each equals its NV_ERR_* counterpart. */
#define VATTN_UVM_STATUS_OK                      0x00000000u /* NV_OK */
#define VATTN_UVM_STATUS_ILLEGAL_ACTION          0x00000016u /* fd not initialised (UVM_INITIALIZE) */
#define VATTN_UVM_STATUS_INVALID_ADDRESS         0x0000001Eu /* VA outside an external range, misaligned, or not a MAP mapping */
#define VATTN_UVM_STATUS_INVALID_ARGUMENT        0x0000001Fu /* page size, flags, access, count, or an unreadable array */
#define VATTN_UVM_STATUS_INVALID_DEVICE          0x00000026u /* GPU not registered, or no GPU VA space */
#define VATTN_UVM_STATUS_INVALID_OBJECT_HANDLE   0x00000033u /* handle unknown in this VA space */
#define VATTN_UVM_STATUS_NO_MEMORY               0x00000051u /* GPU memory, page tables or host memory ran out */
#define VATTN_UVM_STATUS_NOT_SUPPORTED           0x00000056u /* confidential computing or SR-IOV heavy mode */
#define VATTN_UVM_STATUS_OUT_OF_RANGE            0x0000005Bu /* VA beyond what the GPU can address */
#define VATTN_UVM_STATUS_UVM_ADDRESS_IN_USE      0x00000068u /* MAP over a mapping of memory (sparse ones are replaced) */

/* VATTN_UVM_QUERY. Works on any initialised fd; gpuUuid all zero and
 * rangeLength 0 skip those checks. */
typedef struct
{
    uint8_t  gpuUuid[16];  /* IN   GPU UUID (cuDeviceGetUuid bytes) or zero */
    uint64_t rangeBase;    /* IN   VA range to look up, or 0 */
    uint64_t rangeLength;  /* IN   bytes, or 0 */
    uint64_t pageSizes;    /* OUT  mask of VATTN_UVM_PAGE_SIZE_* the GPU supports */
    uint32_t abiVersion;   /* OUT  VATTN_UVM_ABI_VERSION of the module */
    uint32_t flags;        /* OUT  VATTN_UVM_QUERY_* */
    uint32_t rmStatus;     /* OUT  NV_STATUS */
    uint32_t pad0;         /*      zero */
} VATTN_UVM_QUERY_PARAMS;

/* VATTN_UVM_CREATE. */
typedef struct
{
    uint8_t  gpuUuid[16];  /* IN   GPU whose memory backs the allocation */
    uint64_t pageSize;     /* IN   one of VATTN_UVM_PAGE_SIZE_* */
    uint64_t handle;       /* OUT  nonzero on success, unique in this VA space */
    uint32_t flags;        /* IN   zero */
    uint32_t rmStatus;     /* OUT  NV_STATUS */
} VATTN_UVM_CREATE_PARAMS;

/* One MAP entry: the whole allocation `handle` at `va` (aligned to its size). */
typedef struct
{
    uint64_t va;
    uint64_t handle;
} VATTN_UVM_MAP_ENTRY;

/* VATTN_UVM_MAP. Entries [0, done) are mapped when it returns; on failure
 * rmStatus is the error of entry `done` and entries [done, count) are not. */
typedef struct
{
    uint64_t entries;   /* IN   user pointer to VATTN_UVM_MAP_ENTRY[count] */
    uint64_t count;     /* IN   0 .. VATTN_UVM_MAX_BATCH */
    uint64_t done;      /* OUT  leading entries now mapped */
    uint32_t access;    /* IN   VATTN_UVM_ACCESS_READ_WRITE */
    uint32_t rmStatus;  /* OUT  NV_STATUS */
} VATTN_UVM_MAP_PARAMS;

/* VATTN_UVM_UNMAP. Each address is the `va` of an earlier MAP entry on gpuUuid;
 * entries [0, done) are unmapped when it returns, [done, count) still mapped. */
typedef struct
{
    uint8_t  gpuUuid[16];  /* IN   GPU the mappings were made for */
    uint64_t addrs;        /* IN   user pointer to uint64_t[count] */
    uint64_t count;        /* IN   0 .. VATTN_UVM_MAX_BATCH */
    uint64_t done;         /* OUT  leading entries now unmapped */
    uint32_t flags;        /* IN   zero */
    uint32_t rmStatus;     /* OUT  NV_STATUS */
} VATTN_UVM_UNMAP_PARAMS;

/* VATTN_UVM_RELEASE. */
typedef struct
{
    uint64_t handle;    /* IN   from CREATE */
    uint32_t flags;     /* IN   zero */
    uint32_t rmStatus;  /* OUT  NV_STATUS */
} VATTN_UVM_RELEASE_PARAMS;

VATTN_UVM_STATIC_ASSERT(sizeof(VATTN_UVM_QUERY_PARAMS) == 56, "QUERY params layout");
VATTN_UVM_STATIC_ASSERT(offsetof(VATTN_UVM_QUERY_PARAMS, rangeBase) == 16, "QUERY rangeBase");
VATTN_UVM_STATIC_ASSERT(offsetof(VATTN_UVM_QUERY_PARAMS, pageSizes) == 32, "QUERY pageSizes");
VATTN_UVM_STATIC_ASSERT(offsetof(VATTN_UVM_QUERY_PARAMS, abiVersion) == 40, "QUERY abiVersion");
VATTN_UVM_STATIC_ASSERT(offsetof(VATTN_UVM_QUERY_PARAMS, rmStatus) == 48, "QUERY rmStatus");
VATTN_UVM_STATIC_ASSERT(sizeof(VATTN_UVM_CREATE_PARAMS) == 40, "CREATE params layout");
VATTN_UVM_STATIC_ASSERT(offsetof(VATTN_UVM_CREATE_PARAMS, pageSize) == 16, "CREATE pageSize");
VATTN_UVM_STATIC_ASSERT(offsetof(VATTN_UVM_CREATE_PARAMS, handle) == 24, "CREATE handle");
VATTN_UVM_STATIC_ASSERT(offsetof(VATTN_UVM_CREATE_PARAMS, rmStatus) == 36, "CREATE rmStatus");
VATTN_UVM_STATIC_ASSERT(sizeof(VATTN_UVM_MAP_ENTRY) == 16, "MAP entry layout");
VATTN_UVM_STATIC_ASSERT(sizeof(VATTN_UVM_MAP_PARAMS) == 32, "MAP params layout");
VATTN_UVM_STATIC_ASSERT(offsetof(VATTN_UVM_MAP_PARAMS, done) == 16, "MAP done");
VATTN_UVM_STATIC_ASSERT(offsetof(VATTN_UVM_MAP_PARAMS, access) == 24, "MAP access");
VATTN_UVM_STATIC_ASSERT(offsetof(VATTN_UVM_MAP_PARAMS, rmStatus) == 28, "MAP rmStatus");
VATTN_UVM_STATIC_ASSERT(sizeof(VATTN_UVM_UNMAP_PARAMS) == 48, "UNMAP params layout");
VATTN_UVM_STATIC_ASSERT(offsetof(VATTN_UVM_UNMAP_PARAMS, addrs) == 16, "UNMAP addrs");
VATTN_UVM_STATIC_ASSERT(offsetof(VATTN_UVM_UNMAP_PARAMS, done) == 32, "UNMAP done");
VATTN_UVM_STATIC_ASSERT(offsetof(VATTN_UVM_UNMAP_PARAMS, rmStatus) == 44, "UNMAP rmStatus");
VATTN_UVM_STATIC_ASSERT(sizeof(VATTN_UVM_RELEASE_PARAMS) == 16, "RELEASE params layout");
VATTN_UVM_STATIC_ASSERT(offsetof(VATTN_UVM_RELEASE_PARAMS, rmStatus) == 12, "RELEASE rmStatus");

#endif /* VATTN_UVM_IOCTL_H */
