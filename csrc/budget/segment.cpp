#include "budget/segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <new>
#include <random>
#include <stdexcept>

#include "budget/budget_error.h"

namespace vattn {
namespace budget {

namespace {

std::string quoted(const std::string& name) { return "budget '" + name + "'"; }
std::string path_of(const std::string& name) { return std::string(kShmDir) + kShmPrefix + name; }
std::string remove_hint(const std::string& name) { return "`python -m vattn budget rm " + name + "`"; }

size_t segment_bytes(uint32_t max_members) { return sizeof(Header) + size_t{max_members} * sizeof(Entry); }

[[noreturn]] void throw_os(const std::string& name, const std::string& call, int err) {
  throw BudgetError(quoted(name) + ": " + call + " failed: " + std::strerror(err) + " (errno " +
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

 private:
  int fd_;
};

void init_mutex(pthread_mutex_t* mutex, const std::string& name) {
  pthread_mutexattr_t attr;
  int rc = pthread_mutexattr_init(&attr);
  if (rc == 0) rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  // Robust: the next locker learns (EOWNERDEAD) that a holder died, instead
  // of waiting forever on a lock a SIGKILLed process took with it.
  if (rc == 0) rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  if (rc == 0) rc = pthread_mutex_init(mutex, &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc != 0) throw_os(name, "pthread_mutex_init (robust, process-shared)", rc);
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

void throw_corrupt(const std::string& name, const std::string& what) {
  throw BudgetError(quoted(name) + " (" + path_of(name) + ") is corrupt: " + what + ". Stop the processes using it, " +
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

Segment::Segment(std::string name, void* base, size_t bytes, uint32_t max_members)
    : name_(std::move(name)), base_(base), bytes_(bytes), header_(static_cast<Header*>(base)), max_members_(max_members) {
  entries_ = reinterpret_cast<Entry*>(static_cast<char*>(base) + sizeof(Header));
}

Segment::Segment(Segment&& other) noexcept
    : name_(std::move(other.name_)),
      base_(other.base_),
      bytes_(other.bytes_),
      header_(other.header_),
      entries_(other.entries_),
      max_members_(other.max_members_) {
  other.base_ = nullptr;
  other.header_ = nullptr;
  other.entries_ = nullptr;
}

Segment::~Segment() {
  if (base_) munmap(base_, bytes_);
}

Segment Segment::create(const std::string& name, uint64_t limit_bytes, const std::string& device,
                        uint32_t max_members) {
  check_name(name);
  if (max_members < 1 || max_members > kMaxMembersCap)
    throw std::invalid_argument("max_members must be in [1, " + std::to_string(kMaxMembersCap) + "], got " +
                                std::to_string(max_members));
  if (device.size() >= kDeviceChars || !valid_device(device.c_str(), kDeviceChars))
    throw std::invalid_argument("device '" + device + "' is invalid: \"cpu\" or a GPU UUID (\"GPU-...\"), 1-" +
                                std::to_string(kDeviceChars - 1) + " printable characters without spaces");
  // Built under a private name ('~' cannot occur in a budget name), linked
  // into place only when complete: link() fails if the name exists, so two
  // creators cannot both win and nobody ever opens a half-built segment.
  std::random_device entropy;
  const std::string staging = std::string(kShmPrefix) + "~" + name + "~" + std::to_string(getpid()) + "~" +
                              std::to_string(entropy());
  const size_t bytes = segment_bytes(max_members);
  Fd fd(shm_open(("/" + staging).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (fd.get() < 0) throw_os(name, "shm_open(" + staging + ")", errno);
  struct Unlink {  // the staging name goes whatever happens
    std::string n;
    ~Unlink() { shm_unlink(("/" + n).c_str()); }
  } unlink_staging{staging};
  if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) throw_os(name, "ftruncate", errno);
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (base == MAP_FAILED) throw_os(name, "mmap", errno);
  Header* h = new (base) Header{};  // the file is zero-filled; this only starts the objects' lifetimes
  for (uint32_t i = 0; i < max_members; ++i)
    new (static_cast<char*>(base) + sizeof(Header) + size_t{i} * sizeof(Entry)) Entry{};
  Segment segment(name, base, bytes, max_members);
  h->mutex_bytes = sizeof(pthread_mutex_t);
  std::strncpy(h->device, device.c_str(), kDeviceChars - 1);
  h->limit_bytes.store(limit_bytes);
  h->next_generation.store(1);
  h->created_unix_ns = realtime_ns();
  init_mutex(&h->mutex, name);
  h->prefix.version = kFormatVersion;
  h->prefix.header_bytes = sizeof(Header);
  h->prefix.entry_bytes = sizeof(Entry);
  h->prefix.max_members = max_members;
  std::atomic_thread_fence(std::memory_order_release);
  h->prefix.magic = kMagic;
  if (link((kShmDir + staging).c_str(), path_of(name).c_str()) != 0) {
    const int err = errno;
    if (err == EEXIST)
      throw BudgetError(quoted(name) + " already exists: attach it (vattn.Budget.attach), or remove it with " +
                        remove_hint(name) + " first");
    throw_os(name, "link(" + path_of(name) + ")", err);
  }
  return segment;
}

Segment Segment::open(const std::string& name) {
  check_name(name);
  Fd fd(shm_open(shm_name(name).c_str(), O_RDWR | O_CLOEXEC, 0));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ENOENT)
      throw BudgetError("no " + quoted(name) + " (no " + path_of(name) + "): create it with `python -m vattn " +
                        "budget create " + name + " --limit 4GiB` or vattn.Budget.create(\"" + name + "\", ...)");
    if (err == EACCES)
      throw BudgetError(quoted(name) + ": permission denied on " + path_of(name) +
                        " (a budget is readable and writable by the user who created it only)");
    throw_os(name, "shm_open", err);
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) throw_os(name, "fstat", errno);
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
  Segment segment(name, base, size, prefix.max_members);
  const Header* h = segment.header();
  if (h->mutex_bytes != sizeof(pthread_mutex_t))
    throw_corrupt(name, "lock of " + std::to_string(h->mutex_bytes) + " bytes, this C library's is " +
                            std::to_string(sizeof(pthread_mutex_t)));
  if (!valid_device(h->device, kDeviceChars)) throw_corrupt(name, "the device field is not a device name");
  return segment;
}

void Segment::remove(const std::string& name) {
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

}  // namespace budget
}  // namespace vattn
