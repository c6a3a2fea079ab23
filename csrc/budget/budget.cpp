#include "budget/budget.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

namespace vattn {

using budget::Entry;
using budget::Header;
using budget::kEntryFree;
using budget::kEntryLive;

namespace {

constexpr uint64_t kWaitExpiryNs = static_cast<uint64_t>(Budget::kWaitExpirySeconds * 1e9);
constexpr uint64_t kLivenessIntervalNs = static_cast<uint64_t>(Budget::kLivenessIntervalSeconds * 1e9);

std::string quoted(const std::string& name) { return "budget '" + name + "'"; }

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", s);
  return buf;
}

void check_lock_timeout(double seconds) {
  if (!(seconds > 0 && seconds <= 3600))
    throw std::invalid_argument("lock_timeout_s must be in (0, 3600] seconds, got " + seconds_text(seconds));
}

// Frees an entry: the state goes first, so a process dying half-way leaves a
// free entry with stale fields (ignored), never a live one with wrong fields.
void clear_entry(Entry& e) {
  e.state.store(kEntryFree, std::memory_order_release);
  e.pid = 0;
  e.start_ticks = 0;
  e.pid_namespace = 0;
  e.generation = 0;
  e.held_bytes.store(0);
  e.in_use_bytes.store(0);
  e.free_held_bytes.store(0);
  e.waiting_bytes.store(0);
  e.wait_since_ns = 0;
  e.wait_renewed_ns = 0;
  e.joined_unix_ns = 0;
  std::memset(e.label, 0, sizeof(e.label));
}

void check_label(const std::string& label) {
  bool ok = !label.empty() && label.size() < budget::kLabelChars;
  for (char c : label) ok = ok && c >= ' ' && c <= '~';
  if (!ok)
    throw std::invalid_argument("budget member label '" + label + "' is invalid: 1-" +
                                std::to_string(budget::kLabelChars - 1) + " printable ASCII characters");
}

// a + b, or false on overflow (a corrupt entry could hold anything).
bool add(uint64_t a, uint64_t b, uint64_t* sum) { return !__builtin_add_overflow(a, b, sum); }

// What members holding free pages should give back: the total above the
// limit once the other members' waits are added.
uint64_t needed_bytes(uint64_t held, uint64_t others_waiting, uint64_t limit) {
  uint64_t demand = 0;
  if (!add(held, others_waiting, &demand)) return UINT64_MAX;
  return demand > limit ? demand - limit : 0;
}

[[noreturn]] void throw_unusable(const std::string& name, const std::string& why) {
  throw BudgetCorrupt(quoted(name) + " (" + budget::path_of(name) + ") cannot be used: " + why + ". This process " +
                    "keeps the memory it holds; stop the processes using the budget, remove it with `python -m " +
                    "vattn budget rm " + name + "` and create it again");
}

[[noreturn]] void throw_removed(const std::string& name) {
  throw BudgetError(quoted(name) + " was removed (`python -m vattn budget rm --force " + name + "`) while this " +
                    "process used it: it grants nothing more; create it again to share memory again");
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex is a plain 32-bit word");
  // Not FUTEX_PRIVATE_FLAG: the word is shared with other processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

}  // namespace

// Holds the budget's lock for one operation. The lock is an open-file-
// description write lock on byte kLockByte of the segment's file: the kernel
// keeps it, so no byte of the segment (which every process of the user can
// write) can wedge or abort a locker, as crafted bytes of a pthread mutex in
// the segment could (a robust + priority-inheritance kind with a dead owner
// trips a glibc assertion); a holder's death releases it whatever its pid
// namespace. A description is shared by the threads of a process, so a
// per-mapping mutex orders them first. The kernel has no timed wait for it:
// the lock is polled with a pause that grows to 1 ms (operations hold it for
// microseconds), up to lock_timeout_s. Whether a holder died inside is told by
// LockState::dirty, set while held: 1 when taken means the previous holder
// never finished, and the next operation checks every member at once.
class Budget::Locked {
 public:
  explicit Locked(Budget& b) : segment_(b.segment_), header_(b.segment_.header()) {
    if (!segment_.usable_in_this_process())
      throw BudgetError(quoted(b.name()) + ": this process was forked from the one that opened it, and the " +
                        "budget's file could not be opened again here (is /proc mounted?): attach it again");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(b.lock_timeout_ns_);
    mutex_ = &segment_.process_mutex();
    if (!mutex_->try_lock_until(deadline)) timed_out(b);
    try {
      auto pause = std::chrono::microseconds(20);
      while (!segment_.try_lock_byte(budget::kLockByte)) {
        const auto now = std::chrono::steady_clock::now();
        if (now >= deadline) timed_out(b);
        std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(pause, deadline - now));
        pause = std::min(pause * 2, std::chrono::microseconds(1000));
      }
      file_locked_ = true;
      const std::string damage = segment_.damage();
      if (!damage.empty()) throw_unusable(b.name(), damage);
      const uint32_t dirty = header_->lock.dirty.load();
      if (dirty > 1)
        budget::throw_corrupt(b.name(), "the lock's state word is " + std::to_string(dirty) + ", expected 0 or 1");
      owner_died_ = dirty == 1;
      header_->lock.dirty.store(1);
      header_->lock.holder_pid.store(static_cast<int32_t>(getpid()));
    } catch (...) {
      unlock();
      throw;
    }
  }
  ~Locked() {
    header_->lock.holder_pid.store(0);
    header_->lock.dirty.store(0);
    unlock();
  }
  Locked(const Locked&) = delete;
  Locked& operator=(const Locked&) = delete;

  // The previous holder died inside the lock: check every member now.
  bool owner_died() const { return owner_died_; }

 private:
  [[noreturn]] void timed_out(Budget& b) {
    const int32_t holder = header_->lock.holder_pid.load();
    throw BudgetLockTimeout(quoted(b.name()) + ": its lock has been held for over " +
                            seconds_text(b.lock_timeout_s()) + " s by pid " + std::to_string(holder) +
                            " (a stopped or stuck process?); operations hold it for microseconds: resume or end "
                            "that process");
  }
  void unlock() noexcept {
    if (file_locked_) segment_.unlock_byte(budget::kLockByte);
    file_locked_ = false;
    if (mutex_) mutex_->unlock();
    mutex_ = nullptr;
  }

  const budget::Segment& segment_;
  budget::Header* header_;
  std::timed_mutex* mutex_ = nullptr;
  bool file_locked_ = false;
  bool owner_died_ = false;
};

Budget::Budget(budget::Segment segment, double lock_timeout_s)
    : segment_(std::move(segment)), lock_timeout_ns_(static_cast<int64_t>(lock_timeout_s * 1e9)) {}

std::shared_ptr<Budget> Budget::create(const std::string& name, uint64_t limit_bytes, const std::string& device,
                                       uint32_t max_members, double lock_timeout_s) {
  check_lock_timeout(lock_timeout_s);
  return std::shared_ptr<Budget>(
      new Budget(budget::Segment::create(name, limit_bytes, device, max_members), lock_timeout_s));
}

std::shared_ptr<Budget> Budget::attach(const std::string& name, double lock_timeout_s) {
  check_lock_timeout(lock_timeout_s);
  return std::shared_ptr<Budget>(new Budget(budget::Segment::open(name), lock_timeout_s));
}

size_t Budget::remove(const std::string& name, bool force) {
  budget::check_name(name);
  std::shared_ptr<Budget> budget;
  try {
    budget = attach(name);
  } catch (const BudgetSystemError&) {
    throw;  // this process could not open it (no descriptor or memory left): its members are not counted
  } catch (const BudgetError&) {
    // Missing: unlink says so. Unreadable (corrupt, another version or
    // user, already marked removed): nobody can use it, so it goes as it is.
    budget::Segment::unlink(name);
    return 0;
  }
  try {
    return budget->mark_removed(force);
  } catch (const BudgetCorrupt&) {
    budget::Segment::unlink(name);  // damaged under its members: its counts mean nothing
    return 0;
  }
}

size_t Budget::mark_removed(bool force) {
  Locked lock(*this);
  // The members counted below are this file's: the name must still be its name, not that of a budget
  // created under it after this one was removed by force meanwhile.
  if (segment_.header()->removed.load(std::memory_order_acquire) || !segment_.named_here())
    throw BudgetError(quoted(name()) + " was removed (and perhaps created again) while this removal ran: "
                      "run it again");
  refresh_locked(true, true);
  std::set<int32_t> pids;
  size_t members = 0;
  for (uint32_t i = 0; i < segment_.max_members(); ++i) {
    const Entry& e = *segment_.entry(i);
    if (e.state.load(std::memory_order_acquire) != kEntryLive) continue;
    ++members;
    pids.insert(e.pid);
  }
  if (members && !force) {
    std::string list;
    for (int32_t pid : pids) list += (list.empty() ? "" : ", ") + std::to_string(pid);
    throw BudgetError(quoted(name()) + " has " + std::to_string(members) + " live member" +
                      (members == 1 ? "" : "s") + " (pid " + list + "): removed now, they would go on charging " +
                      "a budget nobody else sees. Stop them first, or remove it anyway with `python -m vattn " +
                      "budget rm --force " + name() + "` (vattn.budget.remove(name, force=True)): its members " +
                      "are then refused new memory, with this reason");
  }
  // Marked first, so no member draws from it once it is gone from /dev/shm.
  segment_.header()->removed.store(1, std::memory_order_release);
  bump_epoch_locked();  // waiters wake up and learn it
  budget::Segment::unlink(name());
  return members;
}

std::vector<std::string> Budget::names() { return budget::Segment::list(); }

std::vector<std::string> Budget::remove_leftovers() { return budget::Segment::remove_leftovers(); }

std::string Budget::unusable_reason() const noexcept {
  try {
    std::string damage = segment_.damage();
    if (!damage.empty()) return damage;
    if (segment_.header()->removed.load(std::memory_order_acquire)) return "it was removed";
    return "";
  } catch (...) {
    return "its state cannot be read";
  }
}

void Budget::check_intact() const {
  const std::string damage = segment_.damage();
  if (!damage.empty()) throw_unusable(name(), damage);
}

bool Budget::wait_for_release(uint32_t seen, double timeout_s) {
  if (!(timeout_s >= 0 && timeout_s <= 3600))
    throw std::invalid_argument("timeout_s must be in [0, 3600] seconds, got " + seconds_text(timeout_s));
  if (!segment_.damage().empty()) return true;  // nothing to wait for: the next operation says why
  Header* h = segment_.header();
  if (h->release_epoch.load(std::memory_order_acquire) != seen) return true;
  timespec rel;
  rel.tv_sec = static_cast<time_t>(timeout_s);
  rel.tv_nsec = static_cast<long>((timeout_s - static_cast<double>(rel.tv_sec)) * 1e9);
  h->epoch_waiters.fetch_add(1);
  futex(&h->release_epoch, FUTEX_WAIT, seen, &rel);  // returns at once if the count moved meanwhile
  h->epoch_waiters.fetch_sub(1);
  return h->release_epoch.load(std::memory_order_acquire) != seen;
}

void Budget::bump_epoch_locked() {
  Header* h = segment_.header();
  h->release_epoch.fetch_add(1, std::memory_order_release);
  if (h->epoch_waiters.load(std::memory_order_acquire)) futex(&h->release_epoch, FUTEX_WAKE, INT_MAX, nullptr);
}

const budget::ProcessIdentity& Budget::self_locked() {
  if (self_.pid != static_cast<int32_t>(getpid())) self_ = budget::current_process();
  return self_;
}

bool Budget::member_alive_locked(uint32_t entry_index, const Entry& e, const budget::ProcessIdentity& self) {
  // The entry's file lock goes with the last descriptor of the member's
  // description: at exit, and at exec (close-on-exec), where pid and start
  // time stay the same although the old program's pages are gone.
  if (segment_.byte_locked_elsewhere(budget::member_byte(entry_index)) == 0) return false;
  return budget::is_alive({e.pid, e.start_ticks, e.pid_namespace}, self);
}

bool Budget::refresh_locked(bool force_liveness, bool allow_removed) {
  Header* h = segment_.header();
  if (!allow_removed && h->removed.load(std::memory_order_acquire)) throw_removed(name());
  const budget::ProcessIdentity& self = self_locked();
  const uint64_t now = budget::monotonic_ns();
  const uint64_t last = h->last_sweep_ns.load();
  const bool liveness = force_liveness || now < last || now - last >= kLivenessIntervalNs;
  uint64_t held = 0;
  uint64_t waiting = 0;
  bool dropped = false;
  for (uint32_t i = 0; i < segment_.max_members(); ++i) {
    Entry& e = *segment_.entry(i);
    const uint32_t state = e.state.load(std::memory_order_acquire);
    if (state == kEntryFree) continue;
    if (state != kEntryLive) {
      const std::string damage = segment_.damage();
      if (!damage.empty()) throw_unusable(name(), damage);
      budget::throw_corrupt(name(), "member entry " + std::to_string(i) + " has state " + std::to_string(state));
    }
    if (liveness && !member_alive_locked(i, e, self)) {
      dropped = dropped || e.held_bytes.load() != 0;
      clear_entry(e);  // its process is gone (or runs another program): its share returns now
      continue;
    }
    if (e.waiting_bytes.load() && now - e.wait_renewed_ns > kWaitExpiryNs) e.waiting_bytes.store(0);
    if (!add(held, e.held_bytes.load(), &held) || !add(waiting, e.waiting_bytes.load(), &waiting))
      budget::throw_corrupt(name(), "the members' byte counts overflow 64 bits");
  }
  h->held_bytes.store(held, std::memory_order_release);
  h->waiting_bytes.store(waiting, std::memory_order_release);
  if (liveness) h->last_sweep_ns.store(now, std::memory_order_release);
  if (dropped) bump_epoch_locked();
  return liveness;
}

void Budget::check_owner(const BudgetMember& member) const {
  if (member.owner_pid_ != static_cast<int32_t>(getpid()))
    throw BudgetError(quoted(name()) + ": member '" + member.label_ + "' belongs to process " +
                      std::to_string(member.owner_pid_) + " (inherited through fork): join the budget in this process");
}

Entry& Budget::entry_locked(const BudgetMember& member) {
  check_owner(member);
  Entry& e = *segment_.entry(member.entry_index_);
  if (member.left_.load() || e.state.load(std::memory_order_acquire) != kEntryLive ||
      e.generation != member.generation_) {
    // Truncated since the lock was taken: the entry reads as zeros; say that.
    const std::string damage = segment_.damage();
    if (!damage.empty()) throw_unusable(name(), damage);
    throw BudgetError(quoted(name()) + ": member '" + member.label_ + "' (pid " + std::to_string(member.owner_pid_) +
                      ") is no longer in the budget: it left, or its entry was dropped (was the budget removed " +
                      "and created again?); join again");
  }
  return e;
}

void Budget::set_limit(uint64_t limit_bytes) {
  Locked lock(*this);
  refresh_locked(lock.owner_died());
  segment_.header()->limit_bytes.store(limit_bytes, std::memory_order_release);
  bump_epoch_locked();
}

BudgetUsage Budget::usage() {
  BudgetUsage u;
  u.name = name();
  u.max_members = max_members();
  Locked lock(*this);
  refresh_locked(true);  // a snapshot shows no dead member
  u.device = device();
  const Header* h = segment_.header();
  const uint64_t now = budget::monotonic_ns();
  u.limit_bytes = h->limit_bytes.load();
  u.held_bytes = h->held_bytes.load();
  u.waiting_bytes = h->waiting_bytes.load();
  u.created_unix_seconds = static_cast<double>(h->created_unix_ns) / 1e9;
  for (uint32_t i = 0; i < segment_.max_members(); ++i) {
    const Entry& e = *segment_.entry(i);
    if (e.state.load(std::memory_order_acquire) != kEntryLive) continue;
    BudgetMemberUsage m;
    m.id = e.generation;
    m.pid = e.pid;
    m.label.assign(e.label, strnlen(e.label, sizeof(e.label)));
    for (char c : m.label)  // what leaves here becomes text (Python str, JSON): only what join allows
      if (c < ' ' || c > '~')
        budget::throw_corrupt(name(), "member entry " + std::to_string(i) + "'s label is not printable ASCII text");
    m.held_bytes = e.held_bytes.load();
    m.in_use_bytes = e.in_use_bytes.load();
    m.free_held_bytes = e.free_held_bytes.load();
    m.waiting_bytes = e.waiting_bytes.load();
    m.waiting_seconds = m.waiting_bytes ? static_cast<double>(now - std::min(now, e.wait_since_ns)) / 1e9 : 0.0;
    m.joined_unix_seconds = static_cast<double>(e.joined_unix_ns) / 1e9;
    u.in_use_bytes += m.in_use_bytes;  // no overflow: each is at most its held, whose sum was checked
    u.free_held_bytes += m.free_held_bytes;
    u.members.push_back(std::move(m));
  }
  std::sort(u.members.begin(), u.members.end(), [](const BudgetMemberUsage& a, const BudgetMemberUsage& b) {
    return a.pid != b.pid ? a.pid < b.pid : a.id < b.id;
  });
  return u;
}

std::shared_ptr<BudgetMember> Budget::join(const std::string& label) {
  check_label(label);
  Locked lock(*this);
  refresh_locked(true);  // dead members' entries are free again
  Header* h = segment_.header();
  for (uint32_t i = 0; i < segment_.max_members(); ++i) {
    Entry& e = *segment_.entry(i);
    if (e.state.load(std::memory_order_acquire) != kEntryFree) continue;
    // The entry's liveness lock: held by this process's description until the
    // member leaves, the process exits or execs. Held elsewhere: a process
    // whose entry was dropped still has it open; take another entry.
    if (!segment_.try_lock_byte(budget::member_byte(i))) continue;
    clear_entry(e);
    const budget::ProcessIdentity& self = self_locked();
    e.pid = self.pid;
    e.start_ticks = self.start_ticks;
    e.pid_namespace = self.pid_namespace;
    e.generation = h->next_generation.fetch_add(1);
    e.joined_unix_ns = budget::realtime_ns();
    std::strncpy(e.label, label.c_str(), sizeof(e.label) - 1);
    e.state.store(kEntryLive, std::memory_order_release);  // last: the entry is complete
    return std::shared_ptr<BudgetMember>(new BudgetMember(shared_from_this(), i, e.generation, self.pid, label));
  }
  throw BudgetError(quoted(name()) + ": its member table is full (" + std::to_string(segment_.max_members()) +
                    " live members): stop a process that uses it, or create it again with more members " +
                    "(vattn.Budget.create(..., max_members=N))");
}

bool Budget::try_grant(const BudgetMember& member, uint64_t bytes, bool record_wait) {
  Locked lock(*this);
  const bool checked = refresh_locked(lock.owner_died());
  Entry& e = entry_locked(member);
  if (bytes == 0) return true;
  Header* h = segment_.header();
  const uint64_t limit = h->limit_bytes.load();
  auto fits = [&] { return bytes <= limit && h->held_bytes.load() <= limit - bytes; };
  // Nobody is refused for a dead member's share: check liveness before saying no.
  if (!fits() && !checked) refresh_locked(true);
  const uint64_t held = h->held_bytes.load();
  const uint64_t had_waiting = e.waiting_bytes.load();
  if (fits()) {
    e.held_bytes.store(e.held_bytes.load() + bytes);
    e.waiting_bytes.store(0);
    // A grant of what was asked for ends the wait; an ask ahead of need that
    // fits does not: a refusal soon after continues the same wait (top's "for").
    if (record_wait) e.wait_renewed_ns = 0;
    h->held_bytes.store(held + bytes, std::memory_order_release);
    h->waiting_bytes.store(h->waiting_bytes.load() - had_waiting, std::memory_order_release);
    return true;
  }
  // What wait_for_memory() waits to see move: anything after this refusal.
  member.refused_epoch_.store(h->release_epoch.load(std::memory_order_acquire), std::memory_order_release);
  if (!record_wait) return false;
  const uint64_t now = budget::monotonic_ns();
  const bool continues = e.wait_renewed_ns != 0 && now - e.wait_renewed_ns <= kWaitExpiryNs;
  if (!had_waiting && !continues) e.wait_since_ns = now;
  e.wait_renewed_ns = now;
  e.waiting_bytes.store(bytes);
  h->waiting_bytes.store(h->waiting_bytes.load() - had_waiting + bytes, std::memory_order_release);
  return false;
}

void Budget::release(const BudgetMember& member, uint64_t bytes) {
  Locked lock(*this);
  refresh_locked(lock.owner_died(), true);  // giving back to a removed budget is no error
  Entry& e = entry_locked(member);
  const uint64_t held = e.held_bytes.load();
  if (bytes > held)
    throw std::invalid_argument("release: " + std::to_string(bytes) + " bytes exceed the " + std::to_string(held) +
                                " bytes member '" + member.label_ + "' holds in " + quoted(name()));
  e.held_bytes.store(held - bytes);
  // Until the next report the split must still fit in what is held: the
  // released bytes come out of the free part first.
  uint64_t free_held = e.free_held_bytes.load();
  uint64_t in_use = e.in_use_bytes.load();
  const uint64_t reported = free_held + in_use;
  if (reported > held - bytes) {
    uint64_t excess = reported - (held - bytes);
    const uint64_t from_free = std::min(excess, free_held);
    e.free_held_bytes.store(free_held - from_free);
    e.in_use_bytes.store(in_use - (excess - from_free));
  }
  Header* h = segment_.header();
  h->held_bytes.store(h->held_bytes.load() - bytes, std::memory_order_release);
  if (bytes) bump_epoch_locked();
}

void Budget::report(const BudgetMember& member, uint64_t in_use_bytes, uint64_t free_held_bytes) {
  Locked lock(*this);
  refresh_locked(lock.owner_died());
  Entry& e = entry_locked(member);
  const uint64_t held = e.held_bytes.load();
  uint64_t sum = 0;
  if (!add(in_use_bytes, free_held_bytes, &sum) || sum > held)
    throw std::invalid_argument("report: in_use_bytes + free_held_bytes = " + std::to_string(in_use_bytes) + " + " +
                                std::to_string(free_held_bytes) + " exceed the " + std::to_string(held) +
                                " bytes member '" + member.label_ + "' holds in " + quoted(name()));
  e.in_use_bytes.store(in_use_bytes);
  e.free_held_bytes.store(free_held_bytes);
}

uint64_t Budget::pressure(const BudgetMember& member) {
  check_owner(member);  // the lock-free answer below reads the entry: the parent's, in a forked child
  const Header* h = segment_.header();
  const Entry& own = *segment_.entry(member.entry_index_);
  if (h->removed.load(std::memory_order_acquire)) throw_removed(name());
  // Lock-free first: the header's sums are current after every grant and
  // release, so no pressure seen here means none to act on. A positive value
  // is recomputed under the lock (dead members and expired waits dropped).
  const uint64_t waiting = h->waiting_bytes.load(std::memory_order_acquire);
  const uint64_t own_waiting = std::min(waiting, own.waiting_bytes.load(std::memory_order_acquire));
  if (!needed_bytes(h->held_bytes.load(std::memory_order_acquire), waiting - own_waiting,
                    h->limit_bytes.load(std::memory_order_acquire)))
    return 0;
  Locked lock(*this);
  refresh_locked(lock.owner_died());
  const Entry& e = entry_locked(member);
  return needed_bytes(h->held_bytes.load(), h->waiting_bytes.load() - e.waiting_bytes.load(), h->limit_bytes.load());
}

void Budget::clear_wait(const BudgetMember& member) {
  Locked lock(*this);
  refresh_locked(lock.owner_died(), true);
  Entry& e = entry_locked(member);
  Header* h = segment_.header();
  h->waiting_bytes.store(h->waiting_bytes.load() - e.waiting_bytes.load(), std::memory_order_release);
  e.waiting_bytes.store(0);
  e.wait_renewed_ns = 0;  // given up: a later refusal starts a new wait
}

void Budget::leave(const BudgetMember& member) noexcept {
  try {
    Locked lock(*this);
    refresh_locked(lock.owner_died(), true);
    Entry& e = *segment_.entry(member.entry_index_);
    if (e.state.load(std::memory_order_acquire) == kEntryLive && e.generation == member.generation_) {
      const bool held = e.held_bytes.load() != 0;
      clear_entry(e);
      segment_.unlock_byte(budget::member_byte(member.entry_index_));
      refresh_locked(false, true);  // the header's sums without it
      if (held) bump_epoch_locked();
    }
  } catch (const BudgetLockTimeout&) {
    // A stuck holder: the entry cannot be cleared now. Its liveness lock goes instead, so the next
    // operation that checks liveness drops it as a dead member's, with its bytes.
    segment_.unlock_byte(budget::member_byte(member.entry_index_));
  } catch (...) {
    // A corrupt or truncated segment: nothing to give back to.
  }
}

// ---- BudgetMember -----------------------------------------------------------

BudgetMember::~BudgetMember() {
  if (owner_pid_ == static_cast<int32_t>(getpid())) leave();
}

bool BudgetMember::try_grant(uint64_t bytes, bool record_wait) {
  return budget_->try_grant(*this, bytes, record_wait);
}
void BudgetMember::release(uint64_t bytes) { budget_->release(*this, bytes); }
void BudgetMember::report(uint64_t in_use_bytes, uint64_t free_held_bytes) {
  budget_->report(*this, in_use_bytes, free_held_bytes);
}
uint64_t BudgetMember::pressure() { return budget_->pressure(*this); }

bool BudgetMember::contended() const {
  const budget::Header* h = budget_->segment_.header();
  return h->waiting_bytes.load(std::memory_order_acquire) != 0 ||
         h->held_bytes.load(std::memory_order_acquire) > h->limit_bytes.load(std::memory_order_acquire);
}
void BudgetMember::clear_wait() { budget_->clear_wait(*this); }

bool BudgetMember::wait_for_memory(double timeout_s) {
  budget_->check_owner(*this);
  return budget_->wait_for_release(refused_epoch_.load(std::memory_order_acquire), timeout_s);
}

void BudgetMember::rearm_wait() {
  refused_epoch_.store(budget_->segment_.header()->release_epoch.load(std::memory_order_acquire),
                       std::memory_order_release);
}

void BudgetMember::leave() {
  if (owner_pid_ != static_cast<int32_t>(getpid()))
    throw BudgetError(quoted(budget_->name()) + ": member '" + label_ + "' belongs to process " +
                      std::to_string(owner_pid_) + " (inherited through fork): it cannot leave from here");
  if (left_.exchange(true)) return;
  budget_->leave(*this);
}

uint64_t BudgetMember::held_bytes() const {
  budget_->check_owner(*this);
  const Entry& e = *budget_->segment_.entry(entry_index_);
  if (left_.load() || e.state.load(std::memory_order_acquire) != kEntryLive || e.generation != generation_) return 0;
  return e.held_bytes.load(std::memory_order_acquire);
}

}  // namespace vattn
