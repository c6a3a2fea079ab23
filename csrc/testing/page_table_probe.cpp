// The page table (core/page_table.h) and the policy's pure functions
// (core/policy.h) bound alone, so tests check them against a reference model
// without a backend, a lock or a thread. Arguments are checked here, so a
// wrong test raises ValueError instead of corrupting the process.
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/page_geometry.h"
#include "core/page_table.h"
#include "core/policy.h"
#include "testing/testing.h"

namespace vattn {

namespace {

void check_reqid(const PageTable& t, size_t reqid) {
  if (reqid >= t.num_reqids())
    throw std::invalid_argument("reqid must be in [0, " + std::to_string(t.num_reqids() - 1) + "], got " +
                                std::to_string(reqid));
}

void check_id(const PageTable& t, uint32_t id) {
  if (id >= t.num_ids())
    throw std::invalid_argument("page id must be in [0, " + std::to_string(t.num_ids() - 1) + "], got " +
                                std::to_string(id));
}

void check_ids(const PageTable& t, const std::vector<uint32_t>& ids) {
  for (uint32_t id : ids) check_id(t, id);
}

py::dict stats_dict(const PageStats& s) {
  py::dict d;
  d["pages_total"] = s.pages_total;
  d["pages_created"] = s.pages_created;
  d["pages_mapped"] = s.pages_mapped;
  d["pages_in_use"] = s.pages_in_use;
  d["page_mappings"] = s.page_mappings;
  d["pages_mapped_peak"] = s.pages_mapped_peak;
  d["pages_free_low"] = s.pages_free_low;
  d["pages_orphaned"] = s.pages_orphaned;
  d["reqids_allocated"] = s.reqids_allocated;
  d["tokens_active"] = s.tokens_active;
  d["prefix_handles"] = s.prefix_handles;
  d["page_unmaps"] = s.page_unmaps;
  return d;
}

Orphan make_orphan(const PageTable& t, size_t reqid, size_t pos, uint32_t id, std::vector<uintptr_t> addrs) {
  check_reqid(t, reqid);
  check_id(t, id);
  if (addrs.empty()) throw std::invalid_argument("an orphan holds at least one address");
  return Orphan{reqid, pos, id, std::move(addrs)};
}

const char* kind_name(MapperPlan::Kind kind) {
  switch (kind) {
    case MapperPlan::Kind::kReclaim: return "reclaim";
    case MapperPlan::Kind::kGrow: return "grow";
    case MapperPlan::Kind::kCreate: return "create";
    case MapperPlan::Kind::kIdle: break;
  }
  return "idle";
}

void bind_table(py::module_& m) {
  py::class_<PageTable>(m, "PageTable", "core/page_table.h, single-threaded, no backend.")
      .def(py::init<size_t, size_t, size_t, bool>(), py::arg("num_reqids"), py::arg("num_buffers"),
           py::arg("num_ids"), py::arg("external_ids") = false)
      .def_property_readonly("num_reqids", &PageTable::num_reqids)
      .def_property_readonly("num_buffers", &PageTable::num_buffers)
      .def_property_readonly("num_ids", &PageTable::num_ids)
      .def_property_readonly("external_ids", &PageTable::external_ids)
      .def("ids", [](const PageTable& t, size_t s) { check_reqid(t, s); return t.ids(s); }, py::arg("reqid"))
      .def("mapped", [](const PageTable& t, size_t s) { check_reqid(t, s); return t.mapped(s); }, py::arg("reqid"))
      .def("allocated", [](const PageTable& t, size_t s) { check_reqid(t, s); return t.allocated(s); },
           py::arg("reqid"))
      .def("tokens", [](const PageTable& t, size_t s) { check_reqid(t, s); return t.tokens(s); }, py::arg("reqid"))
      .def("orphans_of", [](const PageTable& t, size_t s) { check_reqid(t, s); return t.orphans_of(s); },
           py::arg("reqid"))
      .def("first_shared", [](const PageTable& t, size_t s) { check_reqid(t, s); return t.first_shared(s); },
           py::arg("reqid"))
      .def("allocate", [](PageTable& t, size_t s) {
             check_reqid(t, s);
             if (t.allocated(s)) throw std::invalid_argument("reqid is allocated");
             t.allocate(s);
           }, py::arg("reqid"))
      .def("release", [](PageTable& t, size_t s) {
             check_reqid(t, s);
             if (!t.allocated(s)) throw std::invalid_argument("reqid is free");
             t.release(s);
           }, py::arg("reqid"))
      .def("set_tokens", [](PageTable& t, size_t s, int64_t tokens) {
             check_reqid(t, s);
             if (!t.allocated(s) || tokens < 0) throw std::invalid_argument("tokens go to an allocated reqid, >= 0");
             t.set_tokens(s, tokens);
           }, py::arg("reqid"), py::arg("tokens"))
      .def("maps", [](const PageTable& t, uint32_t id) { check_id(t, id); return t.maps(id); }, py::arg("id"))
      .def("holds", [](const PageTable& t, uint32_t id) { check_id(t, id); return t.holds(id); }, py::arg("id"))
      .def("refs", [](const PageTable& t, uint32_t id) { check_id(t, id); return t.refs(id); }, py::arg("id"))
      .def("created", [](const PageTable& t, uint32_t id) { check_id(t, id); return t.created(id); }, py::arg("id"))
      .def("add_hold", [](PageTable& t, uint32_t id) { check_id(t, id); t.add_hold(id); }, py::arg("id"))
      .def("drop_hold", [](PageTable& t, uint32_t id) {
             check_id(t, id);
             if (t.holds(id) == 0) throw std::invalid_argument("the id has no hold");
             t.drop_hold(id);
           }, py::arg("id"))
      .def_property_readonly("available", &PageTable::available)
      .def_property_readonly("free_ids", &PageTable::free_ids)
      .def_property_readonly("uncreated", &PageTable::uncreated)
      .def("claim", [](PageTable& t, size_t count) {
             if (count > t.available()) throw std::invalid_argument("claim: more ids than available");
             std::vector<uint32_t> to_create;
             std::vector<uint32_t> ids = t.claim(count, to_create);
             return std::make_pair(ids, to_create);
           }, py::arg("count"), "Returns (ids, ids to create).")
      .def("take_uncreated", &PageTable::take_uncreated, py::arg("count"))
      .def("return_fresh", [](PageTable& t, const std::vector<uint32_t>& ids) {
             check_ids(t, ids);
             t.return_fresh(ids);
           }, py::arg("ids"))
      .def("mark_created", [](PageTable& t, const std::vector<uint32_t>& ids) {
             check_ids(t, ids);
             t.mark_created(ids);
           }, py::arg("ids"))
      .def("uncreate_free", &PageTable::uncreate_free, py::arg("count"),
           "Up to count free ids, freed longest ago first, become uncreated; returns them.")
      .def("idle_ids", &PageTable::idle_ids, "Created ids no allocated reqid, handle or orphan references.")
      .def("uncreated_among", [](PageTable& t, const std::vector<uint32_t>& ids) {
             check_ids(t, ids);
             return t.uncreated_among(ids.data(), ids.size());
           }, py::arg("ids"))
      .def("append", [](PageTable& t, size_t s, const std::vector<uint32_t>& ids) {
             check_reqid(t, s);
             check_ids(t, ids);
             t.append(s, ids);
           }, py::arg("reqid"), py::arg("ids"))
      .def("cut_tail", [](PageTable& t, size_t s, size_t keep) {
             check_reqid(t, s);
             std::vector<Cut> cuts;
             t.cut_tail(s, keep, cuts);
             return cuts.empty() ? std::vector<uint32_t>{} : cuts[0].ids;
           }, py::arg("reqid"), py::arg("keep"), "The ids cut from positions keep.. (their references stay).")
      .def("count_unmapped", &PageTable::count_unmapped, py::arg("addrs"))
      .def("drop_map_ref", [](PageTable& t, uint32_t id) {
             check_id(t, id);
             if (t.maps(id) == 0) throw std::invalid_argument("the id has no mapping reference");
             t.drop_map_ref(id);
           }, py::arg("id"))
      .def("keep_orphan", [](PageTable& t, size_t s, size_t pos, uint32_t id, std::vector<uintptr_t> addrs) {
             t.keep_orphan(make_orphan(t, s, pos, id, std::move(addrs)));
           }, py::arg("reqid"), py::arg("pos"), py::arg("id"), py::arg("addrs"))
      .def("add_orphan", [](PageTable& t, size_t s, size_t pos, uint32_t id, std::vector<uintptr_t> addrs) {
             t.add_orphan(make_orphan(t, s, pos, id, std::move(addrs)));
           }, py::arg("reqid"), py::arg("pos"), py::arg("id"), py::arg("addrs"))
      .def_property_readonly("orphans", [](const PageTable& t) {
             std::vector<std::tuple<size_t, size_t, uint32_t, std::vector<uintptr_t>>> out;
             for (const Orphan& o : t.orphans()) out.emplace_back(o.reqid, o.pos, o.id, o.addrs);
             return out;
           }, "[(reqid, position, id, addresses still mapped), ...]")
      .def("settle_orphan", [](PageTable& t, size_t k, size_t done) {
             if (k >= t.orphans().size() || done > t.orphans()[k].addrs.size())
               throw std::invalid_argument("settle_orphan: no such orphan, or more addresses than it has");
             return t.settle_orphan(k, done);
           }, py::arg("k"), py::arg("done"))
      .def("retain", [](PageTable& t, const std::vector<uint32_t>& ids) {
             check_ids(t, ids);
             return t.retain(ids);
           }, py::arg("ids"))
      .def("release_handle", &PageTable::release_handle, py::arg("handle"))
      .def("handle_ids", [](const PageTable& t, uint64_t h) -> py::object {
             const std::vector<uint32_t>* ids = t.handle_ids(h);
             return ids ? py::cast(*ids) : py::none();
           }, py::arg("handle"))
      .def("release_all_handles", &PageTable::release_all_handles)
      .def("clear", &PageTable::clear)
      .def("stats", [](const PageTable& t) { return stats_dict(t.stats()); })
      .def("check_invariants", &PageTable::check_invariants);
}

void bind_policy(py::module_& m) {
  m.def("best_free_reqid", &best_free_reqid, py::arg("table"), py::arg("want_positions"));
  m.def("emptiest_free_reqid", &emptiest_free_reqid, py::arg("table"));
  m.def(
      "plan_reclaim",
      [](const PageTable& t, size_t want_ids, int64_t keep_reqid, size_t max_positions) {
        ReclaimPlan plan = plan_reclaim(t, want_ids, keep_reqid, max_positions);
        return std::make_pair(plan.cuts, plan.freed_ids);
      },
      py::arg("table"), py::arg("want_ids"), py::arg("keep_reqid") = -1, py::arg("max_positions") = SIZE_MAX,
      "Returns ([(reqid, positions kept), ...], ids freed).");
  m.def(
      "lookahead_positions",
      [](const PageTable& t, size_t reqid, size_t page_size, size_t bytes_per_token, size_t max_tokens,
         const PolicyConfig& policy) {
        check_reqid(t, reqid);
        validate_policy(policy, max_tokens);
        return lookahead_positions(t, PageGeometry{page_size, bytes_per_token, max_tokens}, policy, reqid);
      },
      py::arg("table"), py::arg("reqid"), py::arg("page_size"), py::arg("bytes_per_token"), py::arg("max_tokens"),
      py::arg("policy"));
  m.def(
      "plan_mapper_round",
      [](const PageTable& t, size_t page_size, size_t bytes_per_token, size_t max_tokens, const PolicyConfig& policy,
         size_t reclaim_floor_ids, size_t creatable_ids, bool speculative) {
        if (page_size == 0 || bytes_per_token == 0)
          throw std::invalid_argument("page_size and bytes_per_token must be positive");
        validate_policy(policy, max_tokens);
        MapperPlan plan = plan_mapper_round(t, PageGeometry{page_size, bytes_per_token, max_tokens}, policy,
                                            reclaim_floor_ids, MapperLimits{creatable_ids, speculative});
        py::dict d;
        d["kind"] = kind_name(plan.kind);
        d["reclaim"] = plan.reclaim;
        d["grows"] = plan.grows;
        d["create_ids"] = plan.create_ids;
        return d;
      },
      py::arg("table"), py::arg("page_size"), py::arg("bytes_per_token"), py::arg("max_tokens"),
      py::arg("policy"), py::arg("reclaim_floor_ids") = 0, py::arg("creatable_ids") = SIZE_MAX,
      py::arg("speculative") = true,
      "The mapper's next batch: {kind: idle | reclaim | grow | create, reclaim: [(reqid, kept)], "
      "grows: [(reqid, positions to add)], create_ids}.");
}

}  // namespace

void bind_page_table(py::module_& m) {
  bind_table(m);
  bind_policy(m);
}

}  // namespace vattn
