#include "backends/cuda_driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <map>
#include <memory>

#include "common/errors.h"

namespace vattn {
namespace cu {

std::string default_driver_path() {
  const char* env = std::getenv("VATTN_CUDA_DRIVER_LIB");
  return (env && *env) ? std::string(env) : std::string("libcuda.so.1");
}

namespace {

template <typename Fn>
void bind(void* handle, const char* symbol, Fn*& fn, const std::string& path) {
  fn = reinterpret_cast<Fn*>(dlsym(handle, symbol));
  if (!fn) throw BackendUnavailable("CUDA driver " + path + " has no symbol " + symbol);
}

std::unique_ptr<DriverApi> open_driver(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* why = dlerror();
    throw BackendUnavailable("cannot load the CUDA driver library " + path + ": " +
                             (why ? why : "unknown dlopen error"));
  }
  auto api = std::make_unique<DriverApi>();
  api->path = path;
  api->handle = handle;
  try {
#define VATTN_CU_BIND(member, symbol, fn_type) bind(handle, #symbol, api->member, path);
    VATTN_CU_FUNCTIONS(VATTN_CU_BIND)
#undef VATTN_CU_BIND
  } catch (...) {
    dlclose(handle);
    throw;
  }
  CUresult rc = api->cuInit(0);
  if (rc != CUDA_SUCCESS) {
    std::string why = error_name(*api, rc);
    dlclose(handle);
    throw BackendUnavailable("cuInit failed: " + why + " (no usable NVIDIA driver or GPU)");
  }
  return api;
}

}  // namespace

const DriverApi& load_driver(const std::string& path) {
  // Tables live until process exit: backends and reservations in other threads
  // or at interpreter shutdown may still call through them.
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<DriverApi>>* tables =
      new std::map<std::string, std::unique_ptr<DriverApi>>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = tables->find(path);
  if (it != tables->end()) return *it->second;
  auto api = open_driver(path);
  const DriverApi& ref = *api;
  tables->emplace(path, std::move(api));
  return ref;
}

std::string error_name(const DriverApi& api, CUresult code) {
  const char* name = nullptr;
  if (api.cuGetErrorName && api.cuGetErrorName(code, &name) == CUDA_SUCCESS && name)
    return std::string(name) + " (" + std::to_string(code) + ")";
  return "CUresult " + std::to_string(code);
}

}  // namespace cu
}  // namespace vattn
