// Bindings of the budget layer (csrc/budget): vattn._C.Budget and
// vattn._C.BudgetMember, and the translation of BudgetError.
#pragma once

#include <pybind11/pybind11.h>

namespace vattn {

void bind_budget(pybind11::module_& m);

}  // namespace vattn
