"""The CUDA side of a manager: the streams whose kernels read the cache (read
fences before unmapping) and CUDA graph capture. A mixin of
:class:`vattn.KVCacheManager`; see docs/gpu.md."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from vattn.common.argument_checks import stream_handles as _stream_handles

# ---- CUDA graph captures anywhere in the process ---------------------------------
#
# A framework captures graphs with torch.cuda.CUDAGraph (torch.cuda.graph, vLLM,
# ...) without telling vattn. While any capture is in progress no manager's
# background threads (the mapper, the budget keeper) may start driver work:
# in the default capture mode the driver refuses such calls from every thread,
# and a synchronization would invalidate the capture. So the first manager on
# a CUDA device wraps CUDAGraph.capture_begin / capture_end: a capture that
# begins waits for every manager's round in flight, then closes each one's
# driver gate (calls that would reach the driver raise, as inside
# graph_capture(); background work waits), and the end opens them again.

_capture_lock = threading.Lock()
_capture_depth = 0  # captures in progress (the wrappers' count)
_capture_managers: weakref.WeakSet[Any] = weakref.WeakSet()
# One entry per capture_begin a backend got: each is owed a capture_end, also
# when its manager closed meanwhile (its teardown waits for that end).
_begun_backends: list[Any] = []


def _capture_targets() -> list[Any]:
    return [m for m in list(_capture_managers) if not m._pages.closed]


def _captures_begin() -> None:
    global _capture_depth
    with _capture_lock:
        _capture_depth += 1
        for manager in _capture_targets():
            try:
                _pause_for_capture(manager)
            except Exception:
                if not manager._pages.closed:  # closed meanwhile: nothing of it runs any more
                    raise


def _captures_end() -> None:
    global _capture_depth
    with _capture_lock:
        if _capture_depth == 0:
            return
        _capture_depth -= 1
        owed = list({id(b): b for b in _begun_backends}.values())  # one end per backend per capture
        for backend in owed:
            _begun_backends.remove(backend)
            with contextlib.suppress(Exception):
                backend.capture_end()
        for manager in _capture_targets():
            with contextlib.suppress(Exception):  # a manager closed meanwhile has nothing to resume
                manager._pages.pause_for_capture(False)


def _pause_for_capture(manager: Any) -> None:
    pages = manager._pages
    pages.pause_for_capture(True)  # waits for the mapper's round in flight
    try:
        backend = pages.memory.backend
        backend.capture_begin()  # waits for the driver calls under way
    except BaseException:
        pages.pause_for_capture(False)
        raise
    _begun_backends.append(backend)


def _wrap_capture(graph_class: type) -> None:
    """Wraps ``capture_begin`` / ``capture_end`` of ``graph_class`` once."""
    begin, end = graph_class.capture_begin, graph_class.capture_end
    if getattr(begin, "_vattn_capture_hook", False):
        return

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        _captures_begin()
        try:
            return begin(self, *args, **kwargs)
        except BaseException:
            _captures_end()
            raise

    def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return end(self, *args, **kwargs)
        finally:
            _captures_end()

    for wrapper, original in ((capture_begin, begin), (capture_end, end)):
        wrapper.__name__, wrapper.__qualname__ = original.__name__, original.__qualname__
        wrapper.__doc__ = original.__doc__
        wrapper._vattn_capture_hook = True  # type: ignore[attr-defined]
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    graph_class.capture_begin = capture_begin  # type: ignore[method-assign]
    graph_class.capture_end = capture_end  # type: ignore[method-assign]


def watch_captures(manager: Any) -> None:
    """Makes ``manager`` (on a CUDA device) pause its background driver work
    during every CUDA graph capture in the process (torch.cuda.CUDAGraph's),
    installing the hook on first use; paused at once while a capture is in
    progress."""
    import torch

    graph_class = getattr(torch.cuda, "CUDAGraph", None)
    if graph_class is not None and hasattr(graph_class, "capture_begin") and hasattr(graph_class, "capture_end"):
        _wrap_capture(graph_class)
    with _capture_lock:
        _capture_managers.add(manager)
        for _ in range(_capture_depth):
            _pause_for_capture(manager)


class CudaStreams:
    """:meth:`set_sync_streams` and :meth:`graph_capture` of a manager (the
    manager provides ``_vmm_backend()``, its C++ backend, and ``_pages``, its page
    manager)."""

    _pages: Any
    _vmm_backend: Callable[[], Any]

    def set_sync_streams(self, streams: Any) -> None:
        """Names the streams whose kernels may read the cache.

        vattn unmaps a page only once no queued kernel can still read it: the
        pages of a freed reqid (deferred reclaim by the mapper, :meth:`reclaim`,
        the last-resort reclaim inside :meth:`step`, the trim of
        ``alloc_reqid(reqid=)``). With streams named, :meth:`free_reqid`
        records an event on each of them (a read fence: the request's last
        kernels are queued by then), and the unmap later waits for those
        events only, usually finished long before; a fence an earlier wait
        covered costs no driver call. :meth:`fork` waits for the work queued so
        far on the streams before it copies. Without streams (``None`` or
        ``[]``, the default) every such wait is ``cuCtxSynchronize``: the
        whole device, other users' kernels included.

        Args:
            streams: a ``torch.cuda.Stream`` (anything with ``.cuda_stream``),
                a raw ``cudaStream_t`` as an int (0: the legacy default
                stream), or a sequence of them. Every stream that launches
                kernels or CUDA graph replays reading the cache must be named
                and must outlive this setting; a serving engine names the
                stream its forward pass runs on, e.g.
                ``kv.set_sync_streams(torch.cuda.current_stream())``. Kernels
                may read a reqid's rows only between the ``step`` that covered
                them and its ``free_reqid``. CUDA only.

        Changing the setting first waits, once, for the readers the old one
        names. Raises ``DriverError`` (the old setting kept) when a stream
        cannot carry vattn's events, e.g. one of another context.

        Example::

            kv = vattn.KVCacheManager(..., device="cuda",
                                      sync_streams=torch.cuda.current_stream())
        """
        handles = _stream_handles(streams)
        self._vmm_backend().set_sync_streams(handles)

    @contextlib.contextmanager
    def graph_capture(self) -> Iterator[Any]:
        """Wrap CUDA graph capture in this block.

        The contract with CUDA graphs (a graph records addresses, not
        mappings):

        - Replay: a kernel or graph replay launched after ``step(seq_lens)``
          returned True may read rows ``[0, seq_lens[r])`` of every reqid
          ``r``. ``step`` returns only once every page those lengths need is
          mapped with access granted, waiting for the background mapper's
          round in flight when that round maps some of them; the pages stay
          mapped until ``r`` is freed and its read fence has passed. So: step,
          then replay, every iteration, with every length the replay reads at
          most what the last step covered; rows of padding entries in a
          captured batch must read nothing (length 0) or only stepped rows.
        - The background mapper maps only beyond the stepped lengths (pages no
          launched kernel reads) and unmaps only pages of freed reqids, after
          their fences: it may run while graphs replay.
        - Capture: inside this block the mapper starts no work (its batch in
          flight, if any, lands first), and every vattn call that would reach
          the CUDA driver raises ``DriverError`` instead, on any thread: in
          the default (global) capture mode the driver refuses such calls and
          a synchronization would invalidate the capture, and an event
          recorded on the capturing stream would join the graph. A ``step``
          whose lengths are already mapped needs no driver call and works.
          Step before the capture to the lengths it reads.

        On the host backend it only pauses the mapper. Not reentrant
        (``RuntimeError``).

        A capture begun through ``torch.cuda.CUDAGraph`` (``torch.cuda.graph``,
        vLLM's captures) outside this block is seen by vattn's hook on
        ``capture_begin`` / ``capture_end`` and gets the same treatment for
        every manager on a CUDA device: the mapper's round in flight lands
        first, the mapper and the budget keeper start no driver work until
        ``capture_end`` (their work waits), and calls that would reach the
        driver raise ``DriverError``. Captures by other means (raw
        ``cudaStreamBeginCapture``) need this block.

        Example::

            kv.step(lens)                  # maps what the captured kernels read
            with kv.graph_capture(), torch.cuda.graph(g):
                out = model_forward(...)   # reads k[r, :n], n <= lens[r]
            ...
            kv.step(lens); g.replay()      # every iteration: step, then replay
        """
        vmm = self._vmm_backend()
        self._pages.pause_mapper(True)  # raises when already paused: nothing else changed
        try:
            vmm.suspend_driver_calls()
        except BaseException:
            self._pages.pause_mapper(False)
            raise
        try:
            yield self
        finally:
            vmm.resume_driver_calls()
            self._pages.pause_mapper(False)
