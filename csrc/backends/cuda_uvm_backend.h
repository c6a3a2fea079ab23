// The cuda_uvm backend: CUDA device memory in pages of 64 KiB, 128 KiB,
// 256 KiB or 2 MiB, from the nvidia-uvm module patched by driver_patch/
// (the stock driver maps 2 MiB at least). See cuda_uvm_backend.cpp. The
// backend and its probes are reached through the registry
// (backend_registry.h, name "cuda_uvm"); this header declares what they
// answer from, for cuda_uvm_backend.cpp alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace vattn {

// Page sizes (bytes) the patched module serves.
const std::vector<size_t>& uvm_page_sizes();

// $VATTN_UVM_DEVICE when set (tests point it at a stand-in), else /dev/nvidia-uvm.
std::string uvm_device_path();

// What the nvidia-uvm module behind uvm_device_path() answers: a fresh
// descriptor is opened, initialised (UVM_INITIALIZE) and asked VATTN_UVM_QUERY.
// Needs no GPU and no CUDA context.
struct UvmPatchInfo {
  bool available = false;    // the module answers VATTN_UVM_QUERY with our ABI
  std::string device_path;
  uint32_t abi_version = 0;  // the module's, when it answered
  std::string reason;        // why not available
};
UvmPatchInfo uvm_patch_info();

// NV_STATUS as text: "NV_ERR_NO_MEMORY (0x51)".
std::string uvm_status_name(uint32_t status);

}  // namespace vattn
