// Who a budget member's process is, well enough to tell a live process from a
// dead one whose pid was reused: the pid, the process's start time (field 22
// of /proc/PID/stat, clock ticks since boot) and its pid namespace (the inode
// of /proc/PID/ns/pid, since a pid means nothing outside its namespace).
#pragma once

#include <cstdint>
#include <sys/types.h>

namespace vattn {
namespace budget {

struct ProcessIdentity {
  int32_t pid = 0;
  uint64_t start_ticks = 0;    // 0: unknown
  uint64_t pid_namespace = 0;  // 0: unknown
};

// This process, computed again after a fork (the child has its own pid).
ProcessIdentity current_process();

enum class StatResult { kRead, kMissing, kUnreadable };

// The start time of process `pid` in clock ticks since boot, and whether it is
// a zombie or dead ('Z' / 'X'), from /proc/PID/stat. kMissing: no such entry.
StatResult read_process_stat(pid_t pid, uint64_t* start_ticks, bool* exited);

// Whether any thread of process `pid` has not exited: a process whose main
// thread ended (pthread_exit) shows as a zombie in /proc/PID/stat while its
// other threads run on and hold its memory.
bool has_live_thread(pid_t pid);

// Whether the process `who` still runs. A process of another pid namespace
// cannot be checked by pid and counts as alive (its share returns through the
// robust lock if it dies holding it, or when the budget is removed). Without a
// readable /proc (start time unknown) only kill(pid, 0) decides.
bool is_alive(const ProcessIdentity& who, const ProcessIdentity& self);

}  // namespace budget
}  // namespace vattn
