// The page manager's decisions, as pure functions of a const page table and
// the policy options: which free reqid a new request gets, which pages of free
// reqids go back to the pool, and what the background mapper does next. They
// change nothing; the page manager carries their plans out.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <string>

#include "core/page_geometry.h"
#include "core/page_table.h"
#include "core/policy_knobs.h"

namespace vattn {

// The knobs of core/policy_knobs.h, each with its default and doc there.
struct PolicyConfig {
#define VATTN_POLICY_FIELD(type, name, value, range, doc) type name = value;
  VATTN_POLICY_KNOBS(VATTN_POLICY_FIELD)
#undef VATTN_POLICY_FIELD
};

// A knob's accepted values (core/policy_knobs.h).
enum class KnobRange { Bool, Tokens, Fraction, Count };

// Token knobs checked without a request length: any count a request could hold.
constexpr size_t kAnyTokens = SIZE_MAX;

// "[0, 4096] (max_context_len)": what `range` accepts, for error messages and
// docs. max_tokens bounds Tokens (kAnyTokens: unknown yet, said in words).
std::string knob_range_text(KnobRange range, size_t max_tokens);

// Throws std::invalid_argument "<name> must be in <range>, got <value>"
// unless `value` is in `range`. Integers arrive signed (the bindings check
// before they narrow) or as the field's size_t.
void check_knob(const char* name, KnobRange range, bool value, size_t max_tokens);
void check_knob(const char* name, KnobRange range, int64_t value, size_t max_tokens);
void check_knob(const char* name, KnobRange range, size_t value, size_t max_tokens);
void check_knob(const char* name, KnobRange range, double value, size_t max_tokens);

// Throws std::invalid_argument naming the first knob outside its range;
// max_tokens (the requests' max_context_len) bounds the token knobs.
void validate_policy(const PolicyConfig& policy, size_t max_tokens);

// The free reqid a new request gets, or -1 when none is free. want_positions
// < 0: the one with the most positions mapped; else the one with the fewest
// positions that still covers want_positions, else the one with the most.
// Ties go to the lowest reqid.
int64_t best_free_reqid(const PageTable& table, int64_t want_positions);

// The free reqid with the fewest positions mapped (a fork's destination: all
// it maps is replaced), or -1 when none is free. Ties go to the lowest reqid.
int64_t emptiest_free_reqid(const PageTable& table);

// Free reqids' tails to unmap so that up to `want_ids` ids return to the pool.
struct ReclaimPlan {
  std::vector<std::pair<size_t, size_t>> cuts;  // (reqid, positions kept)
  size_t freed_ids = 0;  // ids whose last reference the cuts remove
};
// Victims are free reqids with positions mapped, never keep_reqid, smallest
// first (the largest are what best_free_reqid hands out next), each cut from
// its tail; at most `max_positions` positions in all. Empty with external ids.
ReclaimPlan plan_reclaim(const PageTable& table, size_t want_ids, int64_t keep_reqid, size_t max_positions);

// Positions reqid s should have mapped ahead of its next step: its last
// stepped length plus lookahead_tokens (at most max_tokens). Inline: step()
// asks it for every active reqid on its fast path.
inline size_t lookahead_positions(const PageTable& table, const PageGeometry& geometry, const PolicyConfig& policy,
                                  size_t reqid) {
  size_t tokens = static_cast<size_t>(table.tokens(reqid)) + policy.lookahead_tokens;  // both <= max_tokens
  return geometry.positions_for_tokens(static_cast<int64_t>(std::min(tokens, geometry.max_tokens)));
}

// The background mapper's next round, one kind at a time in this order:
//   reclaim: free reqids' tails to unmap, when the pool is below the floor;
//   grow:    positions to map, lookahead of active reqids then the eager reqid
//            (speculative only);
//   create:  uncreated ids to create into the pool (one per active reqid;
//            speculative only);
//   idle:    nothing to do.
// What the mapper may create beyond the page table's own pool: a budget's
// room now, and whether pages nobody asked for yet are welcome.
struct MapperLimits {
  size_t creatable_ids = SIZE_MAX;  // uncreated ids a plan may use (0 after a creation was refused)
  bool speculative = true;          // eager pages and created spares (false under budget contention, after idle release)
};
struct MapperPlan {
  enum class Kind { kIdle, kReclaim, kGrow, kCreate };
  Kind kind = Kind::kIdle;
  std::vector<std::pair<size_t, size_t>> reclaim;  // (reqid, positions kept)
  std::vector<std::pair<size_t, size_t>> grows;    // (reqid, positions to add)
  size_t create_ids = 0;                           // uncreated ids to create
};
MapperPlan plan_mapper_round(const PageTable& table, const PageGeometry& geometry, const PolicyConfig& policy,
                             size_t reclaim_floor_ids, const MapperLimits& limits = MapperLimits{});

}  // namespace vattn
