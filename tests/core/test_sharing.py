"""Shared physical pages: fork, prefix handles and the page-table primitive.

Exact expectations first (which ids are shared, which copied, what each stat
says), then every error with the state checked unchanged, then randomized
schedules with the background mapper on, both layouts and tight pools, against
a reference model of what every request's rows must read back.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import vattn
from conftest import assert_invariants

PAGE = 4096
B, L = 6, 128
LAYERS = 2


def make(layout: str = "per_layer", pool_ids: int | None = None, max_batch_size: int = B,
         **options) -> vattn.KVCacheManager:
    """fp32, 2 KV heads x 16: 128 bytes per token per buffer, so a 4 KiB page
    holds 32 tokens (per_layer) or 16 tokens of both layers (all_layers)."""
    num_buffers = 2 * LAYERS if layout == "per_layer" else 2
    if pool_ids is not None:
        options["physical_memory"] = pool_ids * num_buffers * PAGE
    return vattn.KVCacheManager(num_layers=LAYERS, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                                max_batch_size=max_batch_size, max_context_len=L, page_size=PAGE, layout=layout,
                                **options)


def write_rows(kv: vattn.KVCacheManager, reqid: int, start: int, stamps: torch.Tensor) -> None:
    """Rows start.. of reqid get ``stamps`` (one value per row), offset per layer, negated in V."""
    for layer in range(LAYERS):
        k, v = kv.layer(layer)
        rows = stamps.view(-1, 1, 1) + layer * 0.25
        k[reqid, start:start + len(stamps)] = rows
        v[reqid, start:start + len(stamps)] = -rows


def assert_rows(kv: vattn.KVCacheManager, reqid: int, stamps: torch.Tensor) -> None:
    n = len(stamps)
    for layer in range(LAYERS):
        k, v = kv.layer(layer)
        want = (stamps.view(-1, 1, 1) + layer * 0.25).expand(-1, *k.shape[2:])
        assert torch.equal(k[reqid, :n], want), f"K rows of reqid {reqid}, layer {layer}"
        assert torch.equal(v[reqid, :n], -want), f"V rows of reqid {reqid}, layer {layer}"


def snapshot(kv: vattn.KVCacheManager) -> tuple:
    """Everything an error must leave unchanged."""
    s = kv.stats()
    counters = {key: s[key] for key in ("pages_mapped", "pages_in_use", "page_mappings", "reqids_allocated",
                                        "prefix_handles", "forks", "pages_copied", "tokens_active")}
    slots = range(kv.config.max_batch_size)
    return counters, [kv.page_ids(r) for r in slots], [kv.is_allocated(r) for r in slots]


def stamped(kv: vattn.KVCacheManager, tokens: int, base: float = 1000.0) -> tuple[int, torch.Tensor]:
    reqid = kv.alloc_reqid(tokens)
    lens = [0] * kv.config.max_batch_size
    lens[reqid] = tokens
    assert kv.step(lens)
    stamps = base + torch.arange(tokens, dtype=torch.float32)
    write_rows(kv, reqid, 0, stamps)
    return reqid, stamps


def step_one(kv: vattn.KVCacheManager, reqid: int, tokens: int) -> bool:
    lens = [0] * kv.config.max_batch_size
    lens[reqid] = tokens
    return kv.step(lens)


# ---- fork ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_fork_shares_whole_pages_and_copies_the_partial_one(layout):
    with make(layout, policy={"background": False, "eager": False}) as kv:
        pt = kv.page_tokens
        src, stamps = stamped(kv, 2 * pt + 5)
        before = kv.stats()
        child = kv.fork(src, 2 * pt + 3)  # 2 whole pages shared, 3 tokens copied into a fresh page
        ids_src, ids_child = kv.page_ids(src), kv.page_ids(child)
        assert ids_child[:2] == ids_src[:2] and len(ids_child) == 3 and ids_child[2] not in ids_src
        assert_rows(kv, child, stamps[:2 * pt + 3])
        s, nb = kv.stats(), kv.config.num_buffers
        assert s["forks"] == before["forks"] + 1 and s["pages_copied"] == before["pages_copied"] + nb
        assert s["pages_in_use"] == before["pages_in_use"] + nb  # only the copied page is new
        assert s["page_mappings"] == before["page_mappings"] + 3 * nb
        assert s["bytes_saved_by_sharing"] == 2 * nb * PAGE
        assert kv.mapped_bytes(child) == 3 * nb * PAGE == kv.mapped_bytes(src)
        assert kv.mapped_tokens(child) == 3 * pt
        assert_invariants(kv)

        # the child grows above the shared pages; its own rows do not touch the source
        assert step_one(kv, child, 3 * pt + 1)
        assert kv.page_ids(child)[:2] == ids_src[:2] and kv.page_ids(src) == ids_src
        write_rows(kv, child, 2 * pt + 3, torch.full((pt - 2,), 7.0))
        assert_rows(kv, src, stamps)

        # freeing the source first keeps the child's data; the shared pages stay in use
        kv.free_reqid(src)
        kv.reclaim()
        assert kv.page_ids(src) == [] and kv.page_ids(child)[:2] == ids_src[:2]
        assert_rows(kv, child, stamps[:2 * pt + 3])
        kv.free_reqid(child)
        kv.reclaim()
        assert kv.stats()["pages_in_use"] == 0
        assert_invariants(kv)


def test_fork_at_a_page_boundary_copies_nothing_and_at_zero_shares_nothing():
    with make(policy={"background": False, "eager": False}) as kv:
        pt = kv.page_tokens
        src, stamps = stamped(kv, 2 * pt)
        child = kv.fork(src, 2 * pt)
        assert kv.page_ids(child) == kv.page_ids(src) and kv.stats()["pages_copied"] == 0
        empty = kv.fork(src, 0)
        assert kv.page_ids(empty) == [] and kv.mapped_tokens(empty) == 0
        assert_rows(kv, child, stamps)
        assert kv.stats()["forks"] == 2


def test_module_level_fork():
    vattn.init(num_layers=LAYERS, num_kv_heads=2, head_dim=16, dtype=torch.float32, max_batch_size=B,
               max_context_len=L, page_size=PAGE, policy={"background": False})
    try:
        src = vattn.alloc_reqid(40)
        lens = [0] * B
        lens[src] = 40
        assert vattn.step(lens)
        child = vattn.fork(src, 40)
        assert vattn.get_manager().page_ids(child)[:1] == vattn.get_manager().page_ids(src)[:1]
    finally:
        vattn.cleanup()


@pytest.mark.parametrize("how", ["best-fit", "chosen-reqid", "eager"])
def test_a_reused_reqid_never_writes_into_pages_it_shared(how):
    """Deferred reclaim keeps a freed reqid's pages for its next request, but
    not those a fork still maps: the next request would overwrite them."""
    with make(policy={"background": how == "eager", "eager": how == "eager", "deferred_reclaim": True}) as kv:
        pt = kv.page_tokens
        src, stamps = stamped(kv, 3 * pt)
        child = kv.fork(src, 2 * pt)
        kv.free_reqid(src)
        kv.wait_idle()
        if how == "chosen-reqid":
            again = kv.alloc_reqid(3 * pt, reqid=src)
        else:
            again = kv.alloc_reqid(3 * pt)
            assert again == src  # the freed reqid with the most pages mapped fits best
        assert set(kv.page_ids(again)).isdisjoint(kv.page_ids(child))
        assert step_one(kv, again, 3 * pt)
        write_rows(kv, again, 0, torch.full((3 * pt,), -5.0))
        assert_rows(kv, child, stamps[:2 * pt])
        assert_invariants(kv)


# ---- prefix handles ----------------------------------------------------------------


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_prefix_handle_outlives_its_request(layout):
    with make(layout, policy={"background": False}) as kv:
        pt = kv.page_tokens
        src, stamps = stamped(kv, 3 * pt + 6)
        handle = kv.retain_prefix(src, 2 * pt + 5)  # rounded down to 2 whole pages
        assert handle.num_tokens == 2 * pt and handle.page_ids == kv.page_ids(src)[:2]
        assert kv.stats()["prefix_handles"] == 1
        kv.free_reqid(src)
        kv.reclaim()  # the source's own pages go; the handle's stay
        assert kv.stats()["pages_in_use"] == 2 * kv.config.num_buffers
        for _ in range(2):  # attached twice: both see the prefix
            r = kv.alloc_reqid(0)
            assert kv.attach_prefix(handle, r) == 2 * pt
            assert kv.page_ids(r) == handle.page_ids and kv.mapped_tokens(r) == 2 * pt
            assert_rows(kv, r, stamps[:2 * pt])
            assert step_one(kv, r, 2 * pt + 2)  # prefill the rest above the shared pages
        handle.release()
        handle.release()  # idempotent
        assert handle.released and kv.stats()["prefix_handles"] == 0
        with pytest.raises(ValueError, match="released"):
            handle.page_ids
        assert_invariants(kv)


def test_the_150_token_example_and_context_manager():
    # 16-token pages: all_layers with 2 layers x 2 heads x 16 x fp32 = 256 bytes per token
    with vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, max_batch_size=2,
                              max_context_len=160, page_size=PAGE, layout="all_layers",
                              policy={"background": False}) as kv:
        assert kv.page_tokens == 16
        src = kv.alloc_reqid(150)
        assert kv.step([150 if r == src else 0 for r in range(2)])
        with kv.retain_prefix(src, 150) as h:
            assert h.num_tokens == 144
            r = kv.alloc_reqid(0)
            assert kv.attach_prefix(h, r) == 144
        assert h.released and kv.stats()["prefix_handles"] == 0
        assert kv.page_ids(r) == kv.page_ids(src)[:9]  # the request keeps its mapping


def test_cleanup_releases_handles():
    kv = make(policy={"background": False})
    src, _ = stamped(kv, 70)
    h = kv.retain_prefix(src, 70)
    kv.cleanup()
    assert h.released
    h.release()  # after cleanup: a no-op, never a crash
    with pytest.raises(ValueError, match="released"):
        h.page_ids


# ---- the page-table primitive -----------------------------------------------------------


def test_map_pages_shares_ids_in_one_batched_call():
    with make(policy={"background": False, "eager": False}) as kv:
        pt = kv.page_tokens
        a, stamps = stamped(kv, 3 * pt)
        ids = kv.page_ids(a)
        b, c = kv.alloc_reqid(0), kv.alloc_reqid(0)
        kv.map_pages([b, c], [0, 0], ids[:2] + ids[:1], counts=[2, 1])
        assert kv.page_ids(b) == ids[:2] and kv.page_ids(c) == ids[:1]
        assert_rows(kv, b, stamps[:2 * pt])
        assert_rows(kv, c, stamps[:pt])
        kv.map_pages([c], [0], [ids[:1] + [ids[2]]])  # nested form; position 0 is unchanged, 1 is new
        assert kv.page_ids(c) == [ids[0], ids[2]]
        assert_rows(kv, c, torch.cat([stamps[:pt], stamps[2 * pt:3 * pt]]))
        kv.unmap_pages([b, c], [1, 0])
        assert kv.page_ids(b) == ids[:1] and kv.page_ids(c) == [] and kv.page_ids(a) == ids
        assert_rows(kv, a, stamps)
        s = kv.stats()
        assert s["page_mappings"] == 4 * kv.config.num_buffers and s["pages_in_use"] == 3 * kv.config.num_buffers
        assert_invariants(kv)


def test_external_page_ids():
    with make(page_allocator="external",
              policy={"background": False, "eager": False, "deferred_reclaim": False}) as kv:
        n = kv.num_page_ids
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        kv.map_pages([a, b], [0, 0], [[n - 1, 0], [n - 1, 2]])
        assert kv.page_ids(a) == [n - 1, 0] and kv.page_ids(b) == [n - 1, 2]
        write_rows(kv, a, 0, torch.arange(2 * kv.page_tokens, dtype=torch.float32))
        assert_rows(kv, b, torch.arange(kv.page_tokens, dtype=torch.float32))  # position 0 is the same page
        kv.unmap_pages([a, b], [0, 0])
        assert kv.stats()["page_mappings"] == 0
        with pytest.raises(ValueError, match=r"page_ids\[0\] must be in \[0, %d\]" % (n - 1)):
            kv.map_pages([a], [0], [[n]])
        assert_invariants(kv)


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_external_pool_is_sized_by_physical_memory_not_by_the_slices(layout):
    """A framework keeps more blocks than its running requests map (a prefix
    cache): the external pool holds every id physical_memory pays for, here 5x
    what the two slices can map at once."""
    with make(layout, max_batch_size=2, page_allocator="external",
              policy={"background": False, "eager": False}) as kv:
        positions = kv.slice_bytes // PAGE  # per slice
        assert kv.num_page_ids == 2 * positions  # the default budget is still capped
    with make(layout, pool_ids=10 * positions, max_batch_size=2, page_allocator="external",
              policy={"background": False, "eager": False}) as kv:
        assert kv.num_page_ids == 10 * positions
        assert kv.stats()["bytes_total"] == 10 * positions * kv.config.num_buffers * PAGE
        a = kv.alloc_reqid()
        kv.map_pages([a], [0], [[kv.num_page_ids - 1]])  # the last id is usable
        assert kv.page_ids(a) == [kv.num_page_ids - 1]
        assert_invariants(kv)
    with make(layout, pool_ids=10 * positions, max_batch_size=2,
              policy={"background": False, "eager": False}) as kv:
        assert kv.num_page_ids == 2 * positions  # managed ids stay capped: nothing else could map them


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_external_page_keeps_its_contents_while_mapped_nowhere(layout):
    """A prefix cache hands a freed block back later with what was written in
    it: an external id's page keeps its memory and contents while no reqid maps
    it, through other ids being mapped and unmapped at the same addresses."""
    with make(layout, pool_ids=40, max_batch_size=2, page_allocator="external",
              policy={"background": False, "eager": False}) as kv:
        pt = kv.page_tokens
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        kv.map_pages([a], [0], [[7, 31]])
        stamps = torch.arange(2 * pt, dtype=torch.float32) + 100.0
        write_rows(kv, a, 0, stamps)
        kv.unmap_pages([a, b], [0, 0])  # 7 and 31 are mapped nowhere now
        assert kv.stats()["page_mappings"] == 0
        kv.map_pages([a, b], [0, 0], [[3, 4], [5]])  # other pages at the same addresses
        write_rows(kv, a, 0, torch.full((2 * pt,), -1.0))
        write_rows(kv, b, 0, torch.full((pt,), -2.0))
        kv.map_pages([b], [0], [[7, 31]])  # handed back, to another slice
        assert kv.page_ids(b) == [7, 31]
        assert_rows(kv, b, stamps)
        kv.map_pages([a], [0], [[31]])  # and a page of it alone, shared at another position
        assert_rows(kv, a, stamps[pt:])
        assert kv.stats()["pages_created"] == 5 * kv.config.num_buffers  # created once each, never released
        assert_invariants(kv)


# ---- errors leave the state unchanged ---------------------------------------------------


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_errors_change_nothing(layout):
    with (make(layout, policy={"background": False, "eager": False}) as kv,
          make(layout, policy={"background": False}) as other):
        pt = kv.page_tokens
        src, stamps = stamped(kv, 2 * pt + 3)
        busy, _ = stamped(kv, 5, base=5000.0)
        handle = kv.retain_prefix(src, 2 * pt)
        foreign = other.retain_prefix(stamped(other, pt)[0], pt)
        free = next(r for r in range(B) if not kv.is_allocated(r))
        released = kv.retain_prefix(src, pt)
        released.release()
        cases = [
            (lambda: kv.fork(free, 0), ValueError, "not allocated"),
            (lambda: kv.fork(src, -1), ValueError, "num_tokens"),
            (lambda: kv.fork(src, kv.mapped_tokens(src) + 1), ValueError, "num_tokens"),
            (lambda: kv.fork(src, 2.0), TypeError, "num_tokens must be an int"),
            (lambda: kv.fork(B, 1), ValueError, "src_reqid"),
            (lambda: kv.retain_prefix(free, 0), ValueError, "not allocated"),
            (lambda: kv.retain_prefix(src, 10**6), ValueError, "num_tokens"),
            # beyond the core's int64: the same range as any other (it had said "below 4611686018427387904")
            (lambda: kv.fork(src, 2**70), ValueError,
             rf"fork: num_tokens must be in \[0, {kv.mapped_tokens(src)}\] \(tokens mapped for reqid {src}\)"),
            (lambda: kv.retain_prefix(src, -2**70), ValueError, r"retain_prefix: num_tokens must be in \[0, "),
            (lambda: kv.attach_prefix(handle, busy), ValueError, "tokens"),
            (lambda: kv.attach_prefix(handle, free), ValueError, "not allocated"),
            (lambda: kv.attach_prefix(released, free), ValueError, "released"),
            (lambda: kv.attach_prefix(foreign, busy), ValueError, "another KV cache manager"),
            (lambda: kv.attach_prefix("h", busy), TypeError, "PrefixHandle"),
            (lambda: kv.map_pages([busy], [5], [kv.page_ids(src)[0]], [1]), ValueError, "starts"),
            (lambda: kv.map_pages([busy], [0], [kv.num_page_ids], [1]), ValueError, r"page_ids\[0\] must be in"),
            (lambda: kv.map_pages([busy, src], [0], [0], [1]), ValueError, "equal lengths"),
            (lambda: kv.unmap_pages([B], [0]), ValueError, r"reqid must be in \[0, 5\]"),
        ]
        for call, exc, match in cases:
            before = snapshot(kv)
            with pytest.raises(exc, match=match):
                call()
            assert snapshot(kv) == before, match
        # an id no request maps and no handle holds cannot be shared (vattn's own allocator hands out ids)
        unused = next(i for i in range(kv.num_page_ids) if all(i not in kv.page_ids(r) for r in range(B)))
        before = snapshot(kv)
        with pytest.raises(ValueError, match="not in use"):
            kv.map_pages([busy], [0], [unused], [1])
        assert snapshot(kv) == before
        assert_rows(kv, src, stamps)
        assert_invariants(kv)


def test_fork_with_the_pool_exhausted_is_all_or_nothing():
    with make(pool_ids=3, policy={"background": False, "eager": False, "deferred_reclaim": False}) as kv:
        pt = kv.page_tokens
        src, stamps = stamped(kv, 2 * pt + 1)  # 3 ids: the whole pool
        before = snapshot(kv)
        with pytest.raises(vattn.OutOfPages):
            kv.fork(src, 2 * pt + 1)  # needs one fresh page for the partial tail
        assert snapshot(kv) == before
        child = kv.fork(src, 2 * pt)  # whole pages only: no page needed
        assert kv.page_ids(child) == kv.page_ids(src)[:2]
        for r in range(B):
            if not kv.is_allocated(r):
                kv.alloc_reqid(reqid=r)
        before = snapshot(kv)
        with pytest.raises(vattn.OutOfReqids):
            kv.fork(src, pt)
        assert snapshot(kv) == before
        assert_rows(kv, src, stamps)


def test_fork_in_a_forked_process_is_refused():
    kv = make(policy={"background": False})
    try:
        src, _ = stamped(kv, 10)
        pid = os.fork()
        if pid == 0:  # the child: every sharing call must refuse, nothing may touch the parent's pages
            code = 0
            for call in (lambda: kv.fork(src, 5), lambda: kv.retain_prefix(src, 5), lambda: kv.page_ids(src)):
                try:
                    call()
                    code = 1
                except vattn.ForkedError:
                    pass
                except BaseException:  # noqa: BLE001 - any other outcome is a failure
                    code = 2
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert kv.stats()["forks"] == 0 and kv.is_allocated(src)
    finally:
        kv.cleanup()


# ---- randomized schedules against a reference model -----------------------------------


class SharingMachine(RuleBasedStateMachine):
    """Random fork / retain / attach / release / step / free / reclaim /
    map_pages / unmap_pages; every request's rows must read back the stamps
    the model says, and the pool must count every page exactly once."""

    @initialize(layout=st.sampled_from(["per_layer", "all_layers"]), pool_ids=st.integers(3, 24),
                background=st.booleans(), eager=st.booleans(), deferred=st.booleans())
    def setup(self, layout, pool_ids, background, eager, deferred):
        self.B = 4  # few reqids: freed ones (and the pages they share) are reused often
        self.kv = make(layout, pool_ids=pool_ids, max_batch_size=self.B,
                       policy={"background": background, "eager": eager, "deferred_reclaim": deferred})
        self.pt = self.kv.page_tokens
        self.rows: dict[int, torch.Tensor] = {}  # allocated reqid -> the stamps its rows 0.. hold
        self.lens = [0] * self.B  # tokens each allocated reqid was stepped to
        self.handles: list[tuple[vattn.PrefixHandle, torch.Tensor]] = []
        self.next_stamp = 1.0

    def teardown(self):
        if hasattr(self, "kv"):
            handles = [h for h, _ in self.handles]
            self.kv.cleanup()
            assert all(h.released for h in handles)

    # Draws have fixed bounds and are mapped onto the state afterwards: with the
    # background mapper, which fork or step finds pages is timing-dependent, and
    # hypothesis needs the same draws to replay a case.
    def pick(self, data, pool) -> int:
        return sorted(pool)[data.draw(st.integers(0, 63)) % len(pool)]

    def upto(self, data, limit: int) -> int:
        return min(data.draw(st.integers(0, L)), limit)

    def stamps(self, n: int) -> torch.Tensor:
        out = self.next_stamp + torch.arange(n, dtype=torch.float32)
        self.next_stamp += n
        return out

    def adopt(self, reqid: int, rows: torch.Tensor) -> None:
        self.rows[reqid] = rows.clone()
        self.lens[reqid] = len(rows)

    @rule(prompt=st.one_of(st.none(), st.integers(0, L)))
    def alloc(self, prompt):
        try:
            r = self.kv.alloc_reqid(prompt)
        except vattn.OutOfReqids:
            assert len(self.rows) == self.B
            return
        assert r not in self.rows
        self.adopt(r, self.stamps(0))

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def free(self, data):
        r = self.pick(data, self.rows)
        self.kv.free_reqid(r)
        del self.rows[r]
        self.lens[r] = 0

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), prompt=st.one_of(st.none(), st.integers(0, L)), chosen=st.booleans())
    def recycle(self, data, prompt, chosen):
        """A request ends and the next one starts at once, maybe on the same reqid (as vLLM picks blocks)."""
        r = self.pick(data, self.rows)
        self.kv.free_reqid(r)
        del self.rows[r]
        got = self.kv.alloc_reqid(prompt, reqid=r if chosen else None)
        self.adopt(got, self.stamps(0))

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def step(self, data):
        lens = [0] * self.B
        grow = data.draw(st.lists(st.integers(0, 40), min_size=self.B, max_size=self.B), label="grow")
        for r in sorted(self.rows):
            lens[r] = min(L, self.lens[r] + grow[r])
        before = snapshot(self.kv)
        if not self.kv.step(lens):
            # refused: nothing this step asked for was promised; the table must still be consistent
            assert snapshot(self.kv)[2] == before[2]
            return
        for r in self.rows:
            assert self.kv.mapped_tokens(r) >= lens[r]
            new = self.stamps(lens[r] - len(self.rows[r])) if lens[r] > len(self.rows[r]) else None
            if new is not None:
                write_rows(self.kv, r, len(self.rows[r]), new)
                self.rows[r] = torch.cat([self.rows[r], new])
                self.lens[r] = lens[r]

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def fork(self, data):
        src = self.pick(data, self.rows)
        n = self.upto(data, len(self.rows[src]))  # only written rows: shared ones are never rewritten
        before = snapshot(self.kv)
        try:
            child = self.kv.fork(src, n)
        except (vattn.OutOfReqids, vattn.OutOfPages):
            assert snapshot(self.kv) == before
            return
        shared = n // self.pt
        assert self.kv.page_ids(child)[:shared] == self.kv.page_ids(src)[:shared]
        self.adopt(child, self.rows[src][:n])

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def retain(self, data):
        r = self.pick(data, self.rows)
        n = self.upto(data, len(self.rows[r]))
        h = self.kv.retain_prefix(r, n)
        assert h.num_tokens == n // self.pt * self.pt
        assert h.page_ids == self.kv.page_ids(r)[:n // self.pt]
        self.handles.append((h, self.rows[r][:h.num_tokens].clone()))

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def attach(self, data):
        h, rows = self.handles[data.draw(st.integers(0, 63)) % len(self.handles)]
        try:
            r = self.kv.alloc_reqid(0)
        except vattn.OutOfReqids:
            return
        assert self.kv.attach_prefix(h, r) == h.num_tokens
        self.adopt(r, rows)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def release(self, data):
        i = data.draw(st.integers(0, 63)) % len(self.handles)
        h, _ = self.handles.pop(i)
        h.release()
        with pytest.raises(ValueError, match="released"):
            self.kv.attach_prefix(h, 0)

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def share_with_map_pages(self, data):
        """The primitive: a fresh reqid gets the first whole pages of another, in one batched call."""
        src = self.pick(data, self.rows)
        pages = self.upto(data, len(self.rows[src]) // self.pt)
        try:
            r = self.kv.alloc_reqid(0)
        except vattn.OutOfReqids:
            return
        self.kv.unmap_pages([r], [0])  # a reused reqid may still hold pages kept for reuse
        self.kv.map_pages([r], [0], self.kv.page_ids(src)[:pages], [pages])
        self.adopt(r, self.rows[src][:pages * self.pt])
        step_ok = self.kv.step([self.lens[x] if x in self.rows else 0 for x in range(self.B)])
        assert step_ok  # nothing grew: nothing to map

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def truncate(self, data):
        r = self.pick(data, self.rows)
        keep = self.upto(data, self.kv._pages.mapped_pages(r))
        self.kv.unmap_pages([r], [keep])
        n = min(len(self.rows[r]), keep * self.pt)
        self.adopt(r, self.rows[r][:n])

    @rule(max_pages=st.one_of(st.none(), st.integers(0, 8)))
    def reclaim(self, max_pages):
        self.kv.reclaim(max_pages)

    @invariant()
    def rows_read_back_and_pages_are_counted_once(self):
        if not hasattr(self, "kv"):
            return
        kv = self.kv
        kv.wait_idle()
        for r, rows in self.rows.items():
            assert_rows(kv, r, rows)
        for h, rows in self.handles:
            assert not h.released and len(rows) == h.num_tokens
        nb = kv.config.num_buffers
        tables = [kv.page_ids(r) for r in range(self.B)]
        mapped = set().union(*map(set, tables))
        held = set().union(set(), *(set(h.page_ids) for h, _ in self.handles))
        s = kv.stats()
        assert s["pages_mapped"] == nb * len(mapped)
        assert s["pages_in_use"] == nb * len(mapped | held) <= s["pages_total"]
        assert s["page_mappings"] == nb * sum(map(len, tables))
        assert s["prefix_handles"] == len(self.handles)
        assert s["reqids_allocated"] == len(self.rows)
        assert_invariants(kv)


SharingMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("VATTN_SHARING_EXAMPLES", "250")), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_sharing_schedules_agree_with_the_model = SharingMachine.TestCase
