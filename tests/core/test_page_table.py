"""The page table (csrc/core/page_table.h) and the policy (csrc/core/policy.h)
alone, through vattn._testing: no backend, no lock, no thread.

Exact expectations on tiny tables first (which ids come out of the pool and in
what order, reference counts, orphans, handles, counters), then random
sequences of the operations the page manager performs, checked step by step
against the reference model tests/core/page_model.py, then the policy's
decisions: the best-fit reqid, the reclaim plan, the mapper's next batch.
"""

from __future__ import annotations

import random

import pytest

from page_model import PageTableModel, best_fit_reqid
from vattn import _C
from vattn import _testing as T

NOT_IN_USE_NOR_POOL = "is neither in use nor in the pool"


def addr(reqid: int, pos: int, buffer: int) -> int:
    """A made-up address of (buffer, reqid, position): the table stores them, never reads them."""
    return (buffer << 32) | (reqid << 16) | pos


def grown(table, reqid: int, count: int) -> list[int]:
    """What a landed map job records: ids out of the pool, created, appended to reqid."""
    ids, to_create = table.claim(count)
    table.mark_created(to_create)
    table.append(reqid, ids)
    return ids


def unmapped(table, reqid: int, keep: int) -> list[int]:
    """What a fully successful unmap of positions keep.. of reqid records."""
    cut = table.cut_tail(reqid, keep)
    for page_id in cut:
        table.count_unmapped(table.num_buffers)
        table.drop_map_ref(page_id)
    return cut


# ---- exact expectations ------------------------------------------------------------


def test_ids_come_smallest_first_then_last_freed_first():
    t = T.PageTable(num_reqids=3, num_buffers=2, num_ids=6)
    assert (t.uncreated, t.free_ids, t.available) == ([5, 4, 3, 2, 1, 0], [], 6)
    ids, to_create = t.claim(3)
    assert ids == to_create == [0, 1, 2]
    assert NOT_IN_USE_NOR_POOL in t.check_invariants()  # in flight: out of the pool, not referenced yet
    t.mark_created(to_create)
    t.append(0, ids)
    assert t.check_invariants() == ""
    assert [t.refs(i) for i in range(6)] == [1, 1, 1, 0, 0, 0]
    s = t.stats()
    assert (s["pages_created"], s["pages_mapped"], s["pages_in_use"], s["page_mappings"]) == (6, 6, 6, 6)
    assert (s["pages_mapped_peak"], s["pages_free_low"], s["pages_total"]) == (6, 6, 12)

    assert t.cut_tail(0, 1) == [1, 2]
    assert t.ids(0) == [0] and t.refs(1) == t.refs(2) == 1  # cut, not yet reported unmapped
    for page_id in (1, 2):
        t.count_unmapped(2)
        t.drop_map_ref(page_id)
    assert t.free_ids == [1, 2] and t.check_invariants() == ""
    assert t.stats()["page_unmaps"] == 4
    assert t.claim(1) == ([2], [])  # the last freed
    assert t.claim(2) == ([1, 3], [3])  # the pool's rest, then the smallest uncreated
    t.return_fresh([1, 3])  # the job failed before 3 was created
    assert (t.free_ids, t.uncreated) == ([1], [5, 4, 3])
    t.append(1, [2])
    assert t.check_invariants() == ""
    s = t.stats()
    assert (s["pages_mapped"], s["pages_mapped_peak"], s["pages_free_low"]) == (4, 6, 6)


def test_uncreated_ids_go_back_in_order():
    t = T.PageTable(num_reqids=1, num_buffers=1, num_ids=5)
    ids, _ = t.claim(3)
    t.return_fresh([2, 0, 1])  # creation failed
    assert t.uncreated == [4, 3, 2, 1, 0] and t.check_invariants() == ""
    created = t.take_uncreated(2)  # a create batch
    assert created == [0, 1]
    t.mark_created(created)
    t.return_fresh(created)
    assert (t.free_ids, t.uncreated, t.stats()["pages_created"]) == ([0, 1], [4, 3, 2], 2)
    assert t.check_invariants() == ""


def test_a_shared_id_counts_once_per_page_and_once_per_slot():
    t = T.PageTable(num_reqids=2, num_buffers=2, num_ids=4)
    grown(t, 0, 2)
    t.append(1, [0])  # fork / map_pages share position 0
    assert (t.refs(0), t.maps(0), t.first_shared(0), t.first_shared(1)) == (2, 2, 0, 0)
    s = t.stats()
    assert (s["pages_mapped"], s["pages_in_use"], s["page_mappings"]) == (4, 4, 6)
    unmapped(t, 1, 0)
    assert (t.refs(0), t.free_ids, t.first_shared(0)) == (1, [], 2)  # still mapped in reqid 0
    assert t.check_invariants() == ""


def test_a_handle_keeps_its_ids_out_of_the_pool():
    t = T.PageTable(num_reqids=1, num_buffers=1, num_ids=4)
    grown(t, 0, 3)
    h = t.retain([0, 1])
    assert (h, t.handle_ids(h), t.holds(0), t.stats()["prefix_handles"]) == (1, [0, 1], 1, 1)
    assert t.first_shared(0) == 0
    unmapped(t, 0, 0)
    assert t.free_ids == [2]  # the unheld one only
    s = t.stats()
    assert (s["pages_mapped"], s["pages_in_use"]) == (0, 2)
    assert t.release_handle(h) and t.free_ids == [2, 0, 1]
    assert not t.release_handle(h) and t.handle_ids(h) is None
    assert t.retain([]) == 2  # handles are numbered on
    assert t.check_invariants() == ""


def test_a_hold_alone_keeps_an_id_in_use():
    t = T.PageTable(num_reqids=1, num_buffers=2, num_ids=4)
    ids, to_create = t.claim(2)
    t.mark_created(to_create)
    h = t.retain(ids)  # held, mapped nowhere
    s = t.stats()
    assert (s["pages_in_use"], s["pages_free_low"], s["pages_mapped"], s["pages_mapped_peak"]) == (4, 4, 0, 0)
    assert t.check_invariants() == ""
    t.release_handle(h)
    assert (t.free_ids, t.stats()["pages_free_low"]) == ([0, 1], 4)


def test_a_partly_unmapped_position_is_an_orphan_until_retried():
    t = T.PageTable(num_reqids=2, num_buffers=2, num_ids=4)
    grown(t, 0, 2)
    assert t.cut_tail(0, 0) == [0, 1]
    t.count_unmapped(2)
    t.drop_map_ref(0)
    t.count_unmapped(1)  # buffer 1 of position 1 stayed mapped
    t.keep_orphan(0, 1, 1, [addr(0, 1, 1)])
    assert (t.free_ids, t.refs(1), t.orphans_of(0), t.orphans) == ([0], 1, 1, [(0, 1, 1, [addr(0, 1, 1)])])
    s = t.stats()
    assert (s["pages_orphaned"], s["page_mappings"], s["pages_mapped"], s["page_unmaps"]) == (1, 1, 2, 3)
    assert t.check_invariants() == ""
    assert t.claim(2) == ([0, 2], [2])  # never the orphan's id
    t.return_fresh([0, 2])
    assert not t.settle_orphan(0, 0)
    assert t.settle_orphan(0, 1)
    assert (t.orphans, t.orphans_of(0), t.free_ids) == ([], 0, [0, 1])
    assert t.stats()["pages_orphaned"] == 0 and t.check_invariants() == ""


def test_a_failed_job_keeps_the_fresh_ids_it_could_not_unmap():
    t = T.PageTable(num_reqids=1, num_buffers=2, num_ids=4)
    ids, to_create = t.claim(2)
    t.mark_created(to_create)
    t.add_orphan(0, 0, ids[0], [addr(0, 0, 0)])  # the undo failed for one address
    t.return_fresh(ids)
    assert (t.free_ids, t.refs(0), t.ids(0), t.orphans_of(0)) == ([1], 1, [], 1)
    s = t.stats()
    assert (s["pages_orphaned"], s["page_mappings"], s["pages_mapped"], s["pages_in_use"]) == (1, 1, 2, 2)
    assert t.check_invariants() == ""


def test_a_pin_keeps_an_id_that_moves_out_of_the_pool():
    """map_pages keeping y and moving it to position 0: its new reference is
    taken before the old one goes, or it passes through the free pool while
    mapped (the defect the invariant check catches below)."""
    for pinned in (True, False):
        t = T.PageTable(num_reqids=1, num_buffers=2, num_ids=4)
        x, y = grown(t, 0, 2)
        if pinned:
            t.add_hold(y)
        unmapped(t, 0, 0)
        t.append(0, [y])
        if pinned:
            t.drop_hold(y)
            assert (t.free_ids, t.refs(y), t.check_invariants()) == ([x], 1, "")
        else:
            assert t.check_invariants() == f"id {y} is in use and in the pool"


def test_external_ids_have_no_pool():
    t = T.PageTable(num_reqids=2, num_buffers=2, num_ids=8, external_ids=True)
    assert (t.available, t.uncreated, t.free_ids) == (0, [], [])
    missing = t.uncreated_among([3, 5, 3])
    assert missing == [3, 5]
    t.mark_created(missing)
    assert t.uncreated_among([3, 5, 6]) == [6]
    t.append(0, [3, 5, 3])
    assert (t.refs(3), t.stats()["pages_in_use"], t.check_invariants()) == (2, 4, "")
    unmapped(t, 0, 0)
    assert (t.free_ids, t.stats()["pages_in_use"], t.created(3)) == ([], 0, True)  # the caller's ids
    assert t.check_invariants() == ""


def test_slots_and_tokens():
    t = T.PageTable(num_reqids=3, num_buffers=1, num_ids=2)
    t.allocate(1)
    t.allocate(2)
    t.set_tokens(1, 40)
    t.set_tokens(2, 7)
    t.set_tokens(1, 41)
    s = t.stats()
    assert (s["reqids_allocated"], s["tokens_active"], t.tokens(1)) == (2, 48, 41)
    t.release(1)
    s = t.stats()
    assert (s["reqids_allocated"], s["tokens_active"], t.tokens(1), t.allocated(1)) == (1, 7, 0, False)
    grown(t, 0, 1)
    t.clear()  # the manager closed
    s = t.stats()
    assert (t.ids(0), t.free_ids, t.uncreated, s["reqids_allocated"], s["tokens_active"], s["pages_mapped"]) == (
        [], [], [], 0, 0, 0)


def test_the_probe_refuses_what_would_corrupt_it():
    t = T.PageTable(num_reqids=1, num_buffers=1, num_ids=2)
    for bad in (lambda: t.claim(3), lambda: t.append(1, [0]), lambda: t.append(0, [2]), lambda: t.drop_map_ref(0),
                lambda: t.drop_hold(0), lambda: t.settle_orphan(0, 0), lambda: t.release(0)):
        with pytest.raises(ValueError):
            bad()
    assert t.check_invariants() == ""


# ---- random sequences against the reference model -------------------------------------------

REQIDS, IDS, MAX_POSITIONS = 4, 12, 8


def agree(t, m: PageTableModel) -> None:
    for s in range(REQIDS):
        assert (t.ids(s), t.allocated(s), t.tokens(s)) == (m.reqids[s], m.allocated[s], m.tokens[s]), f"reqid {s}"
        assert t.orphans_of(s) == sum(o[0] == s for o in m.orphans)
    assert (t.free_ids, t.uncreated) == (m.free, m.uncreated)
    assert [(t.maps(i), t.holds(i), t.created(i)) for i in range(IDS)] == [
        (m.maps(i), m.holds(i), i in m.created) for i in range(IDS)]
    assert t.orphans == [tuple(o) for o in m.orphans]
    assert t.stats() == m.stats()
    assert t.check_invariants() == ""


def agree_on_policy(t, m: PageTableModel, rng: random.Random) -> None:
    mapped = [len(ids) for ids in m.reqids]
    for want in (-1, rng.randint(0, MAX_POSITIONS)):
        expected = best_fit_reqid(mapped, m.allocated, None if want < 0 else want)
        assert T.best_free_reqid(t, want) == (-1 if expected is None else expected)
    want, keep = rng.randint(0, IDS), rng.choice([-1, *range(REQIDS)])
    limit = rng.choice([None, rng.randint(1, 6)])
    got = T.plan_reclaim(t, want, keep, 2**64 - 1 if limit is None else limit)
    assert got == m.plan_reclaim(want, None if keep < 0 else keep, limit)


class Driver:
    """Applies one random page-manager operation to the table and the model."""

    def __init__(self, rng: random.Random, num_buffers: int, external: bool):
        self.rng, self.nb, self.external = rng, num_buffers, external
        self.t = T.PageTable(REQIDS, num_buffers, IDS, external_ids=external)
        self.m = PageTableModel(REQIDS, num_buffers, IDS, external)
        self.handles: list[int] = []

    def step(self) -> None:
        ops = [self.toggle_slot, self.share, self.unmap_tail, self.unmap_tail, self.settle, self.retain,
               self.release]
        if not self.external:
            ops += [self.grow, self.grow, self.failed_job, self.move, self.create]
        self.rng.choice(ops)()

    def slot_with_room(self) -> int | None:
        room = [s for s in range(REQIDS) if len(self.m.reqids[s]) < MAX_POSITIONS]
        return self.rng.choice(room) if room else None

    def toggle_slot(self) -> None:
        s = self.rng.randrange(REQIDS)
        if self.m.allocated[s]:
            self.t.release(s)
            self.m.release(s)
        else:
            self.t.allocate(s)
            self.m.allocate(s)
            tokens = self.rng.randint(0, 256)
            self.t.set_tokens(s, tokens)
            self.m.set_tokens(s, tokens)

    def grow(self) -> None:
        s = self.slot_with_room()
        if s is None or not self.m.free and not self.m.uncreated:
            return
        n = self.rng.randint(1, min(MAX_POSITIONS - len(self.m.reqids[s]), len(self.m.free) + len(self.m.uncreated)))
        got = self.t.claim(n)
        assert got == self.m.claim(n)
        ids, to_create = got
        for side in (self.t, self.m):
            side.mark_created(to_create)
            side.append(s, ids)

    def failed_job(self) -> None:
        """A map job that failed: fresh ids go back, but the ones whose undo
        failed stay as orphans (only once creation succeeded)."""
        s = self.rng.randrange(REQIDS)
        if not self.m.free and not self.m.uncreated:
            return
        n = self.rng.randint(1, min(3, len(self.m.free) + len(self.m.uncreated)))
        got = self.t.claim(n)
        assert got == self.m.claim(n)
        ids, to_create = got
        if self.rng.random() < 0.5:  # creation failed: nothing was mapped
            for side in (self.t, self.m):
                side.return_fresh(ids)
            return
        first = len(self.m.reqids[s])
        orphans = [(s, first + i, ids[i], [addr(s, first + i, b) for b in range(self.rng.randint(1, self.nb))])
                   for i in range(self.rng.randint(0, n))]
        for side in (self.t, self.m):
            side.mark_created(to_create)
            for orphan in orphans:
                side.add_orphan(*orphan)
            side.return_fresh(ids)

    def share(self) -> None:
        """fork / map_pages: ids in use (managed), or any ids (external, created on first use)."""
        s = self.slot_with_room()
        pool = list(range(IDS)) if self.external else self.m.in_use()
        if s is None or not pool:
            return
        ids = self.rng.choices(pool, k=self.rng.randint(1, MAX_POSITIONS - len(self.m.reqids[s])))
        missing = self.t.uncreated_among(ids)
        assert missing == list(dict.fromkeys(i for i in ids if i not in self.m.created))
        for side in (self.t, self.m):
            side.mark_created(missing)
            side.append(s, ids)

    def stays_mapped(self, reqid: int, pos: int) -> list[int]:
        if self.rng.random() > 0.2:
            return []
        return [addr(reqid, pos, b) for b in sorted(self.rng.sample(range(self.nb), self.rng.randint(1, self.nb)))]

    def unmap_tail(self, keep: int | None = None, reqid: int | None = None, stills: list | None = None) -> None:
        s = self.rng.randrange(REQIDS) if reqid is None else reqid
        keep = self.rng.randint(0, len(self.m.reqids[s])) if keep is None else keep
        cut = self.t.cut_tail(s, keep)
        assert cut == self.m.reqids[s][keep:]
        stills = [self.stays_mapped(s, keep + k) for k in range(len(cut))] if stills is None else stills
        for k, page_id in enumerate(cut):  # finish_unmap, position by position
            self.t.count_unmapped(self.nb - len(stills[k]))
            if stills[k]:
                self.t.keep_orphan(s, keep + k, page_id, stills[k])
            else:
                self.t.drop_map_ref(page_id)
        self.m.unmap_tail(s, keep, stills)

    def settle(self) -> None:
        if not self.m.orphans:
            return
        k = self.rng.randrange(len(self.m.orphans))
        done = self.rng.randint(0, len(self.m.orphans[k][3]))
        assert self.t.settle_orphan(k, done) == self.m.settle_orphan(k, done)

    def retain(self) -> None:
        s = self.rng.randrange(REQIDS)
        ids = self.m.reqids[s][: self.rng.randint(0, len(self.m.reqids[s]))]
        h = self.t.retain(ids)
        assert h == self.m.retain(ids)
        self.handles.append(h)

    def release(self) -> None:
        if self.handles:
            h = self.rng.choice(self.handles)  # sometimes one released already
            assert self.t.release_handle(h) == self.m.release_handle(h)

    def move(self) -> None:
        """map_pages of ids in use over positions start.. of a reqid: pinned
        first, so an id moving within the reqid or from another stays out of the pool."""
        s = self.rng.randrange(REQIDS)
        in_use = self.m.in_use()
        if not in_use:
            return
        start = self.rng.randint(0, min(len(self.m.reqids[s]), MAX_POSITIONS - 1))
        row = self.rng.choices(in_use, k=self.rng.randint(1, MAX_POSITIONS - start))
        for page_id in row:
            self.t.add_hold(page_id)
            self.m.pin(page_id)
        self.unmap_tail(start, s, [[] for _ in self.m.reqids[s][start:]])
        for side in (self.t, self.m):
            side.append(s, row)
        for page_id in row:
            self.t.drop_hold(page_id)
            self.m.unpin(page_id)

    def create(self) -> None:
        n = self.rng.randint(1, 3)
        created = self.t.take_uncreated(n)
        assert created == self.m.take_uncreated(n)
        for side in (self.t, self.m):
            side.mark_created(created)
            side.return_fresh(created)


@pytest.mark.parametrize("num_buffers", [1, 3])
@pytest.mark.parametrize("external", [False, True], ids=["managed", "external"])
@pytest.mark.parametrize("seed", range(4))
def test_random_operations_agree_with_the_model(seed, external, num_buffers):
    rng = random.Random(seed * 100 + num_buffers * 10 + external)
    d = Driver(rng, num_buffers, external)
    for _ in range(250):
        d.step()
        agree(d.t, d.m)
        agree_on_policy(d.t, d.m, rng)


# ---- the policy ---------------------------------------------------------------------------


def table_with(mapped: list[int], allocated: list[int] = (), num_ids: int = 16):
    t = T.PageTable(num_reqids=len(mapped), num_buffers=1, num_ids=num_ids)
    for s, n in enumerate(mapped):
        if n:
            grown(t, s, n)
    for s in allocated:
        t.allocate(s)
    return t


def test_best_free_slot_fits_the_prompt():
    t = table_with([3, 1, 5, 0])
    assert T.best_free_reqid(t, -1) == 2  # no prompt: the most pages
    assert [T.best_free_reqid(t, want) for want in (0, 1, 2, 4, 6)] == [3, 1, 0, 2, 2]
    t.allocate(2)
    assert (T.best_free_reqid(t, -1), T.best_free_reqid(t, 6), T.emptiest_free_reqid(t)) == (0, 0, 3)
    for s in (0, 1, 3):
        t.allocate(s)
    assert (T.best_free_reqid(t, -1), T.emptiest_free_reqid(t)) == (-1, -1)
    assert T.best_free_reqid(table_with([2, 2, 2]), 1) == 0  # ties: the lowest reqid


def test_reclaim_cuts_tails_of_the_smallest_free_slots_first_never_the_kept_one():
    t = table_with([3, 1, 2, 0], allocated=[2])  # reqid 0: ids 0-2, reqid 1: id 3, reqid 2 (active): 4-5
    assert T.plan_reclaim(t, 2) == ([(1, 0), (0, 2)], 2)
    assert T.plan_reclaim(t, 2, keep_reqid=1) == ([(0, 1)], 2)
    assert T.plan_reclaim(t, 10) == ([(1, 0), (0, 0)], 4)  # never an allocated reqid
    assert T.plan_reclaim(t, 10, max_positions=2) == ([(1, 0), (0, 2)], 2)
    assert T.plan_reclaim(t, 0) == ([], 0)


def test_reclaim_counts_an_id_only_when_its_last_reference_goes():
    t = table_with([2, 0])  # reqid 0: ids 0, 1
    t.append(1, [1])  # reqid 1 shares id 1
    assert T.plan_reclaim(t, 1) == ([(1, 0), (0, 1)], 1)  # both of id 1's positions are cut
    h = t.retain([1])
    assert T.plan_reclaim(t, 1) == ([(1, 0), (0, 0)], 1)  # id 1 is held: only id 0 comes back
    t.release_handle(h)
    external = T.PageTable(num_reqids=1, num_buffers=1, num_ids=2, external_ids=True)
    external.append(0, [0])
    assert T.plan_reclaim(external, 1) == ([], 0)  # nothing to reclaim into


def test_free_ids_are_uncreated_again_and_idle_ids_count_what_no_request_uses():
    t = table_with([3, 2, 2], allocated=[0], num_ids=10)  # reqid 0: ids 0-2 in use; reqids 1, 2: 3-4, 5-6
    assert t.idle_ids() == 4  # the free reqids' ids
    t.append(1, [0])  # shared with the allocated reqid: in use
    h = t.retain([6])  # held by a handle: in use
    assert t.idle_ids() == 3
    t.release_handle(h)
    unmapped(t, 2, 0)  # ids 5 then 6 go back to the pool, still created
    assert (t.free_ids, t.idle_ids()) == ([5, 6], 4)
    assert t.uncreate_free(1) == [5]  # freed longest ago first
    assert (t.free_ids, t.uncreated[-1], t.stats()["pages_created"]) == ([6], 5, 6)
    assert t.check_invariants() == ""
    assert t.uncreate_free(5) == [6] and t.uncreated == [9, 8, 7, 6, 5]  # smallest at the back again
    assert t.claim(2) == ([5, 6], [5, 6])
    external = T.PageTable(num_reqids=1, num_buffers=1, num_ids=2, external_ids=True)
    assert external.uncreate_free(2) == []


GEOMETRY = dict(page_size=4096, bytes_per_token=128, max_tokens=256)  # 32 tokens a page, 8 positions a reqid


KNOBS = {knob["name"] for knob in _C.POLICY_KNOBS}


def plan(t, **options):
    """The mapper's plan; options name policy knobs (the core's defaults for the rest) and plan arguments."""
    policy = _C.PolicyConfig(**{k: v for k, v in options.items() if k in KNOBS})
    return T.plan_mapper_round(t, **GEOMETRY, policy=policy, **{k: v for k, v in options.items() if k not in KNOBS})


def test_lookahead_positions():
    t = table_with([1, 0])
    t.allocate(0)
    for tokens, lookahead, positions in ((32, 1, 2), (31, 1, 1), (0, 0, 0), (250, 10, 8)):
        t.set_tokens(0, tokens)
        assert T.lookahead_positions(t, 0, **GEOMETRY, policy=_C.PolicyConfig(lookahead_tokens=lookahead)) == positions


@pytest.mark.parametrize("page_size", [4096, 65536, 2 << 20, 3 * 4096, 12345 * 64])
def test_positions_for_tokens_is_the_ceiling_for_any_page_size(page_size):
    """Pages of a power of two take a shift, the others a division: both are
    ceil(tokens * bytes_per_token / page_size), at every page boundary."""
    t = table_with([1, 0])
    t.allocate(0)
    bytes_per_token, max_tokens = 96, 1 << 22
    per_page = page_size / bytes_per_token
    boundaries = {int(k * per_page) + d for k in (1, 2, 7, 100) for d in (-1, 0, 1)}
    for tokens in sorted({0, 1, 2, max_tokens} | {n for n in boundaries if n <= max_tokens}):
        t.set_tokens(0, tokens)
        got = T.lookahead_positions(t, 0, page_size=page_size, bytes_per_token=bytes_per_token, max_tokens=max_tokens,
                                    policy=_C.PolicyConfig(lookahead_tokens=0))
        assert got == -(-tokens * bytes_per_token // page_size), (page_size, tokens)


def test_mapper_grows_active_slots_within_the_batch_budget():
    t = table_with([1, 1, 0])
    assert plan(t)["kind"] == "idle"
    for s in (0, 1):
        t.allocate(s)
        t.set_tokens(s, 32)  # one full page each
    assert plan(t) == {"kind": "grow", "reclaim": [], "grows": [(0, 1), (1, 1)], "create_ids": 0}
    assert plan(t, lookahead_tokens=33)["grows"] == [(0, 2), (1, 2)]
    assert plan(t, lookahead_tokens=33, max_round_ids=3)["grows"] == [(0, 2), (1, 1)]
    # Nothing to map: keep one created id per active reqid in the pool.
    assert plan(t, lookahead_tokens=0) == {"kind": "create", "reclaim": [], "grows": [], "create_ids": 2}
    assert plan(t, lookahead_tokens=0, max_round_ids=1)["create_ids"] == 1
    t.add_orphan(0, 1, 0, [addr(0, 1, 0)])  # a reqid with orphans waits for the retry
    assert plan(t)["grows"] == [(1, 1)]


def test_mapper_pre_maps_the_next_slot_above_the_reclaim_floor_only():
    t = table_with([0, 1, 0], num_ids=6)  # reqid 1 is what alloc hands out next
    assert plan(t, eager=True, eager_tokens=96)["grows"] == [(1, 2)]
    assert plan(t, eager=True, eager_tokens=96, reclaim_floor_ids=4)["grows"] == [(1, 1)]
    assert plan(t, eager=True, eager_tokens=96, reclaim_floor_ids=5)["kind"] == "idle"
    t.append(0, t.ids(1))  # the next reqid's page is shared: it is trimmed when handed out, not grown
    assert plan(t, eager=True, eager_tokens=96)["kind"] == "idle"


def test_mapper_creates_only_what_its_limits_allow():
    t = table_with([1, 0, 0], num_ids=6)
    t.allocate(0)
    t.set_tokens(0, 32)
    assert plan(t, lookahead_tokens=64)["grows"] == [(0, 2)]
    assert plan(t, lookahead_tokens=64, creatable_ids=1)["grows"] == [(0, 1)]  # a budget's room
    assert plan(t, lookahead_tokens=64, creatable_ids=0)["kind"] == "idle"  # a refused creation
    unmapped(t, 0, 0)
    t.set_tokens(0, 0)
    assert (t.free_ids, plan(t, lookahead_tokens=64, creatable_ids=0)["kind"]) == ([0], "idle")
    t.set_tokens(0, 32)
    assert plan(t, lookahead_tokens=64, creatable_ids=0)["grows"] == [(0, 1)]  # free ids need no creation
    # Not speculative (budget contention, idle release): no eager pages, no created spares.
    t = table_with([0, 0], num_ids=6)
    assert plan(t, eager=True, eager_tokens=96)["grows"] == [(0, 3)]
    assert plan(t, eager=True, eager_tokens=96, speculative=False)["kind"] == "idle"
    t = table_with([1, 0], allocated=[0], num_ids=6)
    t.set_tokens(0, 32)  # mapped as far as it looks ahead: a spare id would be created
    assert plan(t, lookahead_tokens=0) == {"kind": "create", "reclaim": [], "grows": [], "create_ids": 1}
    assert plan(t, lookahead_tokens=0, speculative=False)["kind"] == "idle"
    assert plan(t, lookahead_tokens=0, creatable_ids=0)["kind"] == "idle"


def test_mapper_reclaims_below_the_floor_but_never_the_eager_slot():
    t = table_with([1, 2, 3], num_ids=6)  # the pool is empty
    assert plan(t, reclaim_floor_ids=2) == {"kind": "reclaim", "reclaim": [(0, 0), (1, 1)], "grows": [],
                                            "create_ids": 0}
    assert plan(t, reclaim_floor_ids=2, max_round_ids=1)["reclaim"] == [(0, 0)]
    assert plan(t, reclaim_floor_ids=2, eager=True)["reclaim"] == [(0, 0), (1, 1)]
    assert plan(t, reclaim_floor_ids=4, eager=True)["reclaim"] == [(0, 0), (1, 0)]  # reqid 2 is next
    assert plan(t, reclaim_floor_ids=2, deferred_reclaim=False)["kind"] == "idle"
