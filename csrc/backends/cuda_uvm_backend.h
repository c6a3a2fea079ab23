// The cuda_uvm backend: CUDA device memory in pages of 64 KiB, 128 KiB,
// 256 KiB or 2 MiB, from the nvidia-uvm module patched by driver_patch/
// (the stock driver maps 2 MiB at least). See cuda_uvm_backend.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/vmm_backend.h"

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
bool uvm_patch_available();

// NV_STATUS as text: "NV_ERR_NO_MEMORY (0x51)".
std::string uvm_status_name(uint32_t status);

// A cuda_uvm backend on `device` through the CUDA driver at `driver_path`.
// Throws BackendUnavailable when the driver, the device, the patched module
// or the CUDA context's UVM descriptor is missing, invalid_argument for a page
// size the module does not serve.
std::shared_ptr<VmmBackend> make_cuda_uvm_backend(const std::string& driver_path, int device,
                                                  size_t page_size, size_t num_pages);

}  // namespace vattn
