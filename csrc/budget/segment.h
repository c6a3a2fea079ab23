// The shared-memory segment that holds one budget: its layout, and how it is
// created, opened (validated before any field is trusted), listed and removed.
// The accounting on top of it (locking, grants, liveness) is budget.h's.
//
// Layout (POSIX shared memory /dev/shm/vattn-budget-NAME):
//
//   [ Header | Entry 0 | Entry 1 | ... | Entry max_members-1 ]
//
// The first 24 bytes (SegmentPrefix) keep their meaning in every format
// version, so a reader of any version can say which version it found.
// Invariants, kept under the header's lock:
//   * an entry with state kEntryLive describes one member (one KV cache
//     manager) of a process that was alive at the last liveness check;
//   * Header::held_bytes is the sum of the live entries' held_bytes and never
//     exceeds limit_bytes at the moment of a grant (a lowered limit may sit
//     below it until members release);
//   * Header::waiting_bytes is the sum of the live entries' unexpired waits.
// The header's sums are a cache for lock-free readers (pressure, limit): every
// locked operation recomputes them from the entries, so a process that dies
// mid-update leaves nothing inconsistent behind.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace vattn {
namespace budget {

constexpr uint64_t kMagic = 0x3154474442545456ull;  // the bytes "VTTBDGT1" (little-endian)
// 2: the lock is a kernel-held file lock, no longer a pthread mutex in the
// segment (whose bytes anyone who can write the file could make abort a
// locker); entries are kept alive by file locks; a removed flag; a futex word
// for waits.
constexpr uint32_t kFormatVersion = 2;
constexpr uint32_t kMaxMembersCap = 4096;            // entries a segment may have
constexpr uint32_t kDefaultMaxMembers = 64;
constexpr size_t kDeviceChars = 64;                  // "cpu" or "GPU-<uuid>", NUL-terminated
constexpr size_t kLabelChars = 48;                   // a member's label, NUL-terminated
constexpr size_t kMaxNameChars = 64;
constexpr const char* kShmPrefix = "vattn-budget-";  // /dev/shm/vattn-budget-NAME
constexpr const char* kShmDir = "/dev/shm/";
constexpr uint32_t kLockKindFileLock = 1;            // Header::lock_kind of this format

constexpr uint32_t kEntryFree = 0;
constexpr uint32_t kEntryLive = 1;

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory counters need lock-free 64-bit atomics");
static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<int32_t>::is_always_lock_free,
              "shared-memory states need lock-free 32-bit atomics");

struct SegmentPrefix {
  uint64_t magic;
  uint32_t version;
  uint32_t header_bytes;  // sizeof(Header) of the writer
  uint32_t entry_bytes;   // sizeof(Entry) of the writer
  uint32_t max_members;
};

// The lock's state in the segment. The lock itself is an open-file-description
// lock on byte kLockByte of the file, held by the kernel: no byte here can
// make a locker hang or abort, and a holder's death releases it.
struct LockState {
  std::atomic<uint32_t> dirty;           // 1 while held: a holder that died inside left it 1
  std::atomic<int32_t> holder_pid;       // who holds it (0: nobody), for the message of a lock timeout
};

struct Header {
  SegmentPrefix prefix;
  uint32_t lock_kind;                  // kLockKindFileLock (another kind: another vattn's layout)
  uint32_t reserved0;
  char device[kDeviceChars];           // "cpu" or a GPU UUID ("GPU-xxxxxxxx-...")
  std::atomic<uint64_t> limit_bytes;
  std::atomic<uint64_t> held_bytes;    // sum over live entries (cache, see above)
  std::atomic<uint64_t> waiting_bytes; // sum of live, unexpired waits (cache)
  std::atomic<uint64_t> next_generation;
  std::atomic<uint64_t> last_sweep_ns; // CLOCK_MONOTONIC of the last liveness check
  uint64_t created_unix_ns;            // CLOCK_REALTIME at creation, for display
  std::atomic<uint32_t> removed;       // 1: `budget rm --force` took it away from its members
  std::atomic<uint32_t> release_epoch; // futex word: bumped whenever a refused grant may now fit
  std::atomic<uint32_t> epoch_waiters; // threads blocked on release_epoch (a hint: wake only if any)
  uint32_t reserved1;
  alignas(64) LockState lock;          // the header's last 64 bytes
};

struct Entry {
  std::atomic<uint32_t> state;           // kEntryFree / kEntryLive; set live last, so a half-written entry is free
  int32_t pid;
  uint64_t start_ticks;                  // the process's start time (see process_identity.h)
  uint64_t pid_namespace;
  uint64_t generation;                   // tells a member apart from a later one in the same entry
  std::atomic<uint64_t> held_bytes;      // granted and not released
  std::atomic<uint64_t> in_use_bytes;    // of held: under requests (last report)
  std::atomic<uint64_t> free_held_bytes; // of held: mapped or created but free (last report)
  std::atomic<uint64_t> waiting_bytes;   // a refused grant's size while it waits, else 0
  uint64_t wait_since_ns;                // CLOCK_MONOTONIC of the first refusal of this wait
  uint64_t wait_renewed_ns;              // CLOCK_MONOTONIC of the latest refusal
  uint64_t joined_unix_ns;               // CLOCK_REALTIME, for display
  char label[kLabelChars];               // last: the entry's final kLabelChars bytes
};

// Byte offsets of the file locks (they lock bytes of the file, not memory).
constexpr off_t kLockByte = 0;     // the budget's lock
constexpr off_t kStagingByte = 1;  // held by a creator while it builds the segment under its staging name
// A member's liveness lock: the first byte of its entry.
inline off_t member_byte(uint32_t entry_index) {
  return static_cast<off_t>(sizeof(Header) + size_t{entry_index} * sizeof(Entry));
}

struct SegmentFiles;  // the open files, process mutex and fault guard of one mapping (segment.cpp)

// A mapped, validated segment. Moves, does not copy; unmaps in its destructor.
//
// It keeps two descriptors of the file, both close-on-exec: one whose open
// file description holds this process's file locks (the budget's lock while
// an operation runs, one byte per member it has), and one only to ask which
// bytes others lock (a description never conflicts with its own locks). In a
// child made by fork() the first is reopened, so parent and child hold
// separate locks; exec() and death close them, which releases the locks.
// A SIGBUS on the mapping (the file was truncated under it) is caught: the
// mapping is replaced by zero pages and the segment marked broken, which every
// operation then reports instead of the process dying.
class Segment {
 public:
  // Creates budget `name` (fails if it exists) and returns it mapped. The
  // segment is built under a private name and linked into place when
  // complete, so no reader ever sees it half-initialised.
  static Segment create(const std::string& name, uint64_t limit_bytes, const std::string& device,
                        uint32_t max_members);
  // Opens and validates budget `name`. Throws BudgetError when it does not
  // exist, is corrupt, of another format version, owned by another user or
  // writable by others, or removed.
  static Segment open(const std::string& name);
  // Unlinks budget `name` (mapped copies stay mapped until unmapped).
  static void unlink(const std::string& name);
  // The device the budget is for, checked again at every read (its field is a
  // byte array any writer of the file can change): BudgetCorrupt if it is not
  // a device name any more.
  std::string device() const;
  // Whether the budget's name still names this segment's file (not one created
  // under the name after this one was removed).
  bool named_here() const;
  // Names of the budgets in /dev/shm, sorted.
  static std::vector<std::string> list();
  // Removes the staging files of creators that died half-way (SIGKILL during
  // create); returns their file names. A creator's staging file is locked
  // while it runs: only unlocked ones of processes that are gone are removed.
  static std::vector<std::string> remove_leftovers();

  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&&) = delete;
  Segment(const Segment&) = delete;
  ~Segment();

  const std::string& name() const { return name_; }
  Header* header() const { return header_; }
  Entry* entry(uint32_t i) const { return entries_ + i; }
  uint32_t max_members() const { return max_members_; }

  // Empty when the segment is still what was validated at open; otherwise why
  // not (truncated, zeroed, another layout). Cheap: one fstat and a few loads.
  std::string damage() const;
  // The in-process half of the lock: the file lock does not exclude threads
  // that share this open file description.
  std::timed_mutex& process_mutex() const;
  // File locks on one byte of the segment through this mapping's description.
  // try_lock_byte: true when taken (false: another description holds it).
  bool try_lock_byte(off_t offset) const;
  void unlock_byte(off_t offset) const noexcept;
  // Whether another open file description locks byte `offset`: 1 yes, 0 no,
  // -1 unknown (the query failed).
  int byte_locked_elsewhere(off_t offset) const noexcept;
  // Whether this mapping's descriptors survived fork (false: reopening them in
  // the child failed, and this copy cannot take locks).
  bool usable_in_this_process() const;

 private:
  Segment(std::string name, void* base, size_t bytes, uint32_t max_members, int fd);

  std::string name_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  Header* header_ = nullptr;
  Entry* entries_ = nullptr;
  uint32_t max_members_ = 0;
  std::unique_ptr<SegmentFiles> files_;
};

// Throws std::invalid_argument unless `name` is 1-64 characters of
// [A-Za-z0-9._-] not starting with '.' or '-'.
void check_name(const std::string& name);
// "/vattn-budget-NAME", the shm_open name.
std::string shm_name(const std::string& name);
// "/dev/shm/vattn-budget-NAME".
std::string path_of(const std::string& name);
// Throws BudgetError: budget `name` is corrupt (`what`), with what to do.
[[noreturn]] void throw_corrupt(const std::string& name, const std::string& what);

uint64_t monotonic_ns();
uint64_t realtime_ns();

}  // namespace budget
}  // namespace vattn
