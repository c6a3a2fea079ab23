// The cuda backend: the CUDA driver's VMM API (see cuda_backend.cpp). It is
// built through the registry (backend_registry.h, name "cuda"); this header
// holds what the Python layer asks of the device before it builds one.
#pragma once

#include <cstddef>
#include <string>

namespace vattn {

// Device facts the Python layer needs before it builds a backend.
struct CudaDeviceInfo {
  int device_count = 0;
  int driver_version = 0;
  std::string name;
  size_t granularity = 0;  // bytes
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  bool primary_context_active = false;  // before the query (someone held the primary context)
};
CudaDeviceInfo cuda_device_info(const std::string& driver_path, int device);

}  // namespace vattn
