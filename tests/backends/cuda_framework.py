"""A CUDA framework's runtime (what torch's cudart does) played on the fake
driver (tests/backends/fake_cuda): contexts and streams of its own, kernels
that read and write device memory, and CUDA graph capture and replay."""

from __future__ import annotations

import ctypes

# cuda.h (CUDA 13.0)
CU_STREAM_LEGACY = 0x1
CU_STREAM_PER_THREAD = 0x2
CU_STREAM_NON_BLOCKING = 0x1
CAPTURE_GLOBAL, CAPTURE_THREAD_LOCAL, CAPTURE_RELAXED = 0, 1, 2
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900
CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901
CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906
CUDA_ERROR_CAPTURED_EVENT = 907


class Framework:
    """Plays a CUDA framework's runtime (torch's cudart) on the fake driver.

    ``init()`` does what cudart does on first use: it adopts a context that is
    current on the thread (without retaining it: it is not its own), else it
    retains the device's primary context and makes it current.
    """

    def __init__(self, lib) -> None:
        self.lib = lib
        self.ctx: int | None = None
        self.retained = False
        self.pushed = 0
        vp, P = ctypes.c_void_p, ctypes.POINTER
        lib.cuCtxGetCurrent.argtypes = [P(vp)]
        lib.cuCtxSetCurrent.argtypes = [vp]
        lib.cuCtxPushCurrent_v2.argtypes = [vp]
        lib.cuCtxPopCurrent_v2.argtypes = [P(vp)]
        lib.cuDevicePrimaryCtxRetain.argtypes = [P(vp), ctypes.c_int]
        lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
        lib.cuDevicePrimaryCtxGetState.argtypes = [ctypes.c_int, P(ctypes.c_uint), P(ctypes.c_int)]
        lib.cuMemGetInfo_v2.argtypes = [P(ctypes.c_size_t)] * 2
        lib.cuStreamCreate.argtypes = [P(vp), ctypes.c_uint]
        lib.cuStreamSynchronize.argtypes = [vp]
        lib.cuStreamBeginCapture_v2.argtypes = [vp, ctypes.c_int]
        lib.cuStreamEndCapture.argtypes = [vp, P(vp)]
        lib.cuStreamIsCapturing.argtypes = [vp, P(ctypes.c_int)]
        lib.cuThreadExchangeStreamCaptureMode.argtypes = [P(ctypes.c_int)]
        lib.cuGraphInstantiateWithFlags.argtypes = [P(vp), vp, ctypes.c_ulonglong]
        lib.cuGraphLaunch.argtypes = [vp, vp]
        lib.cuGraphDestroy.argtypes = [vp]
        lib.cuGraphExecDestroy.argtypes = [vp]
        lib.cuEventCreate.argtypes = [P(vp), ctypes.c_uint]
        lib.cuEventRecord.argtypes = [vp, vp]
        lib.cuEventSynchronize.argtypes = [vp]
        lib.cuEventDestroy_v2.argtypes = [vp]
        assert lib.cuInit(0) == 0  # a framework initialises the driver itself

    def current(self) -> int | None:
        c = ctypes.c_void_p()
        assert self.lib.cuCtxGetCurrent(ctypes.byref(c)) == 0
        return c.value

    def primary_active(self) -> bool:
        flags, active = ctypes.c_uint(), ctypes.c_int()
        assert self.lib.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active)) == 0
        return bool(active.value)

    def init(self) -> int:
        cur = self.current()
        if cur:
            self.ctx = cur
        else:
            c = ctypes.c_void_p()
            assert self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(c), 0) == 0
            self.retained = True
            self.ctx = c.value
            assert self.lib.cuCtxSetCurrent(self.ctx) == 0
        return self.ctx

    def push_own_context(self) -> int:
        """A context of the framework's own (cuCtxCreate), pushed on this thread."""
        self.ctx = self.lib.fake_cuda_create_context(0)
        assert self.lib.cuCtxPushCurrent_v2(self.ctx) == 0
        self.pushed += 1
        return self.ctx

    def memory_call(self) -> int:
        """A driver call in the framework's context: the CUresult."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        return self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))

    def stream(self, flags: int = CU_STREAM_NON_BLOCKING) -> int:
        """A new stream (non-blocking, as torch's side streams, unless flags = 0)."""
        s = ctypes.c_void_p()
        assert self.lib.cuStreamCreate(ctypes.byref(s), flags) == 0
        return s.value

    def access(self, stream: int | None, addr: int, buf, write: bool, index=None, stride: int = 0) -> int:
        """A kernel on ``stream`` (None: the legacy default stream) that reads
        ``len(buf)`` bytes at ``addr`` into buf or writes them from it; with
        ``index`` (a ctypes c_longlong) at ``addr + index.value * stride``, the
        index read when the kernel runs. The CUresult."""
        ptr = ctypes.byref(index) if index is not None else None
        return self.lib.fake_cuda_device_access(stream, addr, ptr, stride, len(buf), int(write), buf)

    def synchronize(self) -> int:
        return self.lib.cuCtxSynchronize()

    def close(self) -> None:
        while self.lib.fake_cuda_context_depth() > 0:
            self.lib.cuCtxPopCurrent_v2(None)
        if self.retained:
            assert self.lib.cuDevicePrimaryCtxRelease_v2(0) == 0
            self.retained = False


class Capture:
    """cuStreamBeginCapture_v2 .. cuStreamEndCapture on a stream, as
    ``torch.cuda.graph`` does; ``result`` is EndCapture's CUresult and
    ``replay(stream)`` launches the instantiated graph."""

    def __init__(self, fw: Framework, stream: int, mode: int = CAPTURE_GLOBAL) -> None:
        self.fw, self.stream, self.mode = fw, stream, mode
        self.graph = ctypes.c_void_p()
        self.exec = ctypes.c_void_p()
        self.result: int | None = None

    def __enter__(self) -> "Capture":
        assert self.fw.lib.cuStreamBeginCapture_v2(self.stream, self.mode) == 0
        return self

    def __exit__(self, *exc) -> None:
        self.result = self.fw.lib.cuStreamEndCapture(self.stream, ctypes.byref(self.graph))
        if self.result == 0:
            assert self.fw.lib.cuGraphInstantiateWithFlags(ctypes.byref(self.exec), self.graph, 0) == 0

    def status(self) -> int:
        st = ctypes.c_int()
        assert self.fw.lib.cuStreamIsCapturing(self.stream, ctypes.byref(st)) == 0
        return st.value

    def replay(self, stream: int | None = None) -> int:
        assert self.result == 0, f"the capture failed: CUresult {self.result}"
        return self.fw.lib.cuGraphLaunch(self.exec, stream)


def device_write(lib, addr: int, data: bytes) -> None:
    """A kernel on the legacy stream (of the current context, else the primary
    one) writing ``data`` at ``addr``; a fault fails the test instead of
    crashing it, as a direct host write to an unmapped address would."""
    buf = ctypes.create_string_buffer(data, len(data))
    rc = lib.fake_cuda_device_access(None, addr, None, 0, len(data), 1, buf)
    assert rc == 0, f"device write of {len(data)} bytes at {addr:#x}: CUresult {rc}"


def device_read(lib, addr: int, n: int) -> bytes:
    """The read counterpart of :func:`device_write`."""
    buf = ctypes.create_string_buffer(n)
    rc = lib.fake_cuda_device_access(None, addr, None, 0, n, 0, buf)
    assert rc == 0, f"device read of {n} bytes at {addr:#x}: CUresult {rc}"
    return buf.raw
