"""A pure-Python model of the page bookkeeping, for randomized comparison.

It states the contract in the simplest terms: a reqid's mapping is a prefix of
`mapped[s]` pages per buffer; step succeeds iff the missing pages fit in what is
neither free-of-charge nor held by an active reqid; freed reqids keep pages until
a step needs them (smallest reqids first, tail pages first).
"""

from __future__ import annotations

import math


def best_fit_reqid(mapped: list[int], allocated: list[bool], want_pages: int | None) -> int | None:
    """The free reqid a new request gets: the most pages mapped (want_pages
    None), else the fewest that cover want_pages, else the most; ties to the
    lowest reqid. None when every reqid is allocated."""
    free = [s for s, a in enumerate(allocated) if not a]
    if not free:
        return None
    largest = max(free, key=lambda s: (mapped[s], -s))
    if want_pages is None:
        return largest
    covering = [s for s in free if mapped[s] >= want_pages]
    return min(covering, key=lambda s: (mapped[s], s)) if covering else largest


def reclaim_victims(mapped: list[int], allocated: list[bool], keep: int | None = None) -> list[int]:
    """Free reqids whose pages may be reclaimed, in order: smallest first (the
    largest are what best_fit_reqid hands out next), never ``keep``."""
    return sorted((s for s in range(len(mapped)) if not allocated[s] and mapped[s] and s != keep),
                  key=lambda s: (mapped[s], s))


class PageModel:
    def __init__(self, num_reqids: int, num_buffers: int, num_pages: int, token_bytes: int, page_size: int):
        self.num_buffers = num_buffers
        self.num_pages = num_pages
        self.token_bytes = token_bytes
        self.page_size = page_size
        self.mapped = [0] * num_reqids  # pages per buffer
        self.allocated = [False] * num_reqids

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens * self.token_bytes / self.page_size)

    def used(self) -> int:
        return sum(self.mapped) * self.num_buffers

    def alloc(self, prompt_len: int | None) -> int | None:
        best = best_fit_reqid(self.mapped, self.allocated, None if prompt_len is None else self.pages_for(prompt_len))
        if best is not None:
            self.allocated[best] = True
        return best

    def free(self, reqid: int) -> None:
        assert self.allocated[reqid]
        self.allocated[reqid] = False

    def step(self, lens: list[int]) -> bool:
        need = [self.pages_for(n) for n in lens]
        deficit = sum(max(0, need[s] - self.mapped[s]) for s in range(len(lens))) * self.num_buffers
        available = self.num_pages - self.used()
        if deficit > available:
            reclaimable = sum(self.mapped[s] for s in range(len(lens)) if not self.allocated[s]) * self.num_buffers
            if deficit > available + reclaimable:
                return False
            want = deficit - available
            victims = reclaim_victims(self.mapped, self.allocated)
            got = 0
            for s in victims:
                while self.mapped[s] and got < want:
                    self.mapped[s] -= 1
                    got += self.num_buffers
        for s, n in enumerate(need):
            self.mapped[s] = max(self.mapped[s], n)
        return True


class PageTableModel:
    """The page table's contract (csrc/core/page_table.h) in the simplest terms.

    State is what a reader would draw: each reqid's list of ids, the orphans,
    the handles (and pins), the free stack and the uncreated list. Mapping
    references and the occupancy counters are derived from that state, not
    counted along the way. Every operation is one the page manager performs
    (a map job landing, a tail unmapped, an orphan retried, ...).
    """

    def __init__(self, num_reqids: int, num_buffers: int, num_ids: int, external: bool = False):
        self.num_buffers, self.num_ids, self.external = num_buffers, num_ids, external
        self.reqids: list[list[int]] = [[] for _ in range(num_reqids)]
        self.allocated = [False] * num_reqids
        self.tokens = [0] * num_reqids
        self.free: list[int] = []  # the back is handed out next
        self.uncreated: list[int] = [] if external else list(range(num_ids - 1, -1, -1))  # back: smallest
        self.created: set[int] = set()
        self.orphans: list[tuple[int, int, int, list[int]]] = []  # (reqid, position, id, addresses still mapped)
        self.handles: dict[int, list[int]] = {}
        self.next_handle = 1
        self.pins: list[int] = []  # holds outside any handle
        self.cut: list[int] = []  # ids of positions cut and not yet reported unmapped
        self.page_unmaps = 0
        self.pages_total = num_ids * num_buffers
        self.peak_mapped, self.low_free = 0, self.pages_total

    # ---- derived -------------------------------------------------------------------
    def maps(self, page_id: int) -> int:
        return (sum(ids.count(page_id) for ids in self.reqids) + sum(o[2] == page_id for o in self.orphans)
                + self.cut.count(page_id))

    def holds(self, page_id: int) -> int:
        return sum(ids.count(page_id) for ids in self.handles.values()) + self.pins.count(page_id)

    def refs(self, page_id: int) -> int:
        return self.maps(page_id) + self.holds(page_id)

    def in_use(self) -> list[int]:
        return [i for i in range(self.num_ids) if self.refs(i)]

    def stats(self) -> dict:
        nb = self.num_buffers
        orphaned = sum(len(o[3]) for o in self.orphans)
        return {"pages_total": self.pages_total, "pages_created": nb * len(self.created),
                "pages_mapped": nb * sum(self.maps(i) > 0 for i in range(self.num_ids)),
                "pages_in_use": nb * len(self.in_use()),
                "page_mappings": nb * sum(map(len, self.reqids)) + orphaned,
                "pages_mapped_peak": self.peak_mapped, "pages_free_low": self.low_free,
                "pages_orphaned": orphaned, "reqids_allocated": sum(self.allocated),
                "tokens_active": sum(self.tokens), "prefix_handles": len(self.handles),
                "page_unmaps": self.page_unmaps}

    def _note(self) -> None:  # after anything that adds a reference
        s = self.stats()
        self.peak_mapped = max(self.peak_mapped, s["pages_mapped"])
        self.low_free = min(self.low_free, self.pages_total - s["pages_in_use"])

    def _gone(self, page_id: int) -> None:  # one reference of page_id went
        if not self.refs(page_id) and not self.external:
            self.free.append(page_id)

    # ---- reqids ---------------------------------------------------------------------
    def allocate(self, reqid: int) -> None:
        self.allocated[reqid], self.tokens[reqid] = True, 0

    def release(self, reqid: int) -> None:
        self.allocated[reqid], self.tokens[reqid] = False, 0

    def set_tokens(self, reqid: int, tokens: int) -> None:
        self.tokens[reqid] = tokens

    # ---- the pool ------------------------------------------------------------------
    def claim(self, count: int) -> tuple[list[int], list[int]]:
        """Free ids first (the stack's top run, in stack order), then the smallest uncreated."""
        take = min(count, len(self.free))
        ids = self.free[len(self.free) - take:]
        del self.free[len(self.free) - take:]
        to_create = [self.uncreated.pop() for _ in range(count - take)]
        return ids + to_create, to_create

    def take_uncreated(self, count: int) -> list[int]:
        return [self.uncreated.pop() for _ in range(min(count, len(self.uncreated)))]

    def mark_created(self, ids: list[int]) -> None:
        self.created.update(ids)

    def return_fresh(self, ids: list[int]) -> None:
        for i in ids:
            if self.refs(i):
                continue  # an orphan kept it
            if i in self.created:
                self.free.append(i)
            else:
                self.uncreated.append(i)
        self.uncreated.sort(reverse=True)

    # ---- positions -----------------------------------------------------------------
    def append(self, reqid: int, ids: list[int]) -> None:
        for i in ids:
            self.reqids[reqid].append(i)
            self._note()

    def unmap_tail(self, reqid: int, keep: int, still: list[list[int]]) -> None:
        """Positions keep.. of reqid are unmapped; still[k] lists the addresses
        of position keep + k that stayed mapped (an orphan when not empty)."""
        cut = self.reqids[reqid][keep:]
        del self.reqids[reqid][keep:]
        self.cut += cut
        for k, page_id in enumerate(cut):
            self.cut.remove(page_id)
            self.page_unmaps += self.num_buffers - len(still[k])
            if still[k]:
                self.orphans.append((reqid, keep + k, page_id, list(still[k])))
            else:
                self._gone(page_id)

    def add_orphan(self, reqid: int, pos: int, page_id: int, addrs: list[int]) -> None:
        self.orphans.append((reqid, pos, page_id, list(addrs)))
        self._note()

    def settle_orphan(self, k: int, done: int) -> bool:
        reqid, pos, page_id, addrs = self.orphans[k]
        self.page_unmaps += done
        if done < len(addrs):
            self.orphans[k] = (reqid, pos, page_id, addrs[done:])
            return False
        del self.orphans[k]
        self._gone(page_id)
        return True

    # ---- holds ---------------------------------------------------------------------
    def retain(self, ids: list[int]) -> int:
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.handles[handle] = []
        for i in ids:
            self.handles[handle].append(i)
            self._note()
        return handle

    def release_handle(self, handle: int) -> bool:
        ids = self.handles.get(handle)
        if ids is None:
            return False
        while ids:  # hold by hold: an id held twice goes back once
            self._gone(ids.pop(0))
        del self.handles[handle]
        return True

    def pin(self, page_id: int) -> None:
        self.pins.append(page_id)
        self._note()

    def unpin(self, page_id: int) -> None:
        self.pins.remove(page_id)
        self._gone(page_id)

    # ---- the policy's reclaim plan, restated -----------------------------------------
    def plan_reclaim(self, want: int, keep: int | None = None,
                     max_positions: int | None = None) -> tuple[list[tuple[int, int]], int]:
        """Free reqids' tails to cut so that up to ``want`` ids lose their last
        reference: victims in reclaim_victims order, each cut from its tail."""
        if self.external:
            return [], 0
        mapped = [len(ids) for ids in self.reqids]
        limit = math.inf if max_positions is None else max_positions
        cuts: dict[int, int] = {}
        plan, freed, positions = [], 0, 0
        for s in reclaim_victims(mapped, self.allocated, keep):
            if freed >= want or positions >= limit:
                break
            kept = mapped[s]
            while kept and freed < want and positions < limit:
                kept -= 1
                page_id = self.reqids[s][kept]
                cuts[page_id] = cuts.get(page_id, 0) + 1
                freed += cuts[page_id] == self.maps(page_id) and not self.holds(page_id)
                positions += 1
            plan.append((s, kept))
        return plan, freed
