// Bindings of the policy knobs (core/policy_knobs.h): vattn._C.PolicyConfig,
// one property per knob, and vattn._C.POLICY_KNOBS, the knobs as data. Both
// are generated from the knob list, so a new knob needs no line here.
#pragma once

#include <pybind11/pybind11.h>

namespace vattn {

void bind_policy(pybind11::module_& m);

}  // namespace vattn
