#include "budget/segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <new>
#include <random>
#include <stdexcept>

#include "budget/budget_error.h"
#include "budget/process_identity.h"

namespace vattn {
namespace budget {

namespace {

std::string quoted(const std::string& name) { return "budget '" + name + "'"; }
std::string remove_hint(const std::string& name) { return "`python -m vattn budget rm " + name + "`"; }

size_t segment_bytes(uint32_t max_members) { return sizeof(Header) + size_t{max_members} * sizeof(Entry); }
static_assert(sizeof(Header) % 64 == 0 && offsetof(Header, lock) == sizeof(Header) - 64,
              "the lock state is the header's last 64 bytes");
static_assert(offsetof(Entry, label) + kLabelChars == sizeof(Entry), "the label ends an entry");

[[noreturn]] void throw_os(const std::string& name, const std::string& call, int err) {
  throw BudgetSystemError(quoted(name) + ": " + call + " failed: " + std::strerror(err) + " (errno " +
                          std::to_string(err) + ")");
}

// A device string fit for the header: printable ASCII without spaces.
bool valid_device(const char* s, size_t max_chars) {
  size_t n = 0;
  for (; n < max_chars && s[n]; ++n)
    if (s[n] <= ' ' || s[n] > '~') return false;
  return n > 0 && n < max_chars;
}

class Fd {  // closes on scope exit
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

// A write lock on one byte through fd's open file description (F_OFD_*:
// owned by the description, not the process, so threads and forks are
// explicit, and released when the last descriptor of it closes: at exit,
// exec or close). Returns 0 or the errno.
int ofd_lock(int fd, short type, off_t offset) {
  struct flock fl {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = offset;
  fl.l_len = 1;
  return fcntl(fd, F_OFD_SETLK, &fl) == 0 ? 0 : errno;
}

// ---- the SIGBUS guard ----------------------------------------------------------------
//
// Another process of the same user can truncate the file under live members;
// touching a page past the new end raises SIGBUS, which would kill the
// process (the keeper thread reads the header every few milliseconds). The
// handler recognises a fault inside a registered mapping, replaces that
// mapping with private zero pages (mmap is a plain system call, safe in a
// handler) and marks it broken: the faulting access is retried on the zero
// page and every operation then reports the segment broken. Faults
// elsewhere go to whatever handler was installed before.
constexpr int kMaxGuards = 1024;

struct Guard {
  std::atomic<uintptr_t> base{0};
  std::atomic<size_t> bytes{0};
  std::atomic<int> broken{0};
};

Guard g_guards[kMaxGuards];
struct sigaction g_previous_sigbus;
std::mutex g_guard_mu;  // registration only; the handler reads the atomics
bool g_guard_installed = false;

void on_sigbus(int sig, siginfo_t* info, void* context) {
  if (info && info->si_code > 0) {  // a fault, not a signal someone sent
    const uintptr_t at = reinterpret_cast<uintptr_t>(info->si_addr);
    for (Guard& g : g_guards) {
      const uintptr_t base = g.base.load(std::memory_order_acquire);
      const size_t bytes = g.bytes.load(std::memory_order_acquire);
      if (base == 0 || at < base || at - base >= bytes) continue;
      if (mmap(reinterpret_cast<void*>(base), bytes, PROT_READ | PROT_WRITE,
               MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != MAP_FAILED) {
        g.broken.store(1, std::memory_order_release);
        return;  // the access is retried, on a zero page
      }
    }
  }
  const struct sigaction& prev = g_previous_sigbus;
  if (prev.sa_flags & SA_SIGINFO) {
    if (prev.sa_sigaction) prev.sa_sigaction(sig, info, context);
    return;
  }
  if (prev.sa_handler == SIG_IGN || prev.sa_handler == SIG_DFL) {
    // The default action: the fault recurs (or the sent signal is raised
    // again) with no handler in the way.
    signal(sig, SIG_DFL);
    if (!info || info->si_code <= 0) raise(sig);
    return;
  }
  prev.sa_handler(sig);
}

int guard_register(void* base, size_t bytes) {
  std::lock_guard<std::mutex> lock(g_guard_mu);
  if (!g_guard_installed) {
    struct sigaction action {};
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &g_previous_sigbus) != 0) return -1;
    g_guard_installed = true;
  }
  for (int i = 0; i < kMaxGuards; ++i) {
    if (g_guards[i].base.load() != 0) continue;
    g_guards[i].broken.store(0);
    g_guards[i].bytes.store(bytes, std::memory_order_release);
    g_guards[i].base.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
    return i;
  }
  return -1;  // over kMaxGuards budgets mapped at once: this one is unguarded
}

void guard_unregister(int guard) {
  if (guard < 0) return;
  std::lock_guard<std::mutex> lock(g_guard_mu);
  g_guards[guard].base.store(0, std::memory_order_release);
}

}  // namespace

// ---- the files of one mapping, and fork ------------------------------------------------

struct SegmentFiles {
  int fd = -1;        // holds this mapping's file locks
  int probe_fd = -1;  // asks which bytes other descriptions lock
  int guard = -1;     // index in g_guards, -1: unguarded
  std::atomic<std::timed_mutex*> mu{new std::timed_mutex};  // replaced (not freed) in a forked child
  bool forked_badly = false;  // the child could not reopen fd: this copy cannot lock
  ~SegmentFiles() { delete mu.load(); }
};

namespace {

std::mutex g_files_mu;  // guards g_files; held across fork() (atfork), so the child's copy is consistent
std::vector<SegmentFiles*> g_files;

// In a child made by fork(): every mapping gets a description of its own
// (the parent's file locks stay the parent's, and the parent's death or exec
// is not hidden by the child keeping its description open), and a fresh
// process mutex (a parent thread may have held the old one at fork time).
// glibc's fork() leaves malloc usable in the child's handlers.
void reopen_in_child() {
  for (SegmentFiles* f : g_files) {
    f->mu.store(new std::timed_mutex);  // the old one may be locked forever; leaked on purpose
    if (f->fd < 0) continue;
    char path[40];
    std::snprintf(path, sizeof(path), "/proc/self/fd/%d", f->fd);
    const int fresh = ::open(path, O_RDWR | O_CLOEXEC);
    if (fresh < 0 || dup3(fresh, f->fd, O_CLOEXEC) < 0) {
      ::close(f->fd);  // sharing the parent's description would share its locks: give it up
      f->fd = -1;
      f->forked_badly = true;
    }
    if (fresh >= 0) ::close(fresh);
  }
  g_files_mu.unlock();
}

void register_files(SegmentFiles* f) {
  static const int installed = pthread_atfork([] { g_files_mu.lock(); }, [] { g_files_mu.unlock(); },
                                              reopen_in_child);
  (void)installed;
  std::lock_guard<std::mutex> lock(g_files_mu);
  g_files.push_back(f);
}

void unregister_files(SegmentFiles* f) {
  std::lock_guard<std::mutex> lock(g_files_mu);
  g_files.erase(std::remove(g_files.begin(), g_files.end(), f), g_files.end());
}

// A staging file's parts: "~NAME~PID~START~RANDOM" (START missing in files of
// older releases). False for anything else.
bool parse_staging(const std::string& rest, pid_t* pid, uint64_t* start) {
  std::vector<std::string> parts;
  size_t from = 0;
  while (true) {
    const size_t at = rest.find('~', from);
    parts.push_back(rest.substr(from, at == std::string::npos ? std::string::npos : at - from));
    if (at == std::string::npos) break;
    from = at + 1;
  }
  if ((parts.size() != 4 && parts.size() != 5) || !parts[0].empty() || parts[1].empty()) return false;
  char* end = nullptr;
  const long p = std::strtol(parts[2].c_str(), &end, 10);
  if (parts[2].empty() || *end || p <= 0) return false;
  *pid = static_cast<pid_t>(p);
  *start = 0;
  if (parts.size() == 5) {
    const unsigned long long t = std::strtoull(parts[3].c_str(), &end, 10);
    if (parts[3].empty() || *end) return false;
    *start = t;
  }
  return true;
}

// Whether the creator named by a staging file may still be running.
bool creator_may_run(pid_t pid, uint64_t start) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  uint64_t ticks = 0;
  bool exited = false;
  switch (read_process_stat(pid, &ticks, &exited)) {
    case StatResult::kMissing: return false;
    case StatResult::kUnreadable: return true;
    case StatResult::kRead: break;
  }
  if (exited && !has_live_thread(pid)) return false;
  return start == 0 || ticks == start;  // another start time: the pid was reused
}

}  // namespace

void check_name(const std::string& name) {
  bool ok = !name.empty() && name.size() <= kMaxNameChars && name[0] != '.' && name[0] != '-';
  for (char c : name)
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                c == '_' || c == '-');
  if (!ok)
    throw std::invalid_argument("budget name '" + name + "' is invalid: use 1-" + std::to_string(kMaxNameChars) +
                                " characters of A-Z a-z 0-9 . _ - , not starting with '.' or '-'");
}

std::string shm_name(const std::string& name) { return std::string("/") + kShmPrefix + name; }

std::string path_of(const std::string& name) { return std::string(kShmDir) + kShmPrefix + name; }

void throw_corrupt(const std::string& name, const std::string& what) {
  throw BudgetCorrupt(quoted(name) + " (" + path_of(name) + ") is corrupt: " + what + ". Stop the processes using it, " +
                    "remove it with " + remove_hint(name) + " and create it again");
}

uint64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

uint64_t realtime_ns() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

Segment::Segment(std::string name, void* base, size_t bytes, uint32_t max_members, int fd)
    : name_(std::move(name)), base_(base), bytes_(bytes), header_(static_cast<Header*>(base)), max_members_(max_members),
      files_(new SegmentFiles) {
  entries_ = reinterpret_cast<Entry*>(static_cast<char*>(base) + sizeof(Header));
  files_->fd = fd;
  // A second description of the same file, to see the locks of the first.
  char path[40];
  std::snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
  files_->probe_fd = ::open(path, O_RDWR | O_CLOEXEC);
  if (files_->probe_fd < 0) {
    const int err = errno;
    munmap(base_, bytes_);
    ::close(fd);
    throw_os(name_, "open(" + std::string(path) + ") (a second descriptor of the segment)", err);
  }
  files_->guard = guard_register(base, bytes);
  register_files(files_.get());
}

Segment::Segment(Segment&& other) noexcept
    : name_(std::move(other.name_)),
      base_(other.base_),
      bytes_(other.bytes_),
      header_(other.header_),
      entries_(other.entries_),
      max_members_(other.max_members_),
      files_(std::move(other.files_)) {
  other.base_ = nullptr;
  other.header_ = nullptr;
  other.entries_ = nullptr;
}

Segment::~Segment() {
  if (files_) {
    unregister_files(files_.get());
    guard_unregister(files_->guard);
    if (files_->fd >= 0) ::close(files_->fd);  // releases this mapping's file locks
    if (files_->probe_fd >= 0) ::close(files_->probe_fd);
  }
  if (base_) munmap(base_, bytes_);
}

std::string Segment::damage() const {
  if (files_->guard >= 0 && g_guards[files_->guard].broken.load(std::memory_order_acquire))
    return "its file was truncated under this process (a read past its end faulted)";
  struct stat st;
  if (fstat(files_->probe_fd, &st) != 0) return std::string("fstat failed: ") + std::strerror(errno);
  if (static_cast<size_t>(st.st_size) != bytes_)
    return "its file was truncated to " + std::to_string(st.st_size) + " bytes under its members (expected " +
           std::to_string(bytes_) + ")";
  const SegmentPrefix& p = header_->prefix;
  if (p.magic != kMagic || p.version != kFormatVersion || p.header_bytes != sizeof(Header) ||
      p.entry_bytes != sizeof(Entry) || p.max_members != max_members_ || header_->lock_kind != kLockKindFileLock)
    return "its header was overwritten (magic, version, sizes or lock kind changed)";
  return "";
}

std::string Segment::device() const {
  const char* field = header_->device;
  if (!valid_device(field, kDeviceChars)) throw_corrupt(name_, "the device field is not a device name");
  return std::string(field, strnlen(field, kDeviceChars));
}

bool Segment::named_here() const {
  struct stat mine, named;
  if (fstat(files_->probe_fd, &mine) != 0) return false;
  if (stat(path_of(name_).c_str(), &named) != 0) return false;
  return mine.st_dev == named.st_dev && mine.st_ino == named.st_ino;
}

std::timed_mutex& Segment::process_mutex() const { return *files_->mu.load(std::memory_order_acquire); }

bool Segment::usable_in_this_process() const { return files_->fd >= 0 && !files_->forked_badly; }

bool Segment::try_lock_byte(off_t offset) const {
  const int err = ofd_lock(files_->fd, F_WRLCK, offset);
  if (err == 0) return true;
  if (err == EAGAIN || err == EACCES) return false;
  throw_os(name_, "fcntl(F_OFD_SETLK)", err);
}

void Segment::unlock_byte(off_t offset) const noexcept { ofd_lock(files_->fd, F_UNLCK, offset); }

int Segment::byte_locked_elsewhere(off_t offset) const noexcept {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = offset;
  fl.l_len = 1;
  if (fcntl(files_->probe_fd, F_OFD_GETLK, &fl) != 0) return -1;
  return fl.l_type != F_UNLCK ? 1 : 0;
}

Segment Segment::create(const std::string& name, uint64_t limit_bytes, const std::string& device,
                        uint32_t max_members) {
  check_name(name);
  if (max_members < 1 || max_members > kMaxMembersCap)
    throw std::invalid_argument("max_members must be in [1, " + std::to_string(kMaxMembersCap) + "], got " +
                                std::to_string(max_members));
  if (limit_bytes == 0)
    throw std::invalid_argument("limit_bytes must be in [1, 2**64 - 1] bytes, got 0: a budget of 0 bytes grants "
                                "nothing");
  if (device.size() >= kDeviceChars || !valid_device(device.c_str(), kDeviceChars))
    throw std::invalid_argument("device '" + device + "' is invalid: \"cpu\" or a GPU UUID (\"GPU-...\"), 1-" +
                                std::to_string(kDeviceChars - 1) + " printable characters without spaces");
  remove_leftovers();  // a creator killed half-way must not leave its file for good
  // Built under a private name ('~' cannot occur in a budget name), linked
  // into place only when complete: link() fails if the name exists, so two
  // creators cannot both win and nobody ever opens a half-built segment. The
  // name says who builds it (pid and start time) and the creator locks it
  // at once, so remove_leftovers() can tell a dead creator's file.
  const ProcessIdentity self = current_process();
  std::random_device entropy;
  const std::string staging = std::string(kShmPrefix) + "~" + name + "~" + std::to_string(self.pid) + "~" +
                              std::to_string(self.start_ticks) + "~" + std::to_string(entropy());
  const size_t bytes = segment_bytes(max_members);
  const int raw_fd = shm_open(("/" + staging).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (raw_fd < 0) throw_os(name, "shm_open(" + staging + ")", errno);
  struct Unlink {  // the staging name goes whatever happens
    std::string n;
    ~Unlink() { shm_unlink(("/" + n).c_str()); }
  } unlink_staging{staging};
  if (int err = ofd_lock(raw_fd, F_WRLCK, kStagingByte)) {
    ::close(raw_fd);
    throw_os(name, "fcntl(F_OFD_SETLK) on the staging file", err);
  }
  if (fchmod(raw_fd, 0600) != 0 || ftruncate(raw_fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    ::close(raw_fd);
    throw_os(name, "ftruncate", err);
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, raw_fd, 0);
  if (base == MAP_FAILED) {
    const int err = errno;
    ::close(raw_fd);
    throw_os(name, "mmap", err);
  }
  Header* h = new (base) Header{};  // the file is zero-filled; this only starts the objects' lifetimes
  for (uint32_t i = 0; i < max_members; ++i)
    new (static_cast<char*>(base) + sizeof(Header) + size_t{i} * sizeof(Entry)) Entry{};
  Segment segment(name, base, bytes, max_members, raw_fd);
  h->lock_kind = kLockKindFileLock;
  std::strncpy(h->device, device.c_str(), kDeviceChars - 1);
  h->limit_bytes.store(limit_bytes);
  h->next_generation.store(1);
  h->created_unix_ns = realtime_ns();
  h->prefix.version = kFormatVersion;
  h->prefix.header_bytes = sizeof(Header);
  h->prefix.entry_bytes = sizeof(Entry);
  h->prefix.max_members = max_members;
  std::atomic_thread_fence(std::memory_order_release);
  h->prefix.magic = kMagic;
  const int linked = link((kShmDir + staging).c_str(), path_of(name).c_str());
  const int err = errno;
  segment.unlock_byte(kStagingByte);
  if (linked != 0) {
    if (err == EEXIST)
      throw BudgetError(quoted(name) + " already exists: attach it (vattn.Budget.attach), or remove it with " +
                        remove_hint(name) + " first");
    throw_os(name, "link(" + path_of(name) + ")", err);
  }
  return segment;
}

Segment Segment::open(const std::string& name) {
  check_name(name);
  const int raw_fd = shm_open(shm_name(name).c_str(), O_RDWR | O_CLOEXEC, 0);
  if (raw_fd < 0) {
    const int err = errno;
    if (err == ENOENT)
      throw BudgetError("no " + quoted(name) + " (no " + path_of(name) + "): create it with `python -m vattn " +
                        "budget create " + name + " --limit 4GiB` or vattn.Budget.create(\"" + name + "\", ...)");
    if (err == EACCES)
      throw BudgetError(quoted(name) + ": permission denied on " + path_of(name) +
                        " (a budget is readable and writable by the user who created it only)");
    throw_os(name, "shm_open", err);
  }
  Fd fd(raw_fd);
  struct stat st;
  if (fstat(fd.get(), &st) != 0) throw_os(name, "fstat", errno);
  // Whoever can write the segment can make every member give its memory
  // away (or take the lock's holders for dead): only the caller's own user
  // may, so a segment another user owns, or one others may write, is refused.
  if (st.st_uid != geteuid())
    throw BudgetError(quoted(name) + " (" + path_of(name) + ") is owned by uid " + std::to_string(st.st_uid) +
                      ", not by this process's user (uid " + std::to_string(geteuid()) + "): another user may " +
                      "have created it to take the budget over; use another name, or have that user (or root) " +
                      "remove it");
  if (st.st_mode & 0077) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw BudgetError(quoted(name) + " (" + path_of(name) + ") has mode " + mode + ", which lets other users " +
                      "read or write it (a budget is 0600): if you trust its contents, `chmod 600 " + path_of(name) +
                      "`; otherwise remove it with " + remove_hint(name) + " and create it again");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  SegmentPrefix prefix{};
  if (size < sizeof(SegmentPrefix) ||
      pread(fd.get(), &prefix, sizeof(prefix), 0) != static_cast<ssize_t>(sizeof(prefix)))
    throw_corrupt(name, "only " + std::to_string(size) + " bytes, shorter than any budget header");
  if (prefix.magic != kMagic) throw_corrupt(name, "bad magic number (not a vattn budget segment)");
  if (prefix.version != kFormatVersion)
    throw BudgetError(quoted(name) + " has segment format version " + std::to_string(prefix.version) +
                      ", this vattn reads version " + std::to_string(kFormatVersion) +
                      " (it was created by another vattn release): stop the processes using it, remove it with " +
                      remove_hint(name) + " and create it again");
  if (prefix.header_bytes != sizeof(Header) || prefix.entry_bytes != sizeof(Entry))
    throw_corrupt(name, "header/entry sizes " + std::to_string(prefix.header_bytes) + "/" +
                            std::to_string(prefix.entry_bytes) + " bytes, expected " + std::to_string(sizeof(Header)) +
                            "/" + std::to_string(sizeof(Entry)));
  if (prefix.max_members < 1 || prefix.max_members > kMaxMembersCap)
    throw_corrupt(name, "member table of " + std::to_string(prefix.max_members) + " entries, expected 1-" +
                            std::to_string(kMaxMembersCap));
  if (size != segment_bytes(prefix.max_members))
    throw_corrupt(name, std::to_string(size) + " bytes, expected " + std::to_string(segment_bytes(prefix.max_members)) +
                            " for " + std::to_string(prefix.max_members) + " members");
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (base == MAP_FAILED) throw_os(name, "mmap", errno);
  Segment segment(name, base, size, prefix.max_members, fd.release());
  const Header* h = segment.header();
  if (h->lock_kind != kLockKindFileLock)
    throw_corrupt(name, "lock kind " + std::to_string(h->lock_kind) + ", expected " +
                            std::to_string(kLockKindFileLock) + " (a file lock)");
  if (!valid_device(h->device, kDeviceChars)) throw_corrupt(name, "the device field is not a device name");
  if (h->removed.load())
    throw BudgetError(quoted(name) + " was removed (`python -m vattn budget rm --force`): create it again");
  return segment;
}

void Segment::unlink(const std::string& name) {
  check_name(name);
  if (shm_unlink(shm_name(name).c_str()) != 0) {
    const int err = errno;
    if (err == ENOENT) throw BudgetError("no " + quoted(name) + " to remove (no " + path_of(name) + ")");
    throw_os(name, "shm_unlink", err);
  }
}

std::vector<std::string> Segment::list() {
  std::vector<std::string> names;
  DIR* dir = opendir(kShmDir);
  if (!dir) return names;
  const size_t prefix_len = std::strlen(kShmPrefix);
  while (dirent* e = readdir(dir)) {
    const std::string file = e->d_name;
    if (file.compare(0, prefix_len, kShmPrefix) != 0) continue;
    const std::string name = file.substr(prefix_len);
    try {
      check_name(name);
      names.push_back(name);
    } catch (const std::invalid_argument&) {  // a staging segment or a stranger's file
    }
  }
  closedir(dir);
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> Segment::remove_leftovers() {
  std::vector<std::string> removed;
  DIR* dir = opendir(kShmDir);
  if (!dir) return removed;
  const std::string staging_prefix = std::string(kShmPrefix) + "~";
  std::vector<std::string> candidates;
  while (dirent* e = readdir(dir)) {
    const std::string file = e->d_name;
    if (file.compare(0, staging_prefix.size(), staging_prefix) == 0) candidates.push_back(file);
  }
  closedir(dir);
  for (const std::string& file : candidates) {
    pid_t pid = 0;
    uint64_t start = 0;
    if (!parse_staging(file.substr(std::strlen(kShmPrefix)), &pid, &start)) continue;  // not vattn's
    const int raw = ::open((kShmDir + file).c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (raw < 0) continue;  // gone meanwhile, or not ours to open
    Fd fd(raw);
    struct stat st;
    if (fstat(fd.get(), &st) != 0 || st.st_uid != geteuid() || !S_ISREG(st.st_mode)) continue;
    // A running creator holds the staging byte: its file is not a leftover.
    // The lock taken here is held until the file is unlinked, so a creator
    // cannot be mid-way meanwhile; the pid check covers the instant between
    // a creator's shm_open and its lock.
    if (ofd_lock(fd.get(), F_WRLCK, kStagingByte) != 0) continue;
    if (creator_may_run(pid, start)) continue;
    if (::unlink((kShmDir + file).c_str()) == 0) removed.push_back(file);
  }
  std::sort(removed.begin(), removed.end());
  return removed;
}

}  // namespace budget
}  // namespace vattn
