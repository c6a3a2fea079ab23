// Compile-only check of csrc/backends/cuda_driver.h against NVIDIA's cuda.h.
// Built by tests/backends/test_cuda_header_abi.py with -fsyntax-only and the include
// folder of a CUDA 12 or 13 wheel; it never runs. Our declarations live in
// vattn::cu, the real ones in the global namespace, so both are visible here.
#include <cuda.h>

#include <cstddef>
#include <type_traits>

#include "backends/cuda_driver.h"

#if !defined(CUDA_VERSION) || CUDA_VERSION < 11020
#error "cuda.h older than CUDA 11.2 (the VMM API vattn uses)"
#endif

namespace ours = vattn::cu;

// ---- scalar types and handles ------------------------------------------------------

static_assert(sizeof(ours::CUresult) == sizeof(::CUresult), "CUresult size");
static_assert(std::is_same_v<ours::CUdevice, ::CUdevice>, "CUdevice is int");
static_assert(std::is_same_v<ours::CUdeviceptr, ::CUdeviceptr>, "CUdeviceptr is unsigned long long");
static_assert(std::is_same_v<ours::CUmemGenericAllocationHandle, ::CUmemGenericAllocationHandle>,
              "CUmemGenericAllocationHandle is unsigned long long");
static_assert(sizeof(ours::CUcontext) == sizeof(::CUcontext), "CUcontext is a pointer");
static_assert(sizeof(ours::CUstream) == sizeof(::CUstream), "CUstream is a pointer");
static_assert(sizeof(ours::CUevent) == sizeof(::CUevent), "CUevent is a pointer");

// ---- enum values -------------------------------------------------------------------

static_assert(ours::CUDA_SUCCESS == ::CUDA_SUCCESS, "CUDA_SUCCESS");
static_assert(ours::CUDA_ERROR_INVALID_VALUE == ::CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE");
static_assert(ours::CUDA_ERROR_OUT_OF_MEMORY == ::CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY");
static_assert(ours::CUDA_ERROR_NOT_READY == ::CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY");
static_assert(ours::CU_MEM_ALLOCATION_TYPE_PINNED == ::CU_MEM_ALLOCATION_TYPE_PINNED, "allocation type");
static_assert(ours::CU_MEM_HANDLE_TYPE_NONE == ::CU_MEM_HANDLE_TYPE_NONE, "handle type");
static_assert(ours::CU_MEM_LOCATION_TYPE_DEVICE == ::CU_MEM_LOCATION_TYPE_DEVICE, "location type");
static_assert(ours::CU_MEM_ACCESS_FLAGS_PROT_READWRITE == ::CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "access flags");
static_assert(ours::CU_MEM_ALLOC_GRANULARITY_MINIMUM == ::CU_MEM_ALLOC_GRANULARITY_MINIMUM, "granularity flag");
static_assert(ours::CU_EVENT_DISABLE_TIMING == ::CU_EVENT_DISABLE_TIMING, "event flag");
// The enums we declare as int must be int-sized.
static_assert(sizeof(::CUmemAllocationType) == sizeof(int), "CUmemAllocationType size");
static_assert(sizeof(::CUmemAllocationHandleType) == sizeof(int), "CUmemAllocationHandleType size");
static_assert(sizeof(::CUmemLocationType) == sizeof(int), "CUmemLocationType size");
static_assert(sizeof(::CUmemAccess_flags) == sizeof(int), "CUmemAccess_flags size");
static_assert(sizeof(::CUmemAllocationGranularity_flags) == sizeof(int), "granularity flags size");

// ---- struct layouts ----------------------------------------------------------------

#define SAME_FIELD(T, field)                                                          \
  static_assert(offsetof(ours::T, field) == offsetof(::T, field), #T "." #field " offset"); \
  static_assert(sizeof(ours::T::field) == sizeof(::T::field), #T "." #field " size")
#define SAME_STRUCT(T)                                          \
  static_assert(sizeof(ours::T) == sizeof(::T), #T " size");   \
  static_assert(alignof(ours::T) == alignof(::T), #T " alignment")

SAME_STRUCT(CUmemLocation);
SAME_FIELD(CUmemLocation, type);
SAME_FIELD(CUmemLocation, id);

SAME_STRUCT(CUmemAllocationProp);
SAME_FIELD(CUmemAllocationProp, type);
SAME_FIELD(CUmemAllocationProp, requestedHandleTypes);
SAME_FIELD(CUmemAllocationProp, location);
SAME_FIELD(CUmemAllocationProp, win32HandleMetaData);
SAME_FIELD(CUmemAllocationProp, allocFlags);
static_assert(offsetof(ours::CUmemAllocationProp, allocFlags.compressionType) ==
              offsetof(::CUmemAllocationProp, allocFlags.compressionType), "allocFlags.compressionType");
static_assert(offsetof(ours::CUmemAllocationProp, allocFlags.gpuDirectRDMACapable) ==
              offsetof(::CUmemAllocationProp, allocFlags.gpuDirectRDMACapable), "allocFlags.gpuDirectRDMACapable");
static_assert(offsetof(ours::CUmemAllocationProp, allocFlags.usage) ==
              offsetof(::CUmemAllocationProp, allocFlags.usage), "allocFlags.usage");
static_assert(offsetof(ours::CUmemAllocationProp, allocFlags.reserved) ==
              offsetof(::CUmemAllocationProp, allocFlags.reserved), "allocFlags.reserved");

SAME_STRUCT(CUmemAccessDesc);
SAME_FIELD(CUmemAccessDesc, location);
SAME_FIELD(CUmemAccessDesc, flags);

SAME_STRUCT(CUuuid);
SAME_FIELD(CUuuid, bytes);

// ---- function pointers -------------------------------------------------------------
//
// Ours<T> is the type our header uses where cuda.h uses T: enums become int,
// cuda.h's structs and opaque handles become ours, everything else stays.
// Each DriverApi member must then have exactly the real prototype of the
// symbol it is bound to (which also proves that symbol is declared).

template <class T, class = void>
struct Ours {
  using type = T;
};
template <class T>
struct Ours<T, std::enable_if_t<std::is_enum_v<T>>> {
  static_assert(sizeof(T) == sizeof(int), "an enum passed as int must be int-sized");
  using type = int;
};
template <> struct Ours<::CUctx_st> { using type = ours::CUctx_st; };
template <> struct Ours<::CUstream_st> { using type = ours::CUstream_st; };
template <> struct Ours<::CUevent_st> { using type = ours::CUevent_st; };
template <> struct Ours<::CUmemAllocationProp> { using type = ours::CUmemAllocationProp; };
template <> struct Ours<::CUmemAccessDesc> { using type = ours::CUmemAccessDesc; };
template <> struct Ours<::CUuuid> { using type = ours::CUuuid; };
template <class T> struct Ours<T*> { using type = typename Ours<T>::type*; };
template <class T> struct Ours<const T> { using type = const typename Ours<T>::type; };
template <class R, class... A> struct Ours<R(A...)> {
  using type = typename Ours<R>::type(typename Ours<A>::type...);
};

#define SAME_PROTOTYPE(member, symbol, fn_type)                                                        \
  static_assert(std::is_same_v<Ours<decltype(::symbol)>::type,                                      \
                               std::remove_pointer_t<decltype(ours::DriverApi::member)>>,          \
                "DriverApi::" #member " does not match the prototype of " #symbol " in cuda.h");
VATTN_CU_FUNCTIONS(SAME_PROTOTYPE)
// Looked up by name (dlsym) by the cuda_uvm backend, outside DriverApi.
static_assert(std::is_same_v<Ours<decltype(::cuDeviceGetUuid_v2)>::type, ours::GetUuidFn>, "cuDeviceGetUuid_v2");
static_assert(std::is_same_v<Ours<decltype(::cuDeviceGetUuid)>::type, ours::GetUuidFn>, "cuDeviceGetUuid");

int main() { return 0; }
