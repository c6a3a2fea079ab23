#include "core/policy.h"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <unordered_map>

namespace vattn {

namespace {

constexpr size_t kMaxCount = UINT32_MAX;  // page ids are uint32

// Which ranges each field type can hold: a knob's entry must pair them so.
template <class T>
constexpr bool range_fits(KnobRange range) {
  if constexpr (std::is_same_v<T, bool>) return range == KnobRange::Bool;
  if constexpr (std::is_floating_point_v<T>) return range == KnobRange::Fraction;
  return range == KnobRange::Tokens || range == KnobRange::Count;
}
#define VATTN_POLICY_FITS(type, name, value, range, doc) \
  static_assert(range_fits<type>(KnobRange::range), #name ": its range does not fit its type");
VATTN_POLICY_KNOBS(VATTN_POLICY_FITS)
#undef VATTN_POLICY_FITS

template <class T>
[[noreturn]] void out_of_range(const char* name, KnobRange range, T value, size_t max_tokens) {
  std::ostringstream got;
  got << value;
  throw std::invalid_argument(std::string(name) + " must be in " + knob_range_text(range, max_tokens) + ", got " +
                              got.str());
}

}  // namespace

std::string knob_range_text(KnobRange range, size_t max_tokens) {
  switch (range) {
    case KnobRange::Bool: return "True or False";
    case KnobRange::Tokens:
      return max_tokens == kAnyTokens ? "[0, max_context_len] (tokens)"
                                      : "[0, " + std::to_string(max_tokens) + "] (max_context_len)";
    case KnobRange::Fraction: return "[0, 1]";
    case KnobRange::Count: break;
  }
  return "[1, " + std::to_string(kMaxCount) + "]";
}

void check_knob(const char*, KnobRange, bool, size_t) {}  // every bool is in range

void check_knob(const char* name, KnobRange range, int64_t value, size_t max_tokens) {
  if (value < 0) out_of_range(name, range, value, max_tokens);
  check_knob(name, range, static_cast<size_t>(value), max_tokens);
}

void check_knob(const char* name, KnobRange range, size_t value, size_t max_tokens) {
  const bool ok = range == KnobRange::Tokens ? value <= max_tokens && value <= static_cast<size_t>(INT64_MAX)
                                             : range == KnobRange::Count && value >= 1 && value <= kMaxCount;
  if (!ok) out_of_range(name, range, value, max_tokens);
}

void check_knob(const char* name, KnobRange range, double value, size_t max_tokens) {
  const bool ok = range == KnobRange::Fraction && value >= 0.0 && value <= 1.0;  // NaN fails
  if (!ok) out_of_range(name, range, value, max_tokens);
}

void validate_policy(const PolicyConfig& policy, size_t max_tokens) {
#define VATTN_POLICY_CHECK(type, name, value, range, doc) \
  check_knob(#name, KnobRange::range, policy.name, max_tokens);
  VATTN_POLICY_KNOBS(VATTN_POLICY_CHECK)
#undef VATTN_POLICY_CHECK
}

int64_t best_free_reqid(const PageTable& table, int64_t want_positions) {
  const size_t want = want_positions < 0 ? 0 : static_cast<size_t>(want_positions);
  int64_t best = -1;
  size_t best_pages = 0;
  for (size_t s = 0; s < table.num_reqids(); ++s) {
    if (table.allocated(s)) continue;
    size_t pages = table.mapped(s);
    bool better;
    if (best < 0) {
      better = true;
    } else if (want_positions < 0) {
      better = pages > best_pages;  // most pages mapped
    } else if (best_pages >= want) {
      better = pages >= want && pages < best_pages;  // smallest that covers the prompt
    } else {
      better = pages > best_pages;  // nothing covers yet: the largest
    }
    if (better) {
      best = static_cast<int64_t>(s);
      best_pages = pages;
    }
  }
  return best;
}

int64_t emptiest_free_reqid(const PageTable& table) {
  int64_t dst = -1;
  for (size_t s = 0; s < table.num_reqids(); ++s)
    if (!table.allocated(s) && (dst < 0 || table.mapped(s) < table.mapped(static_cast<size_t>(dst))))
      dst = static_cast<int64_t>(s);
  return dst;
}

ReclaimPlan plan_reclaim(const PageTable& table, size_t want_ids, int64_t keep_reqid, size_t max_positions) {
  ReclaimPlan plan;
  if (want_ids == 0 || table.external_ids()) return plan;
  std::vector<size_t> victims;
  for (size_t s = 0; s < table.num_reqids(); ++s)
    if (!table.allocated(s) && table.mapped(s) > 0 && static_cast<int64_t>(s) != keep_reqid) victims.push_back(s);
  // Smallest reqids first: the big ones are what alloc_reqid hands out next.
  std::stable_sort(victims.begin(), victims.end(),
                   [&](size_t a, size_t b) { return table.mapped(a) < table.mapped(b); });
  std::unordered_map<uint32_t, uint32_t> cut_refs;  // references the plan removes, per id
  size_t positions = 0;
  for (size_t s : victims) {
    if (plan.freed_ids >= want_ids || positions >= max_positions) break;
    size_t keep = table.mapped(s);
    while (keep > 0 && plan.freed_ids < want_ids && positions < max_positions) {
      uint32_t id = table.ids(s)[--keep];
      // An id returns to the pool once the plan cut every mapping of it and no handle holds it.
      if (++cut_refs[id] == table.maps(id) && table.holds(id) == 0) ++plan.freed_ids;
      ++positions;
    }
    plan.cuts.emplace_back(s, keep);
  }
  return plan;
}

MapperPlan plan_mapper_round(const PageTable& table, const PageGeometry& geometry, const PolicyConfig& policy,
                             size_t reclaim_floor_ids, const MapperLimits& limits) {
  MapperPlan plan;
  const size_t available = table.available();
  const size_t creatable = std::min(table.uncreated().size(), limits.creatable_ids);
  const size_t usable = table.free_ids().size() + creatable;  // what grows may claim
  const int64_t eager_reqid = policy.eager && limits.speculative ? best_free_reqid(table, -1) : -1;
  // 1. Deferred reclamation: keep free reqids' pages until the pool runs low.
  if (policy.deferred_reclaim && available < reclaim_floor_ids) {
    ReclaimPlan reclaim = plan_reclaim(table, reclaim_floor_ids - available, eager_reqid, policy.max_round_ids);
    if (!reclaim.cuts.empty()) {
      plan.kind = MapperPlan::Kind::kReclaim;
      plan.reclaim = std::move(reclaim.cuts);
      return plan;
    }
  }
  // 2. Lookahead for active reqids, then 3. the eager reqid, within the budget.
  const size_t budget = std::min(policy.max_round_ids, usable);
  size_t planned = 0;
  auto grow = [&](size_t s, size_t target, size_t limit) {
    size_t have = table.mapped(s);
    if (target <= have || planned >= limit || table.orphans_of(s)) return;
    size_t add = std::min(target - have, limit - planned);
    plan.grows.emplace_back(s, add);
    planned += add;
  };
  for (size_t s = 0; s < table.num_reqids(); ++s)
    if (table.allocated(s) && table.tokens(s) > 0) grow(s, lookahead_positions(table, geometry, policy, s), budget);
  if (eager_reqid >= 0) {
    const size_t eager = static_cast<size_t>(eager_reqid);
    // A reqid whose pages are shared is trimmed before it is handed out: not
    // worth growing now.
    if (table.first_shared(eager) == table.mapped(eager)) {
      // Eager pages are speculative: they never eat into the reclaim floor.
      size_t spare = usable - planned;  // planned <= budget <= usable
      size_t above_floor = spare > reclaim_floor_ids ? spare - reclaim_floor_ids : 0;
      grow(eager, geometry.positions_for_tokens(static_cast<int64_t>(policy.eager_tokens)),
           std::min(budget, planned + above_floor));
    }
  }
  if (planned > 0) {
    plan.kind = MapperPlan::Kind::kGrow;
    return plan;
  }
  // 4. Keep one created page id per active request in the free pool: the
  // next page-crossing wave then only maps. Creation needs no address, so it
  // can run while steps proceed.
  size_t active = 0;
  for (size_t s = 0; s < table.num_reqids(); ++s) active += table.allocated(s);
  const size_t free_ids = table.free_ids().size(), uncreated = table.uncreated().size();
  if (limits.speculative && free_ids < active && uncreated > 0 && creatable > 0) {
    plan.kind = MapperPlan::Kind::kCreate;
    plan.create_ids = std::min({active - free_ids, uncreated, creatable, policy.max_round_ids});
  }
  return plan;
}

}  // namespace vattn
