// A backend that only the tests register, to show (tests/backends/test_registry.py)
// that a backend and its probes are one file: registered here, in
// vattn._testing, it is built by vattn._C.make_backend and answers
// vattn._C.backend_probe through the library's one registry, with no line of
// the bindings naming it. It is the host backend under another name.
#include "backends/backend_registry.h"
#include "backends/host_backend.h"

namespace vattn {

namespace {

std::shared_ptr<VmmBackend> make_testing_host(const BackendParams& p) {
  return make_host_backend(p.page_size, p.num_pages);
}

// Its arguments back, in order, and who registered it: every kind of probe value crosses both ways.
ProbeData probe_echo(const ProbeData& args) {
  ProbeData out = args;
  out.emplace_back("registered_by", std::string("vattn._testing"));
  return out;
}

}  // namespace

VATTN_REGISTER_BACKEND(testing_host, make_testing_host,
                       {"echo", probe_echo, "its arguments back, then registered_by: who registered it",
                        {"flag", "count", "ratio", "text", "values"}});

}  // namespace vattn
