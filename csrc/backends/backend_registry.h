// Backends by name, so that a backend is one source file: the file registers
// its factory and its probes (VATTN_REGISTER_BACKEND), and the bindings build
// any registered backend and answer any registered probe through two generic
// entry points (vattn._C.make_backend, vattn._C.backend_probe), naming no
// backend. The Python side names the backend in its registry
// (vattn/backends/registry.py), with its defaults and the devices it serves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
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

// A probe is a question a backend answers before any cache exists (device
// facts, driver state, what this build speaks). It takes and returns plain
// key/value data, which crosses to Python as keyword arguments and a dict.
using ProbeValue = std::variant<bool, int64_t, double, std::string, std::vector<int64_t>>;
using ProbeData = std::vector<std::pair<std::string, ProbeValue>>;  // in order; keys unique
using ProbeFn = ProbeData (*)(const ProbeData& args);

struct BackendProbe {
  std::string name;               // e.g. "device_info"
  ProbeFn run = nullptr;          // may block (driver calls): callers release the GIL
  std::string doc;                // one line: what it answers, with units
  std::vector<std::string> args;  // the argument names it reads (all optional); others are refused
};

// Adds `make` and its probes under `name` (at static initialisation; see the
// macro). Returns true so it can initialise a static; a second registration
// under one name, or two probes of one name, is a programming error and
// aborts the registration with logic_error.
bool register_backend_factory(const char* name, BackendFactory make, std::vector<BackendProbe> probes = {});

// Builds the backend registered as `name`; invalid_argument for an unknown name.
std::shared_ptr<VmmBackend> make_backend(const std::string& name, const BackendParams& params);

// Every registered name, sorted.
std::vector<std::string> backend_factory_names();

// Runs probe `probe` of backend `backend` with `args`. invalid_argument,
// listing what exists, for an unknown backend, probe or argument name.
ProbeData run_backend_probe(const std::string& backend, const std::string& probe, const ProbeData& args);

// Every backend's probes: (backend, its probes), backends sorted.
std::vector<std::pair<std::string, std::vector<BackendProbe>>> backend_probes();

// A probe's argument `key`, or `fallback` when the caller gave none;
// invalid_argument naming the probe and the argument when it has another type.
template <class T>
T probe_arg(const ProbeData& args, const char* probe, const char* key, T fallback) {
  for (const auto& [name, value] : args) {
    if (name != key) continue;
    if (const T* v = std::get_if<T>(&value)) return *v;
    const char* want = std::is_same_v<T, bool>          ? "a bool"
                       : std::is_same_v<T, int64_t>     ? "an int"
                       : std::is_same_v<T, double>      ? "a float"
                       : std::is_same_v<T, std::string> ? "a str"
                                                        : "a list of ints";
    throw std::invalid_argument(std::string(probe) + ": " + key + " must be " + want);
  }
  return fallback;
}

}  // namespace vattn

// In a backend's source file, at namespace scope: the name, the factory, then
// any probes, each {name, function, doc, {argument names}}:
//   VATTN_REGISTER_BACKEND(host, make_host_from_params,
//                          {"granularity", probe_granularity, "the OS page size in bytes", {}});
#define VATTN_REGISTER_BACKEND(name, factory, ...)                         \
  static const bool vattn_backend_registered_##name =                      \
      ::vattn::register_backend_factory(#name, factory, {__VA_ARGS__})
