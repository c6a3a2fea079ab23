"""Randomized fault campaign: random schedules of every operation (alloc,
free, step, fork, prefix handles: retain, attach, release, the page-table
primitive: map_pages, unmap_pages, reclaim) with the background mapper on,
while driver / OS calls fail at random call sites (part-way maps and unmaps,
synchronize, creation, copies). The same with ``page_allocator="external"``,
where the caller names the page ids and map_pages / unmap_pages are the
only way pages move. After every operation the page table must describe
exactly what is mapped, the bookkeeping must be consistent, every request's
rows must read back what was written, and cleanup must leave no fd,
mapping, handle, reservation or thread.

Bounded to a few hundred operations per configuration; set
VATTN_FAULT_OPS=20000 to run it longer.

map_pages moves pages a request already maps to other positions of it and
swaps two requests' pages: the core once dropped such a page's last
reference before taking the new one, so the page went back to the pool
while mapped (one page in two requests).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import vattn
from conftest import assert_invariants, assert_table_is_real
from host_faults import FAULTY_HOST

OPS = int(os.environ.get("VATTN_FAULT_OPS", "250"))
B, L = 6, 256
# Calls of the fault-injecting host backend (tests/host_faults.py) and an errno
# each fails with: a page creation (fallocate), a map or unmap run, the mmap
# of an unmap (EINVAL: ENOMEM there takes the munmap fallback and succeeds),
# the copy and synchronize of a fork.
HOST_FAULTS = {"create_pages": errno.ENOMEM, "map": errno.ENOMEM, "unmap": errno.EINVAL,
               "mmap_unmap": errno.EINVAL, "copy": errno.EIO, "synchronize": errno.EIO}
CUDA_CALLS = [b"cuMemCreate", b"cuMemMap", b"cuMemSetAccess", b"cuMemUnmap", b"cuCtxSynchronize", b"cuMemcpyDtoD"]


@dataclass
class Request:
    values: np.ndarray  # what token t of layer l's K holds at [t, 0, 0] (same for every layer)


@dataclass
class Model:
    requests: dict[int, Request] = field(default_factory=dict)
    handles: list[tuple[vattn.PrefixHandle, np.ndarray]] = field(default_factory=list)
    next_uid: int = 1


class Faults:
    """Arms one driver / OS failure at a random call site before an operation:
    in the fake CUDA driver, or in the host backend's fault plan."""

    def __init__(self, rng: random.Random, fake_cuda=None, host_faults=None) -> None:
        self.rng, self.fake, self.host = rng, fake_cuda, host_faults

    def arm(self) -> None:
        if self.rng.random() > 0.4:
            return
        skip = self.rng.randint(0, 3)
        if self.fake is None:
            call = self.rng.choice(sorted(HOST_FAULTS))
            self.host.fail(call, skip, 1, HOST_FAULTS[call])
        else:
            self.fake.fake_cuda_fail(self.rng.choice(CUDA_CALLS), skip, 1, 2)

    def disarm(self) -> None:
        if self.fake is None:
            self.host.clear()
        else:
            self.fake.fake_cuda_clear_failures()


def mapping_after(old: list[int], start: int, row: list[int], actual: list[int], failed: bool) -> int:
    """Checks one request's page ids after ``map_pages`` put ``row`` at
    ``start``: the whole change, or (when the call failed) no change or the
    cut with a prefix of the new ids mapped. Returns the positions that kept
    their old page (all of them when nothing changed)."""
    same = 0
    while same < len(row) and start + same < len(old) and old[start + same] == row[same]:
        same += 1
    if same == len(row):
        assert actual == old, f"nothing to change, got {actual} from {old}"
        return len(old)
    cut = start + same
    final = old[:cut] + row[same:]
    if not failed:
        assert actual == final, f"expected {final}, got {actual}"
        return cut
    assert actual == old or (cut <= len(actual) and actual == final[:len(actual)]), \
        f"after a failure: {actual} is neither {old} nor a prefix of {final} from {cut}"
    return len(old) if actual == old else cut


class Campaign:
    """Managed page ids (``page_allocator="vattn"``) against a model of what
    every allocated request's rows hold."""

    def __init__(self, kv: vattn.KVCacheManager, rng: random.Random, fake_cuda=None, host_faults=None) -> None:
        self.kv, self.rng, self.fake = kv, rng, fake_cuda
        self.faults = Faults(rng, fake_cuda, host_faults)
        self.model = Model()
        self.failures = 0
        self.pt = kv.page_tokens  # tokens per page id

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

    def whole_pages(self) -> dict[int, np.ndarray]:
        """Page id -> what its rows hold, for every whole written page of an
        allocated request and every page of a prefix handle."""
        pages: dict[int, np.ndarray] = {}
        sources = [(self.kv.page_ids(r), req.values) for r, req in self.model.requests.items()]
        sources += [(h.page_ids, values) for h, values in self.model.handles]
        for ids, values in sources:
            for q in range(min(len(values) // self.pt, len(ids))):
                rows = values[q * self.pt:(q + 1) * self.pt]
                assert np.array_equal(pages.setdefault(ids[q], rows), rows), f"page {ids[q]} holds two contents"
        return pages

    def op_map(self) -> None:
        with self.mapper_paused():
            self.map_pages()

    def op_unmap(self) -> None:
        with self.mapper_paused():
            self.unmap_pages()

    @contextlib.contextmanager
    def mapper_paused(self) -> Iterator[None]:
        """The mapper maps ahead of every request's stepped length: paused, so
        that what map_pages / unmap_pages left can be read exactly. (A cut
        below the stepped length is mapped again afterwards with fresh pages,
        which the model then no longer trusts.)"""
        self.kv._pages.pause_mapper(True)
        try:
            yield
        finally:
            self.kv._pages.pause_mapper(False)

    def map_pages(self) -> None:
        """Whole written pages of some requests (or of handles) at positions
        of one or two requests, from a position at or below their written
        whole pages."""
        pages = self.whole_pages()
        if not pages:
            return
        targets = self.rng.sample(sorted(self.model.requests), k=min(len(self.model.requests), self.rng.randint(1, 2)))
        old = {r: self.kv.page_ids(r) for r in targets}
        starts = {r: self.rng.randint(0, len(self.model.requests[r].values) // self.pt) for r in targets}
        choices = sorted(pages)
        if not choices:
            return
        limit = L // self.pt
        rows = {r: [self.rng.choice(choices) for _ in range(self.rng.randint(0, min(3, limit - starts[r])))]
                for r in targets}
        error = None
        try:
            self.kv.map_pages(targets, [starts[r] for r in targets], [rows[r] for r in targets])
        except (vattn.DriverError, vattn.OutOfPages) as e:  # OutOfPages: creation out of memory, nothing changed
            error = e
        for r in targets:
            actual = self.kv.page_ids(r)
            kept = mapping_after(old[r], starts[r], rows[r], actual, error is not None)
            req = self.model.requests[r]
            if kept < len(old[r]) or len(actual) > len(old[r]):  # from the first changed position on: the new pages
                req.values = np.concatenate([req.values[:starts[r] * self.pt]]
                                            + [pages[i] for i in actual[starts[r]:]]).astype(np.float32)
        if error is not None:
            raise error

    def unmap_pages(self) -> None:
        r = self.rng.choice(sorted(self.model.requests))
        old = self.kv.page_ids(r)
        keep = self.rng.randint(0, len(old))
        try:
            self.kv.unmap_pages([r], [keep])
        finally:
            actual = self.kv.page_ids(r)
            assert actual in (old[:keep], old), f"unmap_pages([{r}], [{keep}]) of {old} left {actual}"
            req = self.model.requests[r]
            req.values = req.values[:len(actual) * self.pt]

    def run(self, ops: int) -> None:
        for i in range(ops):
            choices = ["alloc", "step", "step", "step", "reclaim"]
            if self.model.requests:
                choices += ["free", "fork", "retain", "step", "map", "unmap"]
            if self.model.handles:
                choices += ["attach", "release"]
            name = self.rng.choice(choices)
            self.faults.arm()
            try:
                getattr(self, f"op_{name}")()
            except vattn.DriverError:
                self.failures += 1
            except (vattn.OutOfReqids, vattn.OutOfPages):
                pass
            finally:
                self.faults.disarm()
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


class ExternalCampaign:
    """Caller-owned page ids (``page_allocator="external"``): random alloc,
    free, map_pages (fresh ids, ids other requests map, moves within and
    between requests), unmap_pages and writes through any request, against a
    model of the page table and of what every page id holds. A page keeps its
    contents while no request maps it, so a free reqid's slice is checked too."""

    def __init__(self, kv: vattn.KVCacheManager, rng: random.Random, fake_cuda=None, host_faults=None) -> None:
        self.kv, self.rng, self.fake = kv, rng, fake_cuda
        self.faults = Faults(rng, fake_cuda, host_faults)
        self.pt = kv.page_tokens
        self.table: list[list[int]] = [[] for _ in range(B)]  # page ids per reqid (free ones keep theirs)
        self.contents: dict[int, np.ndarray] = {}  # page id -> rows written (NaN: never written)
        self.allocated: set[int] = set()
        self.next_uid = 1
        self.failures = 0

    def op_alloc(self) -> None:
        wanted = self.rng.choice([None, self.rng.randrange(B)])
        if wanted is not None and wanted in self.allocated:
            return
        r = self.kv.alloc_reqid(reqid=wanted) if wanted is not None else self.kv.alloc_reqid()
        assert r not in self.allocated
        self.allocated.add(r)

    def op_free(self) -> None:
        r = self.rng.choice(sorted(self.allocated))
        self.allocated.discard(r)
        self.kv.free_reqid(r)

    def op_map(self) -> None:
        targets = self.rng.sample(sorted(self.allocated), k=min(len(self.allocated), self.rng.randint(1, 3)))
        ids = range(self.kv.num_page_ids)
        mapped = sorted({i for row in self.table for i in row})
        rows, starts = {}, {}
        for r in targets:
            starts[r] = self.rng.randint(0, len(self.table[r]))
            n = self.rng.randint(0, min(4, L // self.pt - starts[r]))
            rows[r] = [self.rng.choice(mapped) if mapped and self.rng.random() < 0.5 else self.rng.choice(ids)
                       for _ in range(n)]
        error = None
        try:
            self.kv.map_pages(targets, [starts[r] for r in targets], [rows[r] for r in targets])
        except (vattn.DriverError, vattn.OutOfPages) as e:  # OutOfPages: creation out of memory, nothing changed
            error = e
        for r in targets:
            actual = self.kv.page_ids(r)
            mapping_after(self.table[r], starts[r], rows[r], actual, error is not None)
            self.table[r] = actual
        if error is not None:
            raise error

    def op_unmap(self) -> None:
        r = self.rng.randrange(B)
        old = self.table[r]
        keep = self.rng.randint(0, len(old))
        try:
            self.kv.unmap_pages([r], [keep])
        finally:
            actual = self.kv.page_ids(r)
            assert actual in (old[:keep], old), f"unmap_pages([{r}], [{keep}]) of {old} left {actual}"
            self.table[r] = actual

    def op_write(self) -> None:
        """Writes whole pages through an allocated request's view."""
        candidates = [r for r in self.allocated if self.table[r]]
        if not candidates:
            return
        r = self.rng.choice(candidates)
        q = self.rng.randrange(len(self.table[r]))
        vals = ((self.next_uid % 2000) * 1024 + np.arange(self.pt)).astype(np.float32)
        self.next_uid += 1
        for layer in range(self.kv.config.num_layers):
            k, _ = self.kv.layer(layer)
            k[r, q * self.pt:(q + 1) * self.pt, 0, 0] = torch.from_numpy(vals)
        self.contents[self.table[r][q]] = vals

    def verify(self) -> None:
        for r in range(B):
            assert self.kv.page_ids(r) == self.table[r], f"reqid {r}: page ids changed"
            for q, page in enumerate(self.table[r]):
                want = self.contents.get(page)
                if want is None:
                    continue
                for layer in range(self.kv.config.num_layers):
                    k, _ = self.kv.layer(layer)
                    got = k[r, q * self.pt:(q + 1) * self.pt, 0, 0].numpy()
                    assert np.array_equal(got, want), f"reqid {r} position {q} (page {page}) layer {layer} changed"

    def run(self, ops: int) -> None:
        for i in range(ops):
            choices = ["alloc", "unmap"]
            if self.allocated:
                choices += ["free", "map", "map", "map", "write", "write"]
            name = self.rng.choice(choices)
            self.faults.arm()
            try:
                getattr(self, f"op_{name}")()
            except vattn.DriverError:
                self.failures += 1
            except (vattn.OutOfReqids, vattn.OutOfPages):
                pass
            finally:
                self.faults.disarm()
            assert_table_is_real(self.kv, self.fake)
            assert_invariants(self.kv)
            if i % 5 == 0:
                self.verify()
        self.kv.reclaim()  # retries unmaps that failed
        assert self.kv.stats()["pages_orphaned"] == 0
        self.verify()


def open_state() -> tuple[int, int]:
    gc.collect()
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


CAMPAIGNS = {"vattn": Campaign, "external": ExternalCampaign}


@pytest.mark.parametrize("page_allocator", sorted(CAMPAIGNS))
@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_fault_campaign_host(layout, page_allocator, host_faults):
    fds, threads = open_state()
    kv = vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_batch_size=B,
                              max_context_len=L, page_size=4096, layout=layout, physical_memory=96 * 4096,
                              policy={"background": True, "eager": True, "eager_tokens": 64, "reclaim_threshold": 0.2},
                              page_allocator=page_allocator, backend=FAULTY_HOST)
    campaign = CAMPAIGNS[page_allocator](kv, random.Random(f"host-{layout}-{page_allocator}"), host_faults=host_faults)
    try:
        campaign.run(OPS)
    finally:
        host_faults.clear()
        kv.cleanup()
    assert campaign.failures > 0  # faults really happened
    assert open_state() == (fds, threads)
    assert "vattn-kv-pool" not in open("/proc/self/maps").read()


@pytest.mark.parametrize("page_allocator", sorted(CAMPAIGNS))
@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_fault_campaign_fake_cuda(layout, page_allocator, fake_cuda, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_GRANULARITY", str(64 * 1024))  # small pages: many crossings
    kv = vattn.KVCacheManager(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.float32, max_batch_size=B,
                              max_context_len=L, page_size=64 * 1024, layout=layout, device="cuda",
                              physical_memory=96 * 64 * 1024,
                              policy={"background": True, "eager": True, "eager_tokens": 64, "reclaim_threshold": 0.2},
                              page_allocator=page_allocator)
    if torch.cuda.is_available():  # a CUDA torch would get real device tensors; this checks the fake driver
        kv.cleanup()
        pytest.skip("needs a torch without CUDA: the fake driver's memory is host memory")
    campaign = CAMPAIGNS[page_allocator](_HostViews(kv), random.Random(f"cuda-{layout}-{page_allocator}"), fake_cuda)
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
            slot = kv.slice_bytes // cfg.element_bytes
            if cfg.layout == "per_layer":
                out.append(t.as_strided((B, L, cfg.num_kv_heads, cfg.head_dim), (slot, row, cfg.head_dim, 1)))
            else:
                out.append(t.as_strided((B, L, cfg.num_kv_heads, cfg.head_dim),
                                        (slot, cfg.num_layers * row, cfg.head_dim, 1), i * row))
        return out[0], out[1]
