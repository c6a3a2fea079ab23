// Test hooks for the budget layer (tests/budget): act on a budget segment
// behind the accounting's back, to reproduce what only a crash or a foreign
// process would do: hold the lock and die, or write an entry for a process
// that is not what its pid says.
#include <unistd.h>

#include <chrono>
#include <thread>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "budget/budget_error.h"
#include "budget/process_identity.h"
#include "budget/segment.h"
#include "common/released_gil.h"
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

// Takes budget `name`'s lock as an operation does (the file lock, the state
// word) and keeps it until budget_unlock_raw or this process dies. Returns 0.
int lock_raw(const std::string& name) {
  budget::Segment& s = open_segment(name);
  s.process_mutex().lock();
  while (!s.try_lock_byte(budget::kLockByte)) std::this_thread::sleep_for(std::chrono::microseconds(50));
  s.header()->lock.dirty.store(1);
  s.header()->lock.holder_pid.store(static_cast<int32_t>(getpid()));  // as Budget does
  return 0;
}

int unlock_raw(const std::string& name) {
  budget::Segment& s = open_segment(name);
  s.header()->lock.holder_pid.store(0);
  s.header()->lock.dirty.store(0);
  s.unlock_byte(budget::kLockByte);
  s.process_mutex().unlock();
  return 0;
}

// Writes a live member entry for (pid, start_ticks) holding held_bytes, as a
// process of this pid namespace would; the entry's liveness lock is taken by
// this process (held until it exits), so only the pid decides. Returns its entry index.
uint32_t add_entry(const std::string& name, int32_t pid, uint64_t start_ticks, const std::string& label,
                   uint64_t held_bytes) {
  budget::Segment& s = open_segment(name);
  lock_raw(name);
  const budget::ProcessIdentity self = budget::current_process();
  for (uint32_t i = 0; i < s.max_members(); ++i) {
    budget::Entry& e = *s.entry(i);
    if (e.state.load() != budget::kEntryFree || !s.try_lock_byte(budget::member_byte(i))) continue;
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
  m.def("budget_lock_raw", gil_released(&lock_raw), py::arg("name"),
        "Takes budget `name`'s lock and keeps it (until budget_unlock_raw or the process dies); returns 0.");
  m.def("budget_unlock_raw", &unlock_raw, py::arg("name"));
  m.def("budget_add_entry", gil_released(&add_entry), py::arg("name"), py::arg("pid"), py::arg("start_ticks"),
        py::arg("label"), py::arg("held_bytes"),
        "Writes a live member entry for (pid, start_ticks) holding held_bytes; returns its entry index.");
  m.def("budget_process_start_ticks", &start_ticks, py::arg("pid"),
        "Process `pid`'s start time in clock ticks since boot (/proc/PID/stat field 22).");
}

}  // namespace vattn
