#include "backends/backend_registry.h"

#include <map>
#include <mutex>
#include <stdexcept>

namespace vattn {

namespace {

struct Entry {
  BackendFactory make = nullptr;
  std::vector<BackendProbe> probes;
};

// Built on first use: registrations run during static initialisation, in an
// order across files that C++ leaves open. One table per process: every
// extension module links the one library that holds it (setup.py).
std::map<std::string, Entry>& entries() {
  static auto* table = new std::map<std::string, Entry>();  // never freed: used until exit
  return *table;
}

std::mutex& entries_mu() {
  static auto* mu = new std::mutex();
  return *mu;
}

template <class Items, class Name>
std::string listed(const Items& items, Name name) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + name(item);
  return out.empty() ? "none" : out;
}

// The entry of `name` (entries are never removed, so the reference stays
// valid); invalid_argument listing the registered names. Caller holds entries_mu().
const Entry& entry_locked(const std::string& name) {
  auto it = entries().find(name);
  if (it == entries().end())
    throw std::invalid_argument("no C++ backend is registered as '" + name + "' (registered: " +
                                listed(entries(), [](const auto& e) { return e.first; }) + ")");
  return it->second;
}

}  // namespace

bool register_backend_factory(const char* name, BackendFactory make, std::vector<BackendProbe> probes) {
  for (size_t i = 0; i < probes.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (probes[i].name == probes[j].name)
        throw std::logic_error(std::string("backend '") + name + "' registers two probes named '" +
                               probes[i].name + "'");
  std::lock_guard<std::mutex> lock(entries_mu());
  if (!entries().emplace(name, Entry{make, std::move(probes)}).second)
    throw std::logic_error(std::string("two backend factories are registered as '") + name + "'");
  return true;
}

std::shared_ptr<VmmBackend> make_backend(const std::string& name, const BackendParams& params) {
  BackendFactory make = nullptr;
  {
    std::lock_guard<std::mutex> lock(entries_mu());
    make = entry_locked(name).make;
  }
  return make(params);  // without the lock: a factory may load a driver
}

std::vector<std::string> backend_factory_names() {
  std::lock_guard<std::mutex> lock(entries_mu());
  std::vector<std::string> out;
  for (const auto& entry : entries()) out.push_back(entry.first);
  return out;
}

ProbeData run_backend_probe(const std::string& backend, const std::string& probe, const ProbeData& args) {
  BackendProbe found;
  {
    std::lock_guard<std::mutex> lock(entries_mu());
    const std::vector<BackendProbe>& probes = entry_locked(backend).probes;
    for (const BackendProbe& p : probes)
      if (p.name == probe) found = p;
    if (!found.run)
      throw std::invalid_argument("backend '" + backend + "' has no probe '" + probe + "' (its probes: " +
                                  listed(probes, [](const BackendProbe& p) { return p.name; }) + ")");
  }
  const std::string what = backend + "." + probe;
  for (const auto& [key, value] : args) {
    bool known = false;
    for (const std::string& name : found.args) known = known || name == key;
    if (!known)
      throw std::invalid_argument(what + " takes no argument '" + key + "' (its arguments: " +
                                  listed(found.args, [](const std::string& n) { return n; }) + ")");
  }
  return found.run(args);  // without the registry's lock: a probe may take long (driver calls)
}

std::vector<std::pair<std::string, std::vector<BackendProbe>>> backend_probes() {
  std::lock_guard<std::mutex> lock(entries_mu());
  std::vector<std::pair<std::string, std::vector<BackendProbe>>> out;
  for (const auto& [name, entry] : entries()) out.emplace_back(name, entry.probes);
  return out;
}

}  // namespace vattn
