"""Randomized alloc / step / free schedules against the pure-Python page model,
with position-stamped data checked after every step."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import vattn
from page_model import PageModel

B, L = 4, 96
PAGE = 4096


class ScheduleMachine(RuleBasedStateMachine):
    @initialize(layout=st.sampled_from(["per_layer", "all_layers"]), pool_pages=st.integers(4, 40),
                head_dim=st.sampled_from([16, 32, 48]))
    def setup(self, layout, pool_pages, head_dim):
        num_buffers = 4 if layout == "per_layer" else 2
        pool_pages = max(pool_pages, num_buffers)
        self.kv = vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=head_dim, dtype=torch.float32,
                                       max_batch_size=B, max_context_len=L, page_size=PAGE, layout=layout,
                                       physical_memory=pool_pages * PAGE, policy={"background": False})
        cfg = self.kv.config
        self.model = PageModel(B, cfg.num_buffers, pool_pages, cfg.token_bytes_per_buffer, PAGE)
        self.lens = [0] * B  # tokens the engine believes each active reqid has
        self.written = [0] * B  # rows stamped so far
        self.serial = [0] * B  # a distinct stamp per request lifetime
        self.next_serial = 1

    def teardown(self):
        if hasattr(self, "kv"):
            self.kv.cleanup()

    @rule(prompt=st.one_of(st.none(), st.integers(0, L)))
    def alloc(self, prompt):
        expected = self.model.alloc(prompt)
        if expected is None:
            try:
                self.kv.alloc_reqid(prompt)
            except vattn.OutOfReqids:
                return
            raise AssertionError("alloc_reqid should have raised OutOfReqids")
        got = self.kv.alloc_reqid(prompt)
        assert got == expected
        self.serial[got] = self.next_serial
        self.next_serial += 1
        self.written[got] = 0

    @precondition(lambda self: any(self.model.allocated))
    @rule(data=st.data())
    def free(self, data):
        active = [s for s in range(B) if self.model.allocated[s]]
        s = data.draw(st.sampled_from(active))
        self.model.free(s)
        self.kv.free_reqid(s)
        self.lens[s] = 0

    @rule(data=st.data())
    def step(self, data):
        lens = list(self.lens)
        for s in range(B):
            if self.model.allocated[s]:
                lens[s] = min(L, lens[s] + data.draw(st.integers(0, 40), label=f"grow{s}"))
        expected = self.model.step(lens)
        assert self.kv.step(lens) is expected
        if expected:
            self.lens = lens
            self.stamp_new_rows()
        self.check_rows()

    def stamp_new_rows(self):
        for s in range(B):
            if self.model.allocated[s] and self.lens[s] > self.written[s]:
                for layer in range(2):
                    k, v = self.kv.layer(layer)
                    rows = torch.arange(self.written[s], self.lens[s], dtype=torch.float32)
                    k[s, self.written[s] : self.lens[s]] = (self.serial[s] * 1000 + rows).view(-1, 1, 1) + layer * 0.25
                    v[s, self.written[s] : self.lens[s]] = -(self.serial[s] * 1000 + rows).view(-1, 1, 1) - layer * 0.25
                self.written[s] = self.lens[s]

    def check_rows(self):
        for s in range(B):
            n = self.written[s]
            if self.model.allocated[s] and n:
                rows = torch.arange(n, dtype=torch.float32).view(-1, 1, 1)
                for layer in range(2):
                    k, v = self.kv.layer(layer)
                    assert torch.equal(k[s, :n], ((self.serial[s] * 1000 + rows) + layer * 0.25).expand(-1, *k.shape[2:]))
                    assert torch.equal(v[s, :n], (-(self.serial[s] * 1000 + rows) - layer * 0.25).expand(-1, *v.shape[2:]))

    @invariant()
    def bookkeeping_matches_model(self):
        if not hasattr(self, "kv"):
            return
        assert [self.kv._pages.mapped_pages(s) for s in range(B)] == self.model.mapped
        s = self.kv.stats()
        assert s["pages_mapped"] == self.model.used() <= self.model.num_pages
        assert s["reqids_allocated"] == sum(self.model.allocated)


ScheduleMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_schedules_agree_with_model = ScheduleMachine.TestCase
