"""One test body on three devices: the host backend, the fake CUDA driver
(tests/backends/fake_cuda) and a real GPU.

tests/backends/test_cuda_real.py writes its GPU tests against ``Device``: what
a test does to the cache (write rows, read them back, queue a read that is
still running when pages are reclaimed, capture and replay a graph) is done
with torch on the host and on a GPU, and with the fake driver's checked device
accesses on the fake (its addresses are not torch tensors), where a read or
write of an address that is not mapped with access is a fault that poisons the
context, as on a GPU. So what a GPU will run has already run here.
"""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch
import torch.nn.functional as F

import vattn
from backends.cuda_framework import Capture, Framework

MiB = 1024 * 1024


def cuda_skip_reason() -> str | None:
    """Why the real-GPU variant cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False (a CUDA build of torch on a GPU machine)"
    try:
        vattn.backends.cuda_info(0, "libcuda.so.1")
    except vattn.VAttnError as e:
        return f"needs a CUDA GPU: the CUDA driver is unusable: {e}"
    return None


class Device:
    """What a test needs from a device; subclasses per backend."""

    name = ""
    has_contexts = True  # CUDA contexts: the host has none
    torch_device = "cpu"

    def __init__(self, granularity: int = 2 * MiB) -> None:
        self.granularity = granularity  # bytes: the page size of make()'s caches

    def make(self, **overrides) -> vattn.KVCacheManager:
        args = dict(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.float16, max_batch_size=8,
                    max_context_len=16384, page_size=self.granularity, physical_memory=512 * MiB,
                    device=self.torch_device if self.torch_device == "cpu" else "cuda")
        args.update(overrides)
        try:
            return vattn.KVCacheManager(**args)
        except vattn.DriverError as e:
            if "OUT_OF_MEMORY" in str(e) and self.name == "cuda":
                pytest.skip(f"needs a CUDA GPU with free memory: {e}")
            raise

    # -- rows of layer `layer`'s K (kind 0) or V (kind 1), as CPU tensors [n, H, D] --

    def write(self, kv, layer: int, reqid: int, start: int, rows: torch.Tensor, kind: int = 0) -> None:
        kv.layer(layer)[kind][reqid, start:start + len(rows)] = rows.to(self.torch_device)

    def read(self, kv, layer: int, reqid: int, n: int, kind: int = 0) -> torch.Tensor:
        self.synchronize()
        return kv.layer(layer)[kind][reqid, :n].to("cpu", copy=True)  # a copy: the cache may be unmapped later

    def attend(self, kv, layer: int, reqid: int, n: int, q: torch.Tensor) -> torch.Tensor:
        """SDPA of q [1, Hq, T, D] over rows [0, n) of the cache, read in place."""
        k, v = kv.layer(layer)
        return F.scaled_dot_product_attention(q.to(self.torch_device), k[reqid, :n].transpose(0, 1)[None],
                                              v[reqid, :n].transpose(0, 1)[None], enable_gqa=True).cpu()

    def synchronize(self) -> None:
        pass

    def sync_streams(self):
        """What the engine's kernels run on, for ``sync_streams`` (None: the host has no streams)."""
        return None

    def current_context(self) -> int | None:
        raise NotImplementedError

    def adopt_context(self) -> int:
        """The framework's context made current on this thread (torch's first CUDA call)."""
        raise NotImplementedError

    def slow_read(self, kv, layer: int, reqid: int, n: int):
        """Queues a read of rows [0, n) that is still running when this
        returns (a GPU: behind a 0.1 s spin; the fake: until a wait sees it
        complete); returns a function giving the rows once it finished."""
        rows = self.read(kv, layer, reqid, n)
        return lambda: rows

    def graph_program(self, kv, reqid: int, rows: int, value: float) -> "GraphProgram":
        return EagerProgram(self, kv, reqid, rows, value)

    def close(self) -> None:
        pass


class HostDevice(Device):
    name = "host"
    has_contexts = False


class CudaDevice(Device):
    name = "cuda"
    torch_device = "cuda"

    def __init__(self) -> None:
        super().__init__(vattn.backends.cuda_info(0)["granularity"])

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def sync_streams(self):
        return torch.cuda.current_stream()

    def _lib(self):
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        return lib

    def current_context(self) -> int | None:
        ctx = ctypes.c_void_p()
        assert self._lib().cuCtxGetCurrent(ctypes.byref(ctx)) == 0
        return ctx.value

    def adopt_context(self) -> int:
        torch.zeros(1, device="cuda")
        return self.current_context()

    def slow_read(self, kv, layer, reqid, n):
        k, _ = kv.layer(layer)
        out = torch.empty(n, *k.shape[2:], device="cuda", dtype=k.dtype)
        torch.cuda._sleep(200_000_000)  # the stream spins ~0.1 s, then reads the pages
        out.copy_(k[reqid, :n])
        return lambda: (torch.cuda.synchronize(), out.cpu())[1]

    def graph_program(self, kv, reqid, rows, value):
        return TorchGraphProgram(kv, reqid, rows, value)


class FakeCudaDevice(Device):
    """The fake driver: rows move through its checked device accesses on the
    legacy default stream (torch's current stream), in the framework's
    context (the primary one, as torch's)."""

    name = "fake_cuda"
    torch_device = "fake"

    def __init__(self, lib) -> None:
        super().__init__()
        self.lib = lib
        self.fw = Framework(lib)
        self._adopted = False

    def make(self, **overrides):
        overrides.setdefault("device", "cuda")
        return super().make(**overrides)

    def _context(self) -> None:
        if not self._adopted:  # torch initialises CUDA at its first CUDA call
            self.fw.init()
            self._adopted = True

    @staticmethod
    def row_address(kv, layer: int, kind: int, reqid: int, token: int) -> int:
        cfg = kv.config
        row = cfg.num_kv_heads * cfg.head_dim * cfg.element_bytes
        buffer, column = (2 * layer + kind, 0) if cfg.layout == "per_layer" else (kind, layer * row)
        return kv.buffer_address(buffer) + reqid * kv.slice_bytes + token * cfg.token_bytes_per_buffer + column

    def _rows(self, kv, layer, kind, reqid, start, n, buf, write: bool, stream=None) -> None:
        """Rows [start, start + n) to or from buf, one access per contiguous run."""
        cfg = kv.config
        row = cfg.num_kv_heads * cfg.head_dim * cfg.element_bytes
        runs = [(start, n)] if cfg.layout == "per_layer" else [(start + i, 1) for i in range(n)]
        base = ctypes.addressof(buf)
        for first, count in runs:
            chunk = (ctypes.c_char * (count * row)).from_address(base + (first - start) * row)
            rc = self.fw.access(stream, self.row_address(kv, layer, kind, reqid, first), chunk, write)
            assert rc == 0, f"device access of reqid {reqid} rows {first}..{first + count}: CUresult {rc}"

    def write(self, kv, layer, reqid, start, rows, kind=0):
        self._context()
        data = rows.to(kv.config.dtype).contiguous()
        buf = (ctypes.c_char * (data.numel() * data.element_size())).from_buffer(data.numpy())
        self._rows(kv, layer, kind, reqid, start, len(rows), buf, write=True)

    def read(self, kv, layer, reqid, n, kind=0):
        self._context()
        cfg = kv.config
        out = torch.empty(n, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype)
        buf = (ctypes.c_char * (out.numel() * out.element_size())).from_buffer(out.numpy())
        self._rows(kv, layer, kind, reqid, 0, n, buf, write=False)
        return out

    def attend(self, kv, layer, reqid, n, q):
        k, v = self.read(kv, layer, reqid, n, 0), self.read(kv, layer, reqid, n, 1)
        return F.scaled_dot_product_attention(q.float(), k.float().transpose(0, 1)[None],
                                              v.float().transpose(0, 1)[None], enable_gqa=True).to(q.dtype)

    def synchronize(self) -> None:
        self._context()
        assert self.fw.synchronize() == 0

    def sync_streams(self):
        return 0  # the legacy default stream, torch's current stream

    def current_context(self):
        return self.fw.current()

    def adopt_context(self):
        self._context()
        return self.fw.current()

    def slow_read(self, kv, layer, reqid, n):
        self._context()
        cfg = kv.config
        out = torch.empty(n, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype)
        buf = (ctypes.c_char * (out.numel() * out.element_size())).from_buffer(out.numpy())
        self._rows(kv, layer, 0, reqid, 0, n, buf, write=False)  # queued until a wait completes it
        return lambda: (self.synchronize(), out)[1]

    def graph_program(self, kv, reqid, rows, value):
        return FakeGraphProgram(self, kv, reqid, rows, value)

    def close(self) -> None:
        self.fw.close()


# ---- the graph test's forward: write row `pos` of reqid's layer-0 K, sum rows [0, rows) ----


class GraphProgram:
    """A forward that writes ``value`` into row ``pos`` of reqid's layer 0 K
    (pos read from device memory at run time) and sums its rows ``[0, rows)``.
    ``capture()`` records it once (inside ``kv.graph_capture()``); ``run(pos)``
    replays it; ``total()`` is the last sum."""

    def capture(self) -> None:
        raise NotImplementedError

    def run(self, pos: int) -> None:
        raise NotImplementedError

    def total(self) -> float:
        raise NotImplementedError


class EagerProgram(GraphProgram):
    """The host: no graphs, the forward runs eagerly (graph_capture still pauses the mapper)."""

    def __init__(self, device, kv, reqid, rows, value):
        self.kv, self.reqid, self.rows, self.value = kv, reqid, rows, value
        self._total = 0.0

    def capture(self):
        with self.kv.graph_capture():
            self.run(0)

    def run(self, pos):
        k, _ = self.kv.layer(0)
        k[self.reqid, pos] = self.value
        self._total = float(k[self.reqid, :self.rows].float().sum())

    def total(self):
        return self._total


class TorchGraphProgram(GraphProgram):
    def __init__(self, kv, reqid, rows, value):
        self.kv, self.reqid, self.rows = kv, reqid, rows
        self.k, _ = kv.layer(0)
        self.pos = torch.zeros(1, dtype=torch.long, device="cuda")
        self.row = torch.full((1, *self.k.shape[2:]), value, device="cuda", dtype=self.k.dtype)
        self.sum = torch.zeros((), device="cuda", dtype=torch.float32)
        self.graph = torch.cuda.CUDAGraph()

    def _forward(self):
        self.k[self.reqid].index_copy_(0, self.pos, self.row)
        self.sum.copy_(self.k[self.reqid, :self.rows].float().sum())

    def capture(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward()  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with self.kv.graph_capture(), torch.cuda.graph(self.graph):
            self._forward()

    def run(self, pos):
        self.pos.fill_(pos)
        self.graph.replay()

    def total(self):
        torch.cuda.synchronize()
        return float(self.sum)


class FakeGraphProgram(GraphProgram):
    """The same forward as fake kernels: a write whose row index is read at
    replay time, and a read of rows [0, rows) summed on the host afterwards.
    Captured on a side stream of the framework's, replayed on the legacy one."""

    def __init__(self, device: FakeCudaDevice, kv, reqid, rows, value):
        device._context()
        self.device, self.kv, self.reqid, self.rows = device, kv, reqid, rows
        cfg = kv.config
        self.pos = ctypes.c_longlong(0)
        one = torch.full((cfg.num_kv_heads, cfg.head_dim), value, dtype=cfg.dtype)
        self.row = (ctypes.c_char * (one.numel() * one.element_size())).from_buffer_copy(one.numpy().tobytes())
        self.out = torch.empty(rows, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype)
        self.out_buf = (ctypes.c_char * (self.out.numel() * self.out.element_size())).from_buffer(self.out.numpy())
        self.graph: Capture | None = None

    def _forward(self, stream):
        fw, kv = self.device.fw, self.kv
        base = FakeCudaDevice.row_address(kv, 0, 0, self.reqid, 0)
        rc = fw.access(stream, base, self.row, True, index=self.pos, stride=kv.config.token_bytes_per_buffer)
        assert rc == 0, f"graph write: CUresult {rc}"
        self.device._rows(kv, 0, 0, self.reqid, 0, self.rows, self.out_buf, write=False, stream=stream)

    def capture(self):
        side = self.device.fw.stream()
        self._forward(None)  # warm-up outside the capture
        self.device.synchronize()
        with self.kv.graph_capture(), Capture(self.device.fw, side) as graph:
            self._forward(side)
        assert graph.result == 0, f"the capture was invalidated: CUresult {graph.result}"
        self.graph = graph

    def run(self, pos):
        self.pos.value = pos
        rc = self.graph.replay(None)
        assert rc == 0, f"graph replay: CUresult {rc}"

    def total(self):
        self.device.synchronize()
        return float(self.out.float().sum())


def make_device(name: str, request) -> Device:
    """The device of a parametrised test: host, fake_cuda (the fake_cuda
    fixture's driver) or cuda (skips without a GPU, with the reason)."""
    if name == "host":
        return HostDevice()
    if name == "fake_cuda":
        return FakeCudaDevice(request.getfixturevalue("fake_cuda"))
    reason = cuda_skip_reason()
    if reason:
        pytest.skip(reason)
    request.getfixturevalue("monkeypatch").delenv("VATTN_CUDA_DRIVER_LIB", raising=False)
    return CudaDevice()


def on_a_bare_thread(fn):
    """Runs fn on a new thread (no CUDA context current there); its result."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]
