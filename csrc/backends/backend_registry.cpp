#include "backends/backend_registry.h"

#include <map>
#include <mutex>
#include <stdexcept>

namespace vattn {

namespace {

// Built on first use: registrations run during static initialisation, in an
// order across files that C++ leaves open.
std::map<std::string, BackendFactory>& factories() {
  static auto* table = new std::map<std::string, BackendFactory>();  // never freed: used until exit
  return *table;
}

std::mutex& factories_mu() {
  static auto* mu = new std::mutex();
  return *mu;
}

}  // namespace

bool register_backend_factory(const char* name, BackendFactory make) {
  std::lock_guard<std::mutex> lock(factories_mu());
  if (!factories().emplace(name, make).second)
    throw std::logic_error(std::string("two backend factories are registered as '") + name + "'");
  return true;
}

std::shared_ptr<VmmBackend> make_backend(const std::string& name, const BackendParams& params) {
  BackendFactory make = nullptr;
  {
    std::lock_guard<std::mutex> lock(factories_mu());
    auto it = factories().find(name);
    if (it != factories().end()) make = it->second;
  }
  if (!make) {
    std::string known;
    for (const std::string& n : backend_factory_names()) known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument("no C++ backend is registered as '" + name + "' (registered: " + known + ")");
  }
  return make(params);
}

std::vector<std::string> backend_factory_names() {
  std::lock_guard<std::mutex> lock(factories_mu());
  std::vector<std::string> out;
  for (const auto& entry : factories()) out.push_back(entry.first);
  return out;
}

}  // namespace vattn
