// Tokens and page positions of one reqid: how many page positions a request
// of t tokens needs, and how many tokens a run of positions holds. Pure
// arithmetic, shared by the policy (lookahead, eager) and the mapper.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>

namespace vattn {

struct PageGeometry {
  size_t page_size = 0;        // bytes per page
  size_t bytes_per_token = 0;  // bytes one token takes in one buffer
  size_t max_tokens = 0;       // tokens per reqid (max context length)

  // Positions (pages per buffer) that hold the first `tokens` tokens;
  // tokens in [0, max_tokens], so bytes <= slice_bytes: no overflow.
  // step() asks this twice per request on its fast path: a page size that is
  // a power of two (every backend's granularity and the sizes users pick)
  // takes a shift instead of a 64-bit division.
  size_t positions_for_tokens(int64_t tokens) const {
    size_t bytes = static_cast<size_t>(tokens) * bytes_per_token;
    if ((page_size & (page_size - 1)) == 0) return (bytes + page_size - 1) >> __builtin_ctzll(page_size);
    return (bytes + page_size - 1) / page_size;
  }

  // Whole tokens in the first `positions` positions, at most max_tokens.
  int64_t tokens_in_positions(size_t positions) const {
    size_t tokens = positions * page_size / bytes_per_token;  // <= slice_bytes / token bytes
    return static_cast<int64_t>(std::min(tokens, max_tokens));
  }

  // Positions of the first num_tokens tokens that can be shared: whole pages
  // ending on a token boundary (a page shared with another reqid must not
  // hold the first bytes of a token that reqid writes).
  size_t shareable_positions(int64_t num_tokens) const {
    size_t whole = static_cast<size_t>(num_tokens) * bytes_per_token / page_size;
    // p pages end on a token boundary iff p is a multiple of bytes_per_token / gcd.
    size_t period = bytes_per_token / std::gcd(page_size, bytes_per_token);
    return whole - whole % period;
  }
};

}  // namespace vattn
