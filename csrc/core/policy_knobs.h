// The page manager's policy knobs, described once. Each entry below generates
// a field of PolicyConfig (core/policy.h), its range check
// (validate_policy), its property of vattn._C.PolicyConfig and its row of
// vattn._C.POLICY_KNOBS, from which vattn/core/policy.py converts and checks
// what KVCacheManager(policy={...}) is given. A new knob is one entry here
// plus the logic that reads it (docs/design.md section 3).
//
// X(type, name, default, range, doc):
//   type     bool, size_t or double (Python: bool, int, float)
//   default  the one default, KVCacheManager's too (vattn.Policy reads it from here); for
//            eager_tokens and max_round_ids the manager derives its default from the
//            cache's shape instead (vattn/core/policy.py DERIVED)
//   range    Bool: true or false; Tokens: [0, max_context_len] tokens of one
//            request; Fraction: [0, 1]; Count: [1, 2^32 - 1]
//   doc      one line, with units
#pragma once

#define VATTN_POLICY_KNOBS(X)                                                                                    \
  X(bool, background, true, Bool,                                                                               \
    "run the mapper thread, which maps after each step what the next step will need")                          \
  X(bool, deferred_reclaim, true, Bool,                                                                         \
    "free_reqid keeps a request's pages mapped for the next request until free pages run low; "                 \
    "false: unmapped at once")                                                                                   \
  X(bool, eager, true, Bool,                                                                                    \
    "the mapper keeps the reqid alloc_reqid returns next mapped for eager_tokens tokens (needs background)")    \
  X(size_t, lookahead_tokens, 1, Tokens, "tokens the mapper maps each active request ahead of its length")     \
  X(size_t, eager_tokens, 0, Tokens, "tokens the next reqid is mapped for ahead of its request (eager)")        \
  X(double, reclaim_threshold, 0.1, Fraction,                                                                   \
    "fraction of the page pool: below that many free pages the mapper unmaps freed requests' pages")            \
  X(size_t, max_round_ids, 64, Count, "page ids (positions) per mapper round: bounds how long a step waits for one")
