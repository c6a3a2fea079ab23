// The handful of CUDA driver types and entry points vattn uses, declared by
// hand so the extension builds without the CUDA toolkit. The library is
// dlopen()ed at run time, so the extension imports on machines with no GPU or
// driver. The layouts, values and prototypes follow cuda.h; the test
// tests/backends/test_cuda_header_abi.py compiles tests/backends/cuda_header_check.cpp, which
// checks every declaration here against the real cuda.h of CUDA 12 and 13
// (sizes, offsets, enum values, and each function pointer against the real
// prototype of the symbol it is bound to).
#pragma once

#include <cstddef>
#include <mutex>
#include <string>

namespace vattn {
namespace cu {

// Opaque handle types, declared here (not looked up) so they stay ours even
// where cuda.h is also included.
struct CUctx_st;
struct CUstream_st;
struct CUevent_st;

using CUresult = int;
using CUdevice = int;
using CUcontext = CUctx_st*;
using CUstream = CUstream_st*;
using CUevent = CUevent_st*;
using CUdeviceptr = unsigned long long;
using CUmemGenericAllocationHandle = unsigned long long;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;

constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 1;
constexpr int CU_MEM_HANDLE_TYPE_NONE = 0;
constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 1;
constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3;
constexpr int CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0;
constexpr unsigned int CU_EVENT_DISABLE_TIMING = 2;

struct CUmemLocation {
  int type;
  int id;
};

struct CUmemAllocationProp {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};

struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;
};

// A device's UUID, as cuDeviceGetUuid(_v2) writes it (looked up on its own by
// the cuda_uvm backend: not every driver exports the _v2 form).
struct CUuuid {
  char bytes[16];
};
using GetUuidFn = CUresult(CUuuid*, CUdevice);

// Every entry point: X(member, exported symbol, function type). The symbol is
// what cuda.h's macros resolve the plain name to (cuMemGetInfo ->
// cuMemGetInfo_v2, ...), with the legacy default-stream semantics for stream
// 0 (not the _ptsz per-thread variants).
#define VATTN_CU_FUNCTIONS(X)                                                                          \
  X(cuInit, cuInit, CUresult(unsigned int))                                                            \
  X(cuDriverGetVersion, cuDriverGetVersion, CUresult(int*))                                            \
  X(cuDeviceGetCount, cuDeviceGetCount, CUresult(int*))                                                \
  X(cuDeviceGet, cuDeviceGet, CUresult(CUdevice*, int))                                                \
  X(cuDeviceGetName, cuDeviceGetName, CUresult(char*, int, CUdevice))                                  \
  X(cuDeviceTotalMem, cuDeviceTotalMem_v2, CUresult(size_t*, CUdevice))                                \
  X(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, CUresult(CUcontext*, CUdevice))                \
  X(cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2, CUresult(CUdevice))                       \
  X(cuDevicePrimaryCtxGetState, cuDevicePrimaryCtxGetState, CUresult(CUdevice, unsigned int*, int*))   \
  X(cuCtxGetCurrent, cuCtxGetCurrent, CUresult(CUcontext*))                                            \
  X(cuCtxPushCurrent, cuCtxPushCurrent_v2, CUresult(CUcontext))                                        \
  X(cuCtxPopCurrent, cuCtxPopCurrent_v2, CUresult(CUcontext*))                                         \
  X(cuCtxSynchronize, cuCtxSynchronize, CUresult())                                                    \
  X(cuStreamSynchronize, cuStreamSynchronize, CUresult(CUstream))                                      \
  X(cuEventCreate, cuEventCreate, CUresult(CUevent*, unsigned int))                                    \
  X(cuEventRecord, cuEventRecord, CUresult(CUevent, CUstream))                                         \
  X(cuEventSynchronize, cuEventSynchronize, CUresult(CUevent))                                         \
  X(cuEventQuery, cuEventQuery, CUresult(CUevent))                                                     \
  X(cuEventDestroy, cuEventDestroy_v2, CUresult(CUevent))                                              \
  X(cuMemGetInfo, cuMemGetInfo_v2, CUresult(size_t*, size_t*))                                        \
  X(cuMemGetAllocationGranularity, cuMemGetAllocationGranularity,                                      \
    CUresult(size_t*, const CUmemAllocationProp*, int))                                                \
  X(cuMemAddressReserve, cuMemAddressReserve,                                                          \
    CUresult(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long))                           \
  X(cuMemAddressFree, cuMemAddressFree, CUresult(CUdeviceptr, size_t))                                 \
  X(cuMemCreate, cuMemCreate,                                                                          \
    CUresult(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long))   \
  X(cuMemRelease, cuMemRelease, CUresult(CUmemGenericAllocationHandle))                                \
  X(cuMemMap, cuMemMap,                                                                                \
    CUresult(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))           \
  X(cuMemUnmap, cuMemUnmap, CUresult(CUdeviceptr, size_t))                                             \
  X(cuMemSetAccess, cuMemSetAccess, CUresult(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t))     \
  X(cuMemcpyDtoD, cuMemcpyDtoD_v2, CUresult(CUdeviceptr, CUdeviceptr, size_t))                         \
  X(cuGetErrorName, cuGetErrorName, CUresult(CUresult, const char**))

template <class Fn>
using FnPtr = Fn*;

// Function table filled by dlsym. One table per library path, shared by every
// backend that uses that path (the real driver, or a test driver).
struct DriverApi {
  std::string path;
  void* handle = nullptr;
#define VATTN_CU_MEMBER(member, symbol, fn_type) FnPtr<fn_type> member = nullptr;
  VATTN_CU_FUNCTIONS(VATTN_CU_MEMBER)
#undef VATTN_CU_MEMBER
};

// Path of the driver library: $VATTN_CUDA_DRIVER_LIB when set (a test driver),
// else "libcuda.so.1".
std::string default_driver_path();

// Loads (once per path) and returns the function table; throws
// BackendUnavailable when the library or a symbol is missing, or cuInit fails.
const DriverApi& load_driver(const std::string& path);

// "CUDA_ERROR_OUT_OF_MEMORY (2)" style text for an error code.
std::string error_name(const DriverApi& api, CUresult code);

}  // namespace cu
}  // namespace vattn
