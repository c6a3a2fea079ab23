// Test hooks for the budget layer (tests/budget): act on a budget segment
// behind the accounting's back, to reproduce what only a crash or a foreign
// process would do: hold the lock and die, leave the lock unrecoverable, or
// write an entry for a process that is not what its pid says.
#include <pthread.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "budget/budget_error.h"
#include "budget/process_identity.h"
#include "budget/segment.h"
#include "testing/testing.h"

namespace vattn {

namespace {

// Segments the hooks opened, kept mapped for the life of the process (a lock
// held by this process must stay in a mapping that exists).
budget::Segment& open_segment(const std::string& name) {
  static std::map<std::string, std::unique_ptr<budget::Segment>> segments;
  auto it = segments.find(name);
  if (it == segments.end())
    it = segments.emplace(name, std::make_unique<budget::Segment>(budget::Segment::open(name))).first;
  return *it->second;
}

// Locks budget `name`'s mutex raw. Returns pthread_mutex_lock's code (0,
// EOWNERDEAD, ENOTRECOVERABLE); with make_consistent, EOWNERDEAD is repaired.
int lock_raw(const std::string& name, bool make_consistent) {
  budget::Header* h = open_segment(name).header();
  int rc = pthread_mutex_lock(&h->mutex);
  if (rc == EOWNERDEAD && make_consistent) pthread_mutex_consistent(&h->mutex);
  if (rc == 0 || rc == EOWNERDEAD) h->lock_holder_pid.store(static_cast<int32_t>(getpid()));  // as Budget does
  return rc;
}

int unlock_raw(const std::string& name) {
  budget::Header* h = open_segment(name).header();
  h->lock_holder_pid.store(0);
  return pthread_mutex_unlock(&h->mutex);
}

// Writes a live member entry for (pid, start_ticks) holding held_bytes, as a
// process of this pid namespace would. Returns its slot.
uint32_t add_entry(const std::string& name, int32_t pid, uint64_t start_ticks, const std::string& label,
                   uint64_t held_bytes) {
  budget::Segment& s = open_segment(name);
  int rc = lock_raw(name, true);
  if (rc != 0 && rc != EOWNERDEAD) throw BudgetError("budget_add_entry: lock failed: " + std::string(strerror(rc)));
  const budget::ProcessIdentity self = budget::current_process();
  for (uint32_t i = 0; i < s.max_members(); ++i) {
    budget::Entry& e = *s.entry(i);
    if (e.state.load() != budget::kEntryFree) continue;
    e.pid = pid;
    e.start_ticks = start_ticks;
    e.pid_namespace = self.pid_namespace;
    e.generation = s.header()->next_generation.fetch_add(1);
    e.held_bytes.store(held_bytes);
    e.in_use_bytes.store(held_bytes);
    e.free_held_bytes.store(0);
    e.waiting_bytes.store(0);
    std::memset(e.label, 0, sizeof(e.label));
    std::strncpy(e.label, label.c_str(), sizeof(e.label) - 1);
    e.state.store(budget::kEntryLive);
    s.header()->held_bytes.fetch_add(held_bytes);
    unlock_raw(name);
    return i;
  }
  unlock_raw(name);
  throw BudgetError("budget_add_entry: no free entry");
}

uint64_t start_ticks(int32_t pid) {
  uint64_t ticks = 0;
  bool exited = false;
  if (budget::read_process_stat(pid, &ticks, &exited) != budget::StatResult::kRead)
    throw BudgetError("budget_process_start_ticks: cannot read /proc/" + std::to_string(pid) + "/stat");
  return ticks;
}

}  // namespace

void bind_budget_hooks(py::module_& m) {
  m.def("budget_lock_raw", &lock_raw, py::arg("name"), py::arg("make_consistent") = true,
        py::call_guard<py::gil_scoped_release>(),
        "Locks budget `name`'s mutex and keeps it (until budget_unlock_raw or the process dies); returns the "
        "pthread_mutex_lock code.");
  m.def("budget_unlock_raw", &unlock_raw, py::arg("name"));
  m.def("budget_add_entry", &add_entry, py::arg("name"), py::arg("pid"), py::arg("start_ticks"), py::arg("label"),
        py::arg("held_bytes"), py::call_guard<py::gil_scoped_release>(),
        "Writes a live member entry for (pid, start_ticks) holding held_bytes; returns its slot.");
  m.def("budget_process_start_ticks", &start_ticks, py::arg("pid"),
        "Process `pid`'s start time in clock ticks since boot (/proc/PID/stat field 22).");
}

}  // namespace vattn
