"""A pure-Python model of the page bookkeeping, for randomized comparison.

It states the contract in the simplest terms: a slot's mapping is a prefix of
`mapped[s]` pages per buffer; step succeeds iff the missing pages fit in what is
neither free-of-charge nor held by an active slot; freed slots keep pages until
a step needs them (smallest slots first, tail pages first).
"""

from __future__ import annotations

import math


class PageModel:
    def __init__(self, num_slots: int, num_buffers: int, num_pages: int, token_bytes: int, page_size: int):
        self.num_buffers = num_buffers
        self.num_pages = num_pages
        self.token_bytes = token_bytes
        self.page_size = page_size
        self.mapped = [0] * num_slots  # pages per buffer
        self.allocated = [False] * num_slots

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens * self.token_bytes / self.page_size)

    def used(self) -> int:
        return sum(self.mapped) * self.num_buffers

    def alloc(self, prompt_len: int | None) -> int | None:
        free = [s for s, a in enumerate(self.allocated) if not a]
        if not free:
            return None
        if prompt_len is None:
            best = max(free, key=lambda s: (self.mapped[s], -s))
        else:
            want = self.pages_for(prompt_len)
            covering = [s for s in free if self.mapped[s] >= want]
            best = (min(covering, key=lambda s: (self.mapped[s], s)) if covering
                    else max(free, key=lambda s: (self.mapped[s], -s)))
        self.allocated[best] = True
        return best

    def free(self, slot: int) -> None:
        assert self.allocated[slot]
        self.allocated[slot] = False

    def step(self, lens: list[int]) -> bool:
        need = [self.pages_for(n) for n in lens]
        deficit = sum(max(0, need[s] - self.mapped[s]) for s in range(len(lens))) * self.num_buffers
        available = self.num_pages - self.used()
        if deficit > available:
            reclaimable = sum(self.mapped[s] for s in range(len(lens)) if not self.allocated[s]) * self.num_buffers
            if deficit > available + reclaimable:
                return False
            want = deficit - available
            victims = sorted((s for s in range(len(lens)) if not self.allocated[s] and self.mapped[s]),
                             key=lambda s: (self.mapped[s], s))
            got = 0
            for s in victims:
                while self.mapped[s] and got < want:
                    self.mapped[s] -= 1
                    got += self.num_buffers
        for s, n in enumerate(need):
            self.mapped[s] = max(self.mapped[s], n)
        return True
