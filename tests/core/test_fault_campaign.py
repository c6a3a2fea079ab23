"""Randomized fault campaign: random schedules of every operation (alloc,
free, step, fork, prefix handles, reclaim) with the background mapper on,
while driver / OS calls fail at random call sites (part-way maps and unmaps,
synchronize, creation, copies). After every operation the page table must
describe exactly what is mapped, the bookkeeping must be consistent, every
allocated request's rows must read back what was written, and cleanup must
leave no fd, mapping, handle, reservation or thread.

Bounded to a few hundred operations per configuration; set
VATTN_FAULT_OPS=20000 to run it longer.
"""

from __future__ import annotations

import errno
import gc
import os
import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import vattn
from conftest import assert_invariants, assert_table_is_real
from host_faults import FAULTY_HOST

OPS = int(os.environ.get("VATTN_FAULT_OPS", "250"))
B, L = 6, 256
HOST_CALLS = ["create_pages", "map", "mmap_unmap"]  # fallocate, mmap of a map run, mmap of an unmap
CUDA_CALLS = [b"cuMemCreate", b"cuMemMap", b"cuMemSetAccess", b"cuMemUnmap", b"cuCtxSynchronize", b"cuMemcpyDtoD"]


@dataclass
class Request:
    values: np.ndarray  # what token t of layer l's K holds at [t, 0, 0] (same for every layer)


@dataclass
class Model:
    requests: dict[int, Request] = field(default_factory=dict)
    handles: list[tuple[vattn.PrefixHandle, np.ndarray]] = field(default_factory=list)
    next_uid: int = 1


class Campaign:
    def __init__(self, kv: vattn.KVCacheManager, rng: random.Random, fake_cuda=None, host_faults=None) -> None:
        self.kv, self.rng, self.fake, self.host = kv, rng, fake_cuda, host_faults
        self.model = Model()
        self.failures = 0

    # ---- faults ----
    def arm(self) -> None:
        if self.rng.random() > 0.4:
            return
        skip = self.rng.randint(0, 3)
        if self.fake is None:
            self.host.fail(self.rng.choice(HOST_CALLS), skip, 1, errno.ENOMEM)
        else:
            self.fake.fake_cuda_fail(self.rng.choice(CUDA_CALLS), skip, 1, 2)

    def disarm(self) -> None:
        if self.fake is None:
            self.host.clear()
        else:
            self.fake.fake_cuda_clear_failures()

    # ---- data ----
    def write(self, r: int, start: int, stop: int) -> None:
        req = self.model.requests[r]
        uid = self.model.next_uid
        self.model.next_uid += 1
        vals = ((uid % 2000) * 1024 + np.arange(start, stop)).astype(np.float32)
        for layer in range(self.kv.config.num_layers):
            k, _ = self.kv.layer(layer)
            k[r, start:stop, 0, 0] = torch.from_numpy(vals)
        req.values = np.concatenate([req.values[:start], vals])

    def verify(self) -> None:
        for r, req in self.model.requests.items():
            n = len(req.values)
            if n == 0:
                continue
            assert self.kv.mapped_tokens(r) >= n, f"reqid {r} lost pages: {self.kv.mapped_tokens(r)} < {n}"
            for layer in range(self.kv.config.num_layers):
                k, _ = self.kv.layer(layer)
                got = k[r, :n, 0, 0].numpy()
                assert np.array_equal(got, req.values), f"reqid {r} layer {layer}: rows changed"

    # ---- operations ----
    def op_alloc(self) -> None:
        r = self.kv.alloc_reqid(prompt_len=self.rng.choice([None, self.rng.randint(0, L)]))
        self.model.requests[r] = Request(np.zeros(0, np.float32))

    def op_free(self) -> None:
        r = self.rng.choice(list(self.model.requests))
        del self.model.requests[r]  # the request ends even if unmapping fails
        self.kv.free_reqid(r)

    def op_step(self) -> None:
        chosen = [r for r in self.model.requests if self.rng.random() < 0.7]
        lens = [0] * B
        for r in chosen:
            lens[r] = min(L, len(self.model.requests[r].values) + self.rng.randint(1, 40))
        if self.kv.step(lens):
            for r in chosen:
                self.write(r, len(self.model.requests[r].values), lens[r])
        elif chosen:  # out of pages: preempt one, as an engine would
            r = self.rng.choice(chosen)
            del self.model.requests[r]
            self.kv.free_reqid(r)

    def op_fork(self) -> None:
        src = self.rng.choice(list(self.model.requests))
        n = self.rng.randint(0, len(self.model.requests[src].values))
        r = self.kv.fork(src, n)
        assert r not in self.model.requests
        self.model.requests[r] = Request(self.model.requests[src].values[:n].copy())

    def op_retain(self) -> None:
        r = self.rng.choice(list(self.model.requests))
        n = self.rng.randint(0, len(self.model.requests[r].values))
        h = self.kv.retain_prefix(r, n)
        assert h.num_tokens <= n
        self.model.handles.append((h, self.model.requests[r].values[: h.num_tokens].copy()))

    def op_attach(self) -> None:
        h, values = self.rng.choice(self.model.handles)
        r = self.kv.alloc_reqid()
        self.model.requests[r] = Request(np.zeros(0, np.float32))
        assert self.kv.attach_prefix(h, r) == len(values)
        self.model.requests[r].values = values.copy()

    def op_release(self) -> None:
        h, _ = self.model.handles.pop(self.rng.randrange(len(self.model.handles)))
        h.release()

    def op_reclaim(self) -> None:
        self.kv.reclaim(self.rng.choice([None, 1, 8]))

    def run(self, ops: int) -> None:
        for i in range(ops):
            choices = ["alloc", "step", "step", "step", "reclaim"]
            if self.model.requests:
                choices += ["free", "fork", "retain", "step"]
            if self.model.handles:
                choices += ["attach", "release"]
            name = self.rng.choice(choices)
            self.arm()
            try:
                getattr(self, f"op_{name}")()
            except vattn.DriverError:
                self.failures += 1
            except (vattn.OutOfSlots, vattn.OutOfPages):
                pass
            finally:
                self.disarm()
            try:
                self.kv.wait_idle()
            except vattn.DriverError:
                self.failures += 1
            assert_table_is_real(self.kv, self.fake)
            assert_invariants(self.kv)
            if i % 5 == 0:
                self.verify()
        # drain: a mapper error still held surfaces at the next step; orphans are retried
        try:
            self.kv.step([0] * B)
        except vattn.DriverError:
            pass
        self.kv.reclaim()
        assert self.kv.stats()["pages_orphaned"] == 0
        self.verify()
        for h, _ in self.model.handles:
            h.release()


def open_state() -> tuple[int, int]:
    gc.collect()
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_fault_campaign_host(layout, host_faults):
    fds, threads = open_state()
    kv = vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_batch_size=B,
                              max_context_len=L, page_size=4096, layout=layout, physical_memory=96 * 4096,
                              background=True, eager=True, eager_tokens=64, reclaim_threshold=0.2,
                              backend=FAULTY_HOST)
    campaign = Campaign(kv, random.Random(f"host-{layout}"), host_faults=host_faults)
    try:
        campaign.run(OPS)
    finally:
        host_faults.clear()
        kv.cleanup()
    assert campaign.failures > 0  # faults really happened
    assert open_state() == (fds, threads)
    assert "vattn-kv-pool" not in open("/proc/self/maps").read()


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_fault_campaign_fake_cuda(layout, fake_cuda, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_GRANULARITY", str(64 * 1024))  # small pages: many crossings
    kv = vattn.KVCacheManager(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.float32, max_batch_size=B,
                              max_context_len=L, page_size=64 * 1024, layout=layout, device="cuda",
                              physical_memory=96 * 64 * 1024, background=True, eager=True, eager_tokens=64,
                              reclaim_threshold=0.2)
    if torch.cuda.is_available():  # a CUDA torch would get real device tensors; this checks the fake driver
        pytest.skip("needs a torch without CUDA: the fake driver's memory is host memory")
    campaign = Campaign(_HostViews(kv), random.Random(f"cuda-{layout}"), fake_cuda)
    try:
        campaign.run(OPS)
    finally:
        fake_cuda.fake_cuda_clear_failures()
        kv.cleanup()
    assert campaign.failures > 0
    assert fake_cuda.fake_cuda_live_mappings() == fake_cuda.baseline_mappings
    assert fake_cuda.fake_cuda_live_handles() == fake_cuda.baseline_handles
    assert fake_cuda.fake_cuda_live_reservations() == fake_cuda.baseline_reservations


class _HostViews:
    """A CUDA manager whose layer views are built as CPU tensors: the fake
    driver's device memory is host memory, and a CPU torch cannot make CUDA
    tensors. Everything else goes to the manager."""

    def __init__(self, kv: vattn.KVCacheManager) -> None:
        self._kv = kv
        self._views: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __getattr__(self, name: str):
        return getattr(self._kv, name)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._views is None:
            self._views = [self._layer(i) for i in range(self._kv.config.num_layers)]
        return self._views[index]

    def _layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        import ctypes

        kv, cfg = self._kv, self._kv.config
        out = []
        for kind in (0, 1):
            buf = 2 * i + kind if cfg.layout == "per_layer" else kind
            nbytes = kv._pages.buffer_bytes
            raw = (ctypes.c_byte * nbytes).from_address(kv.buffer_address(buf))
            t = torch.frombuffer(raw, dtype=torch.uint8).view(cfg.dtype)
            row = cfg.num_kv_heads * cfg.head_dim
            slot = kv.slot_bytes // cfg.element_bytes
            if cfg.layout == "per_layer":
                out.append(t.as_strided((B, L, cfg.num_kv_heads, cfg.head_dim), (slot, row, cfg.head_dim, 1)))
            else:
                out.append(t.as_strided((B, L, cfg.num_kv_heads, cfg.head_dim),
                                        (slot, cfg.num_layers * row, cfg.head_dim, 1), i * row))
        return out[0], out[1]
