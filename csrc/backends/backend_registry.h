// Backends by name, so that a backend is one source file: the file registers
// its factory (VATTN_REGISTER_BACKEND) and the bindings build any registered
// backend through one entry point (vattn._C.make_backend). The Python side
// names the backend in its registry (vattn/backends/registry.py), with its
// defaults and the devices it serves.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "backends/vmm_backend.h"

namespace vattn {

// What a factory gets: the backend resolved for one cache.
struct BackendParams {
  int device_index = 0;     // the device of its kind ("cuda:1" -> 1; the host has 0 only)
  size_t page_size = 0;     // bytes per physical page
  size_t num_pages = 0;     // pages in the physical pool
  std::string driver_path;  // the driver library to load, for backends that load one ("": their default)
};

using BackendFactory = std::shared_ptr<VmmBackend> (*)(const BackendParams& params);

// Adds `make` under `name` (at static initialisation; see the macro). Returns
// true so it can initialise a static; a second factory under one name is a
// programming error and aborts the registration with logic_error.
bool register_backend_factory(const char* name, BackendFactory make);

// Builds the backend registered as `name`; invalid_argument for an unknown name.
std::shared_ptr<VmmBackend> make_backend(const std::string& name, const BackendParams& params);

// Every registered name, sorted.
std::vector<std::string> backend_factory_names();

}  // namespace vattn

// In a backend's source file, at namespace scope:
//   VATTN_REGISTER_BACKEND(host, make_host_from_params);
#define VATTN_REGISTER_BACKEND(name, factory) \
  static const bool vattn_backend_registered_##name = ::vattn::register_backend_factory(#name, factory)
