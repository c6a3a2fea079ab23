// The error of the budget layer. The bindings translate it to
// vattn.common.errors.BudgetError; the message always names the budget, what is
// wrong and what to do about it.
#pragma once

#include <stdexcept>
#include <string>

namespace vattn {

class BudgetError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The segment itself is damaged (corrupt, truncated, overwritten): nothing in
// it can be trusted, so `budget rm` unlinks it without counting members.
class BudgetCorrupt : public BudgetError {
 public:
  using BudgetError::BudgetError;
};

}  // namespace vattn
