#include "python/policy_bindings.h"

#include <string>
#include <type_traits>

#include "core/policy.h"

namespace py = pybind11;

namespace vattn {

namespace {

// A knob's value from Python, by the knob's field type: bool takes only
// True / False; an int knob takes ints and integer scalars (not bools or
// floats); a float knob takes ints and floats (not bools). Out of range:
// invalid_argument naming the knob and its range (check_knob).
template <class T>
T knob_value(const char* name, KnobRange range, py::handle value) {
  PyObject* o = value.ptr();
  const std::string got = Py_TYPE(o)->tp_name;
  if constexpr (std::is_same_v<T, bool>) {
    if (!PyBool_Check(o)) throw py::type_error(std::string(name) + " must be a bool, got " + got);
    return o == Py_True;
  } else if constexpr (std::is_floating_point_v<T>) {
    if (PyBool_Check(o) || !(PyFloat_Check(o) || PyLong_Check(o)))
      throw py::type_error(std::string(name) + " must be a number (int or float), got " + got);
    const double v = PyFloat_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) throw py::error_already_set();  // an int beyond a double
    check_knob(name, range, v, kAnyTokens);
    return v;
  } else {
    py::object index = py::reinterpret_steal<py::object>(
        PyBool_Check(o) || PyFloat_Check(o) || !PyIndex_Check(o) ? nullptr : PyNumber_Index(o));
    if (!index) {
      PyErr_Clear();
      throw py::type_error(std::string(name) + " must be an int, got " + got);
    }
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (overflow)
      throw std::invalid_argument(std::string(name) + " must be in " + knob_range_text(range, kAnyTokens) +
                                  ", got " + py::str(index).cast<std::string>());
    check_knob(name, range, static_cast<int64_t>(v), kAnyTokens);  // token bounds come with validate()
    return static_cast<T>(v);
  }
}

// Sets knob `name` of `p` from Python; false when no knob has that name.
bool set_knob(PolicyConfig& p, const std::string& name, py::handle value) {
#define VATTN_POLICY_SET(type, knob, value_, range, doc) \
  if (name == #knob) {                                 \
    p.knob = knob_value<type>(#knob, KnobRange::range, value); \
    return true;                                       \
  }
  VATTN_POLICY_KNOBS(VATTN_POLICY_SET)
#undef VATTN_POLICY_SET
  return false;
}

py::dict as_dict(const PolicyConfig& p) {
  py::dict d;
#define VATTN_POLICY_ITEM(type, knob, value, range, doc) d[#knob] = p.knob;
  VATTN_POLICY_KNOBS(VATTN_POLICY_ITEM)
#undef VATTN_POLICY_ITEM
  return d;
}

const char* range_name(KnobRange range) {
  switch (range) {
    case KnobRange::Bool: return "bool";
    case KnobRange::Tokens: return "tokens";
    case KnobRange::Fraction: return "fraction";
    case KnobRange::Count: break;
  }
  return "count";
}

template <class T>
constexpr const char* python_type() {
  return std::is_same_v<T, bool> ? "bool" : std::is_floating_point_v<T> ? "float" : "int";
}

// Every knob as data, in the order of core/policy_knobs.h: name, type (its
// Python type), range (bool, tokens, fraction, count), accepts (the range in
// words), default (the core's), doc.
py::tuple knob_rows() {
  py::list rows;
#define VATTN_POLICY_ROW(type, knob, value, range, doc)                                                       \
  rows.append(py::dict(py::arg("name") = #knob, py::arg("type") = python_type<type>(),                       \
                       py::arg("range") = range_name(KnobRange::range),                                      \
                       py::arg("accepts") = knob_range_text(KnobRange::range, kAnyTokens),                  \
                       py::arg("default") = static_cast<type>(value), py::arg("doc") = doc));
  VATTN_POLICY_KNOBS(VATTN_POLICY_ROW)
#undef VATTN_POLICY_ROW
  return py::tuple(rows);
}

}  // namespace

void bind_policy(py::module_& m) {
  py::class_<PolicyConfig> cls(
      m, "PolicyConfig",
      "The page manager's policy knobs (csrc/core/policy_knobs.h; POLICY_KNOBS lists them). Keyword "
      "arguments name knobs; the others keep the core's defaults. Setting a knob checks its type and range "
      "(TypeError / ValueError naming it; the config is unchanged); validate(max_context_len) checks the "
      "token knobs against the requests' length.");
  cls.def(py::init([](const py::kwargs& kwargs) {
            PolicyConfig p;
            for (const auto& [key, value] : kwargs) {
              const std::string name = py::cast<std::string>(key);
              if (!set_knob(p, name, value))
                throw py::type_error("no policy knob is named '" + name + "' (knobs: " +
                                     py::str(", ").attr("join")(as_dict(p)).cast<std::string>() + ")");
            }
            return p;
          }))
      .def("validate", &validate_policy, py::arg("max_context_len"),
           "Raises ValueError naming the first knob outside its range; token knobs are bounded by "
           "max_context_len (tokens).")
      .def("as_dict", &as_dict, "{knob: value} in the order of POLICY_KNOBS.")
      .def("__eq__", [](const PolicyConfig& a, const PolicyConfig& b) { return as_dict(a).equal(as_dict(b)); })
      .def("__repr__",
           [](const PolicyConfig& p) { return "PolicyConfig(" + py::repr(as_dict(p)).cast<std::string>() + ")"; });
#define VATTN_POLICY_PROPERTY(type, knob, value, range, doc)                                                   \
  cls.def_property(                                                                                          \
      #knob, [](const PolicyConfig& p) { return p.knob; },                                                   \
      [](PolicyConfig& p, py::handle v) { p.knob = knob_value<type>(#knob, KnobRange::range, v); }, doc);
  VATTN_POLICY_KNOBS(VATTN_POLICY_PROPERTY)
#undef VATTN_POLICY_PROPERTY

  m.attr("POLICY_KNOBS") = knob_rows();
}

}  // namespace vattn
