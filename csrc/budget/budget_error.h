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

// The budget's lock was held past lock_timeout_s (a stopped or stuck holder): the budget is sound and
// usable again once the holder goes on, so a cache counts it as a refusal, never as a reason to leave.
class BudgetLockTimeout : public BudgetError {
 public:
  using BudgetError::BudgetError;
};

// A system call on the budget's file failed (out of descriptors or memory, ...): the segment itself may be
// sound, so `budget rm` never takes it for an unreadable one.
class BudgetSystemError : public BudgetError {
 public:
  using BudgetError::BudgetError;
};

// The segment itself is damaged (corrupt, truncated, overwritten): nothing in
// it can be trusted, so `budget rm` unlinks it without counting members.
class BudgetCorrupt : public BudgetError {
 public:
  using BudgetError::BudgetError;
};

}  // namespace vattn
