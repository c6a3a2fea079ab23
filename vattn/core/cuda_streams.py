"""The CUDA side of a manager: the streams whose kernels read the cache (read
fences before unmapping) and CUDA graph capture. A mixin of
:class:`vattn.KVCacheManager`; see docs/gpu.md."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from vattn.common.argument_checks import stream_handles as _stream_handles


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
          batch in flight when that batch maps some of them; the pages stay
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
