#include "budget/process_identity.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace vattn {
namespace budget {

namespace {

uint64_t namespace_inode(pid_t pid) {
  struct stat st;
  std::string path = "/proc/" + std::to_string(pid) + "/ns/pid";
  return stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

}  // namespace

StatResult read_process_stat(pid_t pid, uint64_t* start_ticks, bool* exited) {
  char path[48];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT || errno == ESRCH ? StatResult::kMissing : StatResult::kUnreadable;
  char buf[1024];
  ssize_t n = read(fd, buf, sizeof(buf) - 1);
  const int err = errno;
  close(fd);
  if (n <= 0) return n < 0 && err == ESRCH ? StatResult::kMissing : StatResult::kUnreadable;
  buf[n] = '\0';
  // "pid (comm) state f4 ... f22": comm may hold spaces and parentheses, so
  // fields are counted from the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (!p || p[1] != ' ' || !p[2]) return StatResult::kUnreadable;
  *exited = p[2] == 'Z' || p[2] == 'X';
  p += 2;  // field 3 (state)
  for (int field = 3; field < 22; ++field) {
    p = std::strchr(p, ' ');
    if (!p) return StatResult::kUnreadable;
    ++p;
  }
  char* end = nullptr;
  unsigned long long ticks = std::strtoull(p, &end, 10);
  if (end == p) return StatResult::kUnreadable;
  *start_ticks = ticks;
  return StatResult::kRead;
}

namespace {

// The state letter of /proc/PID/task/TID/stat, or 0 when unreadable.
char thread_state(pid_t pid, const char* tid) {
  char path[96];
  std::snprintf(path, sizeof(path), "/proc/%d/task/%s/stat", static_cast<int>(pid), tid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[512];
  ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');
  return p && p[1] == ' ' ? p[2] : 0;
}

}  // namespace

bool has_live_thread(pid_t pid) {
  char path[48];
  std::snprintf(path, sizeof(path), "/proc/%d/task", static_cast<int>(pid));
  DIR* dir = opendir(path);
  if (!dir) return false;
  bool live = false;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const char state = thread_state(pid, e->d_name);
    if (state != 0 && state != 'Z' && state != 'X') {
      live = true;
      break;
    }
  }
  closedir(dir);
  return live;
}

ProcessIdentity current_process() {
  ProcessIdentity self;
  self.pid = static_cast<int32_t>(getpid());
  bool exited = false;
  if (read_process_stat(self.pid, &self.start_ticks, &exited) != StatResult::kRead) self.start_ticks = 0;
  self.pid_namespace = namespace_inode(self.pid);
  return self;
}

bool is_alive(const ProcessIdentity& who, const ProcessIdentity& self) {
  if (who.pid <= 0) return false;
  if (who.pid_namespace && self.pid_namespace && who.pid_namespace != self.pid_namespace) return true;
  if (who.pid == self.pid) return who.start_ticks == self.start_ticks;  // a former holder of our own pid
  if (kill(who.pid, 0) != 0 && errno == ESRCH) return false;
  if (self.start_ticks == 0) return true;  // no /proc here: the pid exists, nothing more is known
  uint64_t start = 0;
  bool exited = false;
  switch (read_process_stat(who.pid, &start, &exited)) {
    case StatResult::kMissing: return false;
    case StatResult::kUnreadable: return true;
    case StatResult::kRead: break;
  }
  if (start != who.start_ticks) return false;  // the pid was reused
  // 'Z' for the thread-group leader means either the whole process died (not
  // reaped yet: its memory is gone) or only its main thread did, while other
  // threads run on with the process's memory: then it is alive.
  return !exited || has_live_thread(who.pid);
}

}  // namespace budget
}  // namespace vattn
