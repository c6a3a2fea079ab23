// A machine-wide memory budget shared by KV cache managers in any number of
// processes: one limit in bytes for one device ("cpu" or a GPU by UUID), and
// one member per manager holding a share of it. The state lives in a POSIX
// shared-memory segment (segment.h) guarded by a file lock the kernel holds
// (see Locked in budget.cpp); no Python, no GIL: a page manager's mapper
// thread calls it directly.
//
// Protocol of a member (a page manager):
//
//   auto member = Budget::attach("llm")->join("vllm:llama-8b");
//   if (!member->try_grant(n * page_bytes)) return false;  // before creating pages
//   ... create the pages ...
//   member->report(in_use_bytes, free_held_bytes);         // after every change
//   ... release pages ...; member->release(m * page_bytes);  member->report(...);
//   if (uint64_t p = member->pressure()) shed up to p bytes of free pages;  // cheap poll
//
// Guarantees:
//   * the sum of the live members' held bytes never exceeds the limit at the
//     moment of any grant, across all processes (a lowered limit may sit below
//     the sum until members release; no grant succeeds until it fits again);
//   * a member whose process died (SIGKILL included) or exec'd another
//     program is dropped, and its share returned, by the next operation of
//     anyone that needs it. A member is alive while (1) its process holds the
//     file lock on its entry's first byte, taken at join through a
//     close-on-exec descriptor: exec and death release it, a main thread
//     that exits while other threads run does not; and (2) its pid, with the
//     process start time, names a process with a thread that has not exited
//     (process_identity.h). Liveness is checked before any grant is refused,
//     by join and usage, and by any operation kLivenessIntervalSeconds after
//     the last check; after a holder died inside the lock, at once;
//   * a refused grant is recorded as this member waiting for bytes, which
//     other members see as pressure; a wait not renewed by another refusal
//     within kWaitExpirySeconds stops counting (the asker gave up); a refused
//     member can block (wait_for_memory) until memory is released, the limit
//     changes or a member leaves, instead of asking again and again;
//   * a segment truncated or overwritten under its members, or removed by
//     force, is reported as a BudgetError by every operation that needs it
//     (never a crash); giving back (release, leave) stays quiet.
// Every operation is thread-safe within a process and across processes.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "budget/budget_error.h"
#include "budget/process_identity.h"
#include "budget/segment.h"

namespace vattn {

class BudgetMember;

// One member's line of a usage snapshot. Bytes throughout.
struct BudgetMemberUsage {
  uint64_t id = 0;               // unique within the budget's lifetime
  int32_t pid = 0;
  std::string label;             // what the member is ("vllm:llama-8b", ...)
  uint64_t held_bytes = 0;       // granted and not released
  uint64_t in_use_bytes = 0;     // of held: under requests (last report)
  uint64_t free_held_bytes = 0;  // of held: free pages kept for reuse (last report)
  uint64_t waiting_bytes = 0;    // a refused grant it waits for; 0 if none
  double waiting_seconds = 0;    // how long it has waited; 0 if not waiting
  double joined_unix_seconds = 0;
};

// A consistent snapshot of a budget, taken under its lock.
struct BudgetUsage {
  std::string name;
  std::string device;
  uint64_t limit_bytes = 0;
  uint64_t held_bytes = 0;  // sum over members
  uint64_t in_use_bytes = 0;
  uint64_t free_held_bytes = 0;
  uint64_t waiting_bytes = 0;
  uint32_t max_members = 0;
  double created_unix_seconds = 0;
  std::vector<BudgetMemberUsage> members;  // by pid, then id
};

class Budget : public std::enable_shared_from_this<Budget> {
 public:
  static constexpr double kWaitExpirySeconds = 1.0;
  static constexpr double kDefaultLockTimeoutSeconds = 10.0;
  // Reading /proc for every member costs ~20 us each, too much for every
  // grant: liveness is checked at most this often by a grant that succeeds,
  // and always before a refusal, a join, a usage snapshot, and after a holder
  // died inside the lock.
  static constexpr double kLivenessIntervalSeconds = 0.05;

  // Creates budget `name` of `limit_bytes` for `device` ("cpu" or a GPU
  // UUID) with room for `max_members` members. Throws BudgetError if it exists.
  static std::shared_ptr<Budget> create(const std::string& name, uint64_t limit_bytes, const std::string& device,
                                        uint32_t max_members = budget::kDefaultMaxMembers,
                                        double lock_timeout_s = kDefaultLockTimeoutSeconds);
  // Opens an existing budget (BudgetError: missing, corrupt, other version).
  // Operations wait at most `lock_timeout_s` seconds for the lock (then
  // BudgetError naming the holder's pid): operations hold it for
  // microseconds, so a longer wait means a stopped or stuck holder.
  static std::shared_ptr<Budget> attach(const std::string& name,
                                        double lock_timeout_s = kDefaultLockTimeoutSeconds);
  // Removes budget `name` from /dev/shm; returns how many live members it had.
  // While it has live members, BudgetError unless `force`: they would go on
  // charging a segment nobody else sees. With `force` the segment is first
  // marked removed, so its members' operations raise BudgetError (saying so)
  // instead of drawing from it. A segment that cannot be read (corrupt,
  // another version, another user's) is unlinked as it is.
  static size_t remove(const std::string& name, bool force = false);
  // Names of the budgets on this machine.
  static std::vector<std::string> names();
  // Removes what creators killed half-way left (budget::Segment::remove_leftovers).
  static std::vector<std::string> remove_leftovers();

  // Empty while the budget can be used; otherwise why not (its segment was
  // truncated or overwritten, or it was removed by force). Never throws.
  std::string unusable_reason() const noexcept;
  // Throws BudgetError when the segment was truncated or overwritten.
  void check_intact() const;
  // Blocks until something that may let a refused grant fit happens (a
  // release, a member leaving or dropped, a limit change, a removal) after
  // the budget's release count was `seen`, or `timeout_s` seconds pass.
  // Returns whether the count moved. A futex in the segment: no CPU spent.
  bool wait_for_release(uint32_t seen, double timeout_s);

  const std::string& name() const { return segment_.name(); }
  std::string device() const { return segment_.device(); }
  uint32_t max_members() const { return segment_.max_members(); }
  double lock_timeout_s() const { return static_cast<double>(lock_timeout_ns_) / 1e9; }
  // Lock-free reads, for polling.
  uint64_t limit_bytes() const { return segment_.header()->limit_bytes.load(std::memory_order_acquire); }
  uint64_t held_bytes() const { return segment_.header()->held_bytes.load(std::memory_order_acquire); }
  // What a grant could get now (0 above a lowered limit): what a framework's
  // scheduler may count on, beside its own free blocks.
  uint64_t available_bytes() const {
    const uint64_t limit = limit_bytes(), held = held_bytes();
    return held < limit ? limit - held : 0;
  }

  // Sets the limit. Lowering it below what members hold refuses grants and
  // makes members' pressure() positive until they release enough.
  void set_limit(uint64_t limit_bytes);
  // A snapshot of every live member (dead ones are dropped first).
  BudgetUsage usage();
  // Adds a member labelled `label` (1-47 printable ASCII characters).
  // BudgetError when the member table is full of live members.
  std::shared_ptr<BudgetMember> join(const std::string& label);

 private:
  friend class BudgetMember;
  class Locked;

  Budget(budget::Segment segment, double lock_timeout_s);

  // Under the lock: validates every entry, expires old waits, recomputes the
  // header's sums and, when forced or kLivenessIntervalSeconds have passed
  // since anyone's last check, drops the members whose process is gone.
  // Returns whether it checked liveness.
  bool refresh_locked(bool force_liveness, bool allow_removed = false);
  bool member_alive_locked(uint32_t entry_index, const budget::Entry& e, const budget::ProcessIdentity& self);
  void bump_epoch_locked();
  size_t mark_removed(bool force);
  const budget::ProcessIdentity& self_locked();
  budget::Entry& entry_locked(const BudgetMember& member);

  bool try_grant(const BudgetMember& member, uint64_t bytes, bool record_wait);
  void release(const BudgetMember& member, uint64_t bytes);
  void report(const BudgetMember& member, uint64_t in_use_bytes, uint64_t free_held_bytes);
  // BudgetError unless `member` was joined by this process (not inherited through fork).
  void check_owner(const BudgetMember& member) const;
  uint64_t pressure(const BudgetMember& member);
  void clear_wait(const BudgetMember& member);
  void leave(const BudgetMember& member) noexcept;

  budget::Segment segment_;
  int64_t lock_timeout_ns_;
  budget::ProcessIdentity self_;  // this process; refreshed under the lock after a fork
};

// One member's share of a budget. Leaves the budget when destroyed (not in a
// process that inherited it through fork: the entry is the parent's).
class BudgetMember {
 public:
  BudgetMember(const BudgetMember&) = delete;
  BudgetMember& operator=(const BudgetMember&) = delete;
  ~BudgetMember();

  // Grants `bytes` if the budget's total stays within the limit; otherwise
  // records that this member waits for `bytes` (unless !record_wait: a
  // speculative ask, which should not make others give memory back) and
  // returns false.
  bool try_grant(uint64_t bytes, bool record_wait = true);
  // Returns `bytes` of this member's held bytes to the budget
  // (std::invalid_argument above what it holds).
  void release(uint64_t bytes);
  // The split of what this member holds: bytes under requests and free bytes
  // kept for reuse (std::invalid_argument if their sum exceeds held_bytes()).
  void report(uint64_t in_use_bytes, uint64_t free_held_bytes);
  // Bytes a member holding free pages should give back now: what the other
  // members wait for plus how far the total sits above the limit, minus what
  // is free within the limit. Lock-free when it is 0, exact (under the lock)
  // otherwise: cheap to poll.
  uint64_t pressure();
  // Lock-free and possibly stale: whether any member waits or the total sits
  // above the limit (this member's own wait included). A page manager makes
  // no speculative pages while it is true.
  bool contended() const;
  // This member no longer waits (its caller gave up on the refused grant).
  void clear_wait();
  // After a refused try_grant: blocks until memory may have come free (see
  // Budget::wait_for_release) or `timeout_s` seconds pass. Returns whether
  // something changed since the refusal. Costs no CPU while it waits.
  bool wait_for_memory(double timeout_s);
  // Makes the next wait_for_memory wait for what happens from now on: after
  // a failure that was not the budget's refusal (the device out of memory),
  // whose own uncharge moved the release count.
  void rearm_wait();
  // Leaves the budget, returning everything held. Idempotent.
  void leave();

  uint64_t held_bytes() const;
  uint64_t id() const { return generation_; }
  const std::string& label() const { return label_; }
  const std::shared_ptr<Budget>& budget() const { return budget_; }

 private:
  friend class Budget;
  BudgetMember(std::shared_ptr<Budget> budget, uint32_t entry_index, uint64_t generation, int32_t pid, std::string label)
      : budget_(std::move(budget)), entry_index_(entry_index), generation_(generation), owner_pid_(pid), label_(std::move(label)) {}

  std::shared_ptr<Budget> budget_;
  uint32_t entry_index_;
  uint64_t generation_;
  int32_t owner_pid_;
  std::string label_;
  std::atomic<bool> left_{false};
  mutable std::atomic<uint32_t> refused_epoch_{0};  // the budget's release count at the last refusal
};

}  // namespace vattn
