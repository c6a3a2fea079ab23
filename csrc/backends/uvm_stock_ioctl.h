/* SPDX-License-Identifier: MIT */
/*
 * uvm_stock_ioctl.h: the few stock nvidia-uvm ioctls that vattn's cuda_uvm
 * backend (and the CUDA driver, whose calls the test stand-in imitates) issue
 * besides the VATTN_UVM_* ones, declared by hand because user space has no
 * NVIDIA headers. Not part of the patch series: check.sh compiles these
 * declarations next to the module's own uvm_linux_ioctl.h and fails when a
 * number, a size or an offset differs.
 *
 * Layouts: NvU64 fields are 8-byte aligned (NV_ALIGN_BYTES(8)), NV_STATUS,
 * NvS32 and NvHandle are 32-bit, NvBool is 8-bit, NvProcessorUuid is 16 bytes.
 */
#ifndef VATTN_UVM_STOCK_IOCTL_H
#define VATTN_UVM_STOCK_IOCTL_H

#if defined(__cplusplus)
#include <cstddef>
#include <cstdint>
#define VATTN_STOCK_STATIC_ASSERT(expr, msg) static_assert(expr, msg)
#else
#include <stddef.h>
#include <stdint.h>
#define VATTN_STOCK_STATIC_ASSERT(expr, msg) _Static_assert(expr, msg)
#endif

#define VATTN_STOCK_UVM_INITIALIZE            0x30000001u /* first call on a new descriptor */
#define VATTN_STOCK_UVM_REGISTER_GPU_VASPACE  25u
#define VATTN_STOCK_UVM_FREE                  34u
#define VATTN_STOCK_UVM_REGISTER_GPU          37u
#define VATTN_STOCK_UVM_CREATE_EXTERNAL_RANGE 73u

typedef struct
{
    uint64_t flags;     /* IN */
    uint32_t rmStatus;  /* OUT */
    uint32_t pad0;
} VATTN_STOCK_UVM_INITIALIZE_PARAMS;

/* UVM_CREATE_EXTERNAL_RANGE_PARAMS and UVM_FREE_PARAMS share this layout. */
typedef struct
{
    uint64_t base;      /* IN */
    uint64_t length;    /* IN */
    uint32_t rmStatus;  /* OUT */
    uint32_t pad0;
} VATTN_STOCK_UVM_RANGE_PARAMS;

typedef struct
{
    uint8_t  gpuUuid[16];  /* IN/OUT */
    uint8_t  numaEnabled;  /* OUT */
    uint8_t  pad0[3];
    int32_t  numaNodeId;   /* OUT */
    int32_t  rmCtrlFd;     /* IN */
    uint32_t hClient;      /* IN */
    uint32_t hSmcPartRef;  /* IN */
    uint32_t rmStatus;     /* OUT */
} VATTN_STOCK_UVM_REGISTER_GPU_PARAMS;

typedef struct
{
    uint8_t  gpuUuid[16];  /* IN */
    int32_t  rmCtrlFd;     /* IN */
    uint32_t hClient;      /* IN */
    uint32_t hVaSpace;     /* IN */
    uint32_t rmStatus;     /* OUT */
} VATTN_STOCK_UVM_REGISTER_GPU_VASPACE_PARAMS;

VATTN_STOCK_STATIC_ASSERT(sizeof(VATTN_STOCK_UVM_INITIALIZE_PARAMS) == 16, "UVM_INITIALIZE params");
VATTN_STOCK_STATIC_ASSERT(offsetof(VATTN_STOCK_UVM_INITIALIZE_PARAMS, rmStatus) == 8, "UVM_INITIALIZE rmStatus");
VATTN_STOCK_STATIC_ASSERT(sizeof(VATTN_STOCK_UVM_RANGE_PARAMS) == 24, "UVM_FREE params");
VATTN_STOCK_STATIC_ASSERT(offsetof(VATTN_STOCK_UVM_RANGE_PARAMS, rmStatus) == 16, "UVM_FREE rmStatus");
VATTN_STOCK_STATIC_ASSERT(sizeof(VATTN_STOCK_UVM_REGISTER_GPU_PARAMS) == 40, "UVM_REGISTER_GPU params");
VATTN_STOCK_STATIC_ASSERT(offsetof(VATTN_STOCK_UVM_REGISTER_GPU_PARAMS, rmStatus) == 36, "UVM_REGISTER_GPU rmStatus");
VATTN_STOCK_STATIC_ASSERT(sizeof(VATTN_STOCK_UVM_REGISTER_GPU_VASPACE_PARAMS) == 32, "UVM_REGISTER_GPU_VASPACE params");
VATTN_STOCK_STATIC_ASSERT(offsetof(VATTN_STOCK_UVM_REGISTER_GPU_VASPACE_PARAMS, rmStatus) == 28,
                          "UVM_REGISTER_GPU_VASPACE rmStatus");

#endif /* VATTN_UVM_STOCK_IOCTL_H */
