#include "budget/budget.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <stdexcept>

// pthread_mutex_clocklock (glibc 2.30+) waits on CLOCK_MONOTONIC.
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
#define VATTN_HAVE_CLOCKLOCK 1
#else
#define VATTN_HAVE_CLOCKLOCK 0
#endif

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

}  // namespace

// Holds the budget's robust, process-shared mutex for one operation.
class Budget::Locked {
 public:
  explicit Locked(Budget& b) : header_(b.segment_.header()), mutex_(&b.segment_.header()->mutex) {
    // A bounded wait: a stopped or stuck holder gives an error, not a hang.
#if VATTN_HAVE_CLOCKLOCK
    constexpr clockid_t kClock = CLOCK_MONOTONIC;  // immune to wall-clock steps
#else
    constexpr clockid_t kClock = CLOCK_REALTIME;   // what pthread_mutex_timedlock measures
#endif
    timespec deadline;
    clock_gettime(kClock, &deadline);
    const int64_t ns = deadline.tv_nsec + b.lock_timeout_ns_ % 1000000000;
    deadline.tv_sec += static_cast<time_t>(b.lock_timeout_ns_ / 1000000000 + ns / 1000000000);
    deadline.tv_nsec = static_cast<long>(ns % 1000000000);
#if VATTN_HAVE_CLOCKLOCK
    int rc = pthread_mutex_clocklock(mutex_, kClock, &deadline);
#else
    int rc = pthread_mutex_timedlock(mutex_, &deadline);
#endif
    if (rc == ETIMEDOUT) {
      const int32_t holder = header_->lock_holder_pid.load();
      throw BudgetError(quoted(b.name()) + ": its lock has been held for over " + seconds_text(b.lock_timeout_s()) +
                        " s by pid " + std::to_string(holder) + " (a stopped or stuck process?); operations hold it " +
                        "for microseconds: resume or end that process");
    }
    if (rc == EOWNERDEAD) {
      owner_died_ = true;
      // A holder died inside an operation. Everything the lock guards is
      // rebuilt from the entries by refresh_locked(), which every operation
      // runs next (and which drops the dead holder's entry), so the state can
      // be declared consistent at once.
      rc = pthread_mutex_consistent(mutex_);
      if (rc != 0) {
        pthread_mutex_unlock(mutex_);
        throw BudgetError(quoted(b.name()) + ": pthread_mutex_consistent failed: " + std::strerror(rc));
      }
    } else if (rc == ENOTRECOVERABLE) {
      throw BudgetError(quoted(b.name()) + ": its lock is unrecoverable (a holder died and the next one did not " +
                        "repair it): stop the processes using it, remove it with `python -m vattn budget rm " +
                        b.name() + "` and create it again");
    } else if (rc != 0) {
      throw BudgetError(quoted(b.name()) + ": pthread_mutex_lock failed: " + std::strerror(rc) + " (errno " +
                        std::to_string(rc) + ")");
    }
    header_->lock_holder_pid.store(static_cast<int32_t>(getpid()));
  }
  ~Locked() {
    header_->lock_holder_pid.store(0);
    pthread_mutex_unlock(mutex_);
  }
  Locked(const Locked&) = delete;
  Locked& operator=(const Locked&) = delete;

  // The previous holder died inside the lock: check every member now.
  bool owner_died() const { return owner_died_; }

 private:
  budget::Header* header_;
  pthread_mutex_t* mutex_;
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

void Budget::remove(const std::string& name) { budget::Segment::remove(name); }

std::vector<std::string> Budget::names() { return budget::Segment::list(); }

const budget::ProcessIdentity& Budget::self_locked() {
  if (self_.pid != static_cast<int32_t>(getpid())) self_ = budget::current_process();
  return self_;
}

bool Budget::refresh_locked(bool force_liveness) {
  Header* h = segment_.header();
  const budget::ProcessIdentity& self = self_locked();
  const uint64_t now = budget::monotonic_ns();
  const uint64_t last = h->last_sweep_ns.load();
  const bool liveness = force_liveness || now < last || now - last >= kLivenessIntervalNs;
  uint64_t held = 0;
  uint64_t waiting = 0;
  for (uint32_t i = 0; i < segment_.max_members(); ++i) {
    Entry& e = *segment_.entry(i);
    const uint32_t state = e.state.load(std::memory_order_acquire);
    if (state == kEntryFree) continue;
    if (state != kEntryLive)
      budget::throw_corrupt(name(), "member entry " + std::to_string(i) + " has state " + std::to_string(state));
    if (liveness && !budget::is_alive({e.pid, e.start_ticks, e.pid_namespace}, self)) {
      clear_entry(e);  // its process is gone: its share returns now
      continue;
    }
    if (e.waiting_bytes.load() && now - e.wait_renewed_ns > kWaitExpiryNs) e.waiting_bytes.store(0);
    if (!add(held, e.held_bytes.load(), &held) || !add(waiting, e.waiting_bytes.load(), &waiting))
      budget::throw_corrupt(name(), "the members' byte counts overflow 64 bits");
  }
  h->held_bytes.store(held, std::memory_order_release);
  h->waiting_bytes.store(waiting, std::memory_order_release);
  if (liveness) h->last_sweep_ns.store(now, std::memory_order_release);
  return liveness;
}

Entry& Budget::entry_locked(const BudgetMember& member) {
  if (member.owner_pid_ != static_cast<int32_t>(getpid()))
    throw BudgetError(quoted(name()) + ": member '" + member.label_ + "' belongs to process " +
                      std::to_string(member.owner_pid_) + " (inherited through fork): join the budget in this process");
  Entry& e = *segment_.entry(member.slot_);
  if (member.left_.load() || e.state.load(std::memory_order_acquire) != kEntryLive ||
      e.generation != member.generation_)
    throw BudgetError(quoted(name()) + ": member '" + member.label_ + "' (pid " + std::to_string(member.owner_pid_) +
                      ") is no longer in the budget: it left, or its entry was dropped (was the budget removed " +
                      "and created again?); join again");
  return e;
}

void Budget::set_limit(uint64_t limit_bytes) {
  Locked lock(*this);
  refresh_locked(lock.owner_died());
  segment_.header()->limit_bytes.store(limit_bytes, std::memory_order_release);
}

BudgetUsage Budget::usage() {
  BudgetUsage u;
  u.name = name();
  u.device = device();
  u.max_members = max_members();
  Locked lock(*this);
  refresh_locked(true);  // a snapshot shows no dead member
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
    h->held_bytes.store(held + bytes, std::memory_order_release);
    h->waiting_bytes.store(h->waiting_bytes.load() - had_waiting, std::memory_order_release);
    return true;
  }
  if (!record_wait) return false;
  const uint64_t now = budget::monotonic_ns();
  if (!had_waiting) e.wait_since_ns = now;
  e.wait_renewed_ns = now;
  e.waiting_bytes.store(bytes);
  h->waiting_bytes.store(h->waiting_bytes.load() - had_waiting + bytes, std::memory_order_release);
  return false;
}

void Budget::release(const BudgetMember& member, uint64_t bytes) {
  Locked lock(*this);
  refresh_locked(lock.owner_died());
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
  const Header* h = segment_.header();
  const Entry& own = *segment_.entry(member.slot_);
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
  refresh_locked(lock.owner_died());
  Entry& e = entry_locked(member);
  Header* h = segment_.header();
  h->waiting_bytes.store(h->waiting_bytes.load() - e.waiting_bytes.load(), std::memory_order_release);
  e.waiting_bytes.store(0);
}

void Budget::leave(const BudgetMember& member) noexcept {
  try {
    Locked lock(*this);
    refresh_locked(lock.owner_died());
    Entry& e = *segment_.entry(member.slot_);
    if (e.state.load(std::memory_order_acquire) == kEntryLive && e.generation == member.generation_) {
      clear_entry(e);
      refresh_locked(false);  // the header's sums without it
    }
  } catch (...) {
    // A corrupt or unrecoverable segment: nothing to give back to.
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

void BudgetMember::leave() {
  if (owner_pid_ != static_cast<int32_t>(getpid()))
    throw BudgetError(quoted(budget_->name()) + ": member '" + label_ + "' belongs to process " +
                      std::to_string(owner_pid_) + " (inherited through fork): it cannot leave from here");
  if (left_.exchange(true)) return;
  budget_->leave(*this);
}

uint64_t BudgetMember::held_bytes() const {
  const Entry& e = *budget_->segment_.entry(slot_);
  if (left_.load() || e.state.load(std::memory_order_acquire) != kEntryLive || e.generation != generation_) return 0;
  return e.held_bytes.load(std::memory_order_acquire);
}

}  // namespace vattn
