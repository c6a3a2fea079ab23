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

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace vattn {
namespace budget {

constexpr uint64_t kMagic = 0x3154474442545456ull;  // the bytes "VTTBDGT1" (little-endian)
constexpr uint32_t kFormatVersion = 1;
constexpr uint32_t kMaxMembersCap = 4096;            // entries a segment may have
constexpr uint32_t kDefaultMaxMembers = 64;
constexpr size_t kDeviceChars = 64;                  // "cpu" or "GPU-<uuid>", NUL-terminated
constexpr size_t kLabelChars = 48;                   // a member's label, NUL-terminated
constexpr size_t kMaxNameChars = 64;
constexpr const char* kShmPrefix = "vattn-budget-";  // /dev/shm/vattn-budget-NAME
constexpr const char* kShmDir = "/dev/shm/";

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

struct Header {
  SegmentPrefix prefix;
  uint32_t mutex_bytes;                // sizeof(pthread_mutex_t) of the writer (another libc: another layout)
  std::atomic<int32_t> lock_holder_pid; // who holds the mutex (0: nobody), for the message of a lock timeout
  char device[kDeviceChars];           // "cpu" or a GPU UUID ("GPU-xxxxxxxx-...")
  std::atomic<uint64_t> limit_bytes;
  std::atomic<uint64_t> held_bytes;    // sum over live entries (cache, see above)
  std::atomic<uint64_t> waiting_bytes; // sum of live, unexpired waits (cache)
  std::atomic<uint64_t> next_generation;
  std::atomic<uint64_t> last_sweep_ns; // CLOCK_MONOTONIC of the last liveness check
  uint64_t created_unix_ns;            // CLOCK_REALTIME at creation, for display
  alignas(64) pthread_mutex_t mutex;   // robust, process-shared
};

struct Entry {
  std::atomic<uint32_t> state;           // kEntryFree / kEntryLive; set live last, so a half-written entry is free
  int32_t pid;
  uint64_t start_ticks;                  // the process's start time (see process_identity.h)
  uint64_t pid_namespace;
  uint64_t generation;                   // tells a member apart from a later one in the same slot
  std::atomic<uint64_t> held_bytes;      // granted and not released
  std::atomic<uint64_t> in_use_bytes;    // of held: under requests (last report)
  std::atomic<uint64_t> free_held_bytes; // of held: mapped or created but free (last report)
  std::atomic<uint64_t> waiting_bytes;   // a refused grant's size while it waits, else 0
  uint64_t wait_since_ns;                // CLOCK_MONOTONIC of the first refusal of this wait
  uint64_t wait_renewed_ns;              // CLOCK_MONOTONIC of the latest refusal
  uint64_t joined_unix_ns;               // CLOCK_REALTIME, for display
  char label[kLabelChars];
};

// A mapped, validated segment. Moves, does not copy; unmaps in its destructor.
class Segment {
 public:
  // Creates budget `name` (fails if it exists) and returns it mapped. The
  // segment is built under a private name and linked into place when
  // complete, so no reader ever sees it half-initialised.
  static Segment create(const std::string& name, uint64_t limit_bytes, const std::string& device,
                        uint32_t max_members);
  // Opens and validates budget `name`. Throws BudgetError when it does not
  // exist, is corrupt or is of another format version.
  static Segment open(const std::string& name);
  // Unlinks budget `name` (mapped copies stay usable until unmapped).
  static void remove(const std::string& name);
  // Names of the budgets in /dev/shm, sorted.
  static std::vector<std::string> list();

  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&&) = delete;
  Segment(const Segment&) = delete;
  ~Segment();

  const std::string& name() const { return name_; }
  Header* header() const { return header_; }
  Entry* entry(uint32_t i) const { return entries_ + i; }
  uint32_t max_members() const { return max_members_; }

 private:
  Segment(std::string name, void* base, size_t bytes, uint32_t max_members);

  std::string name_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  Header* header_ = nullptr;
  Entry* entries_ = nullptr;
  uint32_t max_members_ = 0;
};

// Throws std::invalid_argument unless `name` is 1-64 characters of
// [A-Za-z0-9._-] not starting with '.' or '-'.
void check_name(const std::string& name);
// "/vattn-budget-NAME", the shm_open name.
std::string shm_name(const std::string& name);
// Throws BudgetError: budget `name` is corrupt (`what`), with what to do.
[[noreturn]] void throw_corrupt(const std::string& name, const std::string& what);

uint64_t monotonic_ns();
uint64_t realtime_ns();

}  // namespace budget
}  // namespace vattn
