"""KVCacheManager: the public object that owns one virtual-memory KV cache."""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from vattn import _C
from vattn.common.argument_checks import (as_int as _as_int, bounded_int as _bounded_int, int_array as _int_array,
                                          stream_handles as _stream_handles)
from vattn.backends import BackendSpec, parse_device, resolve_backend, torch_device
from vattn.common.deprecation import Stats, warn_renamed
from vattn.common.config import KVCacheConfig
from .cuda_streams import CudaStreams, watch_captures
from .mapped_check import IntArray, MappedCheck, ViewsBinding, ViewsCheck
from .policy import Policy, resolve_policy
from vattn.common.errors import BackendUnavailable, ForkedError
from vattn.budget.membership import DEFAULT_IDLE_RELEASE_S as _IDLE_S, default_label, idle_release_seconds, join_budget
from .shared_pages import SharedPages
from .tensor_owners import CacheSpan, forget_span, remember_span, view_origin

SeqLens = IntArray

PAGE_ALLOCATORS = ("vattn", "external")
# The policy knobs the constructor once took as keyword arguments: deprecated aliases of policy=
KNOB_KEYWORDS = ("background", "deferred_reclaim", "eager", "lookahead_tokens", "eager_tokens", "reclaim_threshold")


class KVCacheManager(CudaStreams, SharedPages):
    """A KV cache whose every K and V buffer is one contiguous virtual tensor.

    Physical pages are mapped behind a request's slice on demand by :meth:`step`.
    Attention kernels read ``k[reqid, :n]`` like any dense tensor.

    Args:
        num_layers: transformer layers held (N).
        num_kv_heads: KV heads on this worker (H).
        head_dim: elements per head (D).
        dtype: element type of the cache.
        max_batch_size: number of reqids, 0 .. B-1 (B).
        max_context_len: tokens per request at most (L).
        page_size: bytes per physical page; a multiple of the backend's
            granularity (4 KiB on the host, 2 MiB on CUDA with the stock driver).
            ``None``: 256 KiB on the host, the granularity on CUDA.
        device: ``"cpu"`` (host backend) or ``"cuda"`` / ``"cuda:i"``: the
            device types the registered backends serve.
        layout: ``"per_layer"`` (2N buffers ``[B, L, H, D]``) or ``"all_layers"``
            (2 buffers ``[B, L, N, H, D]``; layer i is the strided view ``[:, :, i]``).
        physical_memory: bytes of the physical page pool. ``None``: the smaller
            of what every reqid at full length needs and a share of free memory
            (half of MemAvailable on the host, 90% of free device memory on CUDA).
            Pages are committed only when first mapped.
        page_allocator: ``"vattn"``: the manager draws page ids from its pool
            as :meth:`step` grows requests. ``"external"``: a framework's block
            manager owns the page ids ``0 .. num_page_ids - 1`` and maps them
            with :meth:`map_pages`; :meth:`step`, the mapper, eager allocation
            and reclamation are off (docs/design.md section 3). A page keeps its
            physical memory and contents from first use until cleanup, also
            while no reqid maps it, and ``physical_memory`` alone sizes the
            pool: ``num_page_ids`` may exceed what the reqids can map at once.
        backend: ``None``: the device's backend (host for cpu, cuda for
            cuda), or cuda_uvm when a CUDA page size below the driver's 2 MiB
            granularity is asked for and the patched nvidia-uvm is loaded.
            ``"cuda_uvm"``: 64/128/256 KiB or 2 MiB pages from the patched
            nvidia-uvm (driver_patch/README.md; default 64 KiB); without it,
            :class:`vattn.BackendUnavailable`. Any name registered with
            :func:`vattn.backends.register_backend` for the device works too.
        sync_streams: CUDA only: the streams the engine's kernels and graph
            replays that read the cache run on (``torch.cuda.Stream`` objects
            or raw ``cudaStream_t`` handles as ints; see
            :meth:`set_sync_streams`). ``None``: every wait before an unmap is
            ``cuCtxSynchronize`` (the whole device).
        preallocate: create every physical page at construction (as the
            reference vAttention does) and keep them until cleanup, so nothing
            the framework allocates later can take them; in a budget the whole
            pool is charged at once (:class:`vattn.OutOfPages` when it cannot
            be) and never given back early.
        budget: a machine-wide :class:`vattn.Budget` (or its name) to draw
            physical pages from, shared with managers in other processes;
            ``None``: the one ``VATTN_BUDGET`` names, if set; ``False``: none.
            ``step`` then returns False when the budget cannot grant the pages
            (docs/elastic.md).
        idle_release_s: in a budget, free pages (freed requests' cache, eager
            pages, the free pool) go back after this many seconds without a
            ``step``, and at once when another process waits for memory or
            the limit is lowered below what is held. ``None``: never for
            idleness. Default 30.
        budget_label: what ``python -m vattn top`` shows for this manager.
        policy: the page manager's policy knobs (mapper thread, deferred
            reclamation, eager mapping, lookahead, ...): a :class:`vattn.Policy`,
            whose docstring lists every knob with its range and default, or a
            mapping of knob names to values, e.g. ``{"lookahead_tokens": 16}``;
            ``None``: the defaults. :attr:`policy` reads back what the core runs
            with. The knobs' keyword arguments (``background=``, ``eager=``, ...)
            are deprecated aliases; a knob named in ``policy`` (a mapping's key, a
            ``Policy`` field off its default) wins over them.

    Page ids: one page id names one physical page in every buffer (so it
    holds ``page_size`` bytes of each layer's K and V, ``page_tokens``
    tokens). A page id may be mapped at the same position of several
    requests' slices (:meth:`fork`, :meth:`retain_prefix`, :meth:`map_pages`);
    it is reference-counted and returns to the pool when unused.

    With the knobs ``background``, ``deferred_reclaim`` and ``eager`` all
    False the manager maps and unmaps only inside ``step`` and ``free_reqid``.

    Example::

        kv = vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=64,
                                  dtype=torch.float16, max_batch_size=4,
                                  max_context_len=1024)
        r = kv.alloc_reqid()
        lens = [0] * 4
        lens[r] = 10
        assert kv.step(lens)
        k, v = kv.layer(0)          # [4, 1024, 2, 64] views
        k[r, :10] = 1.0             # rows 0..9 of reqid r are mapped
        kv.free_reqid(r)
        kv.cleanup()
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
        max_batch_size: int = 1,
        max_context_len: int = 4096,
        page_size: int | None = None,
        device: str | torch.device = "cpu",
        layout: str = "per_layer",
        physical_memory: int | None = None,
        page_allocator: str = "vattn",
        backend: str | None = None,
        sync_streams: Any = None,
        preallocate: bool = False,
        budget: Any = None,
        idle_release_s: float | None = _IDLE_S,
        budget_label: str | None = None,
        policy: Policy | Mapping[str, Any] | None = None,
        **deprecated_knobs: Any,
    ) -> None:
        if page_allocator not in PAGE_ALLOCATORS:
            raise ValueError(f"page_allocator must be one of {PAGE_ALLOCATORS}, got {page_allocator!r}")
        if not isinstance(preallocate, bool):
            raise TypeError(f"preallocate must be a bool, got {type(preallocate).__name__}")
        streams = _stream_handles(sync_streams)
        idle_release = idle_release_seconds(idle_release_s)
        external = page_allocator == "external"
        self.config = KVCacheConfig(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            max_batch_size=max_batch_size,
            max_context_len=max_context_len,
            layout=layout,
        )
        unknown = sorted(set(deprecated_knobs) - set(KNOB_KEYWORDS))
        if unknown:
            raise TypeError(f"KVCacheManager() got an unexpected keyword argument {unknown[0]!r}")
        knobs = resolve_policy(policy, keywords=deprecated_knobs, max_context_len=self.config.max_context_len,
                               num_buffers=self.config.num_buffers, external=external)
        device_type, index = parse_device(device)
        self.device = torch_device(device_type, index)
        self.backend: BackendSpec = resolve_backend(device_type, index, self.config, page_size, physical_memory,
                                                   backend, external_ids=external)
        self.page_size: int = self.backend.page_size
        self.slice_bytes: int = self.config.slice_bytes(self.page_size)  # one reqid's slice of one buffer
        self.page_allocator: str = page_allocator
        self._pid = os.getpid()
        vmm = self.backend.make()
        if streams:
            vmm.set_sync_streams(streams)
        self.budget, self._budget_member = join_budget(budget, self.device,
                                                       budget_label or default_label(self.config))
        self._pages = _C.PageManager(
            vmm,
            num_buffers=self.config.num_buffers,
            num_reqids=self.config.max_batch_size,
            slice_bytes=self.slice_bytes,
            bytes_per_token=self.config.token_bytes_per_buffer,
            max_tokens=self.config.max_context_len,
            external_ids=external,
            preallocate=preallocate,
            budget=self._budget_member and self._budget_member._member,
            idle_release_s=idle_release,
            policy=knobs,
        )
        memory = self._pages.memory
        self.buffer_bytes: int = self._pages.buffer_bytes  # virtual bytes of one K or V buffer (all reqids)
        self._span = CacheSpan(memory.base, memory.base + memory.nbytes, self.buffer_bytes, self.slice_bytes,
                               self.config.token_bytes_per_buffer, self.device.type, self._pages)
        remember_span(self._span)
        self._bindings: dict[int, ViewsBinding] = {}  # mapped_check's, per first_reqid
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._closing = False  # set first thing in cleanup(): cached views are not handed out after it
        _live_managers.add(self)
        if self.device.type == "cuda":
            watch_captures(self)  # background driver work waits during any CUDA graph capture

    @property
    def num_page_ids(self) -> int:
        """Page ids in the pool: ids are ``0 .. num_page_ids - 1``; each is one
        physical page of every buffer."""
        return self._pages.num_ids

    @property
    def policy(self) -> dict[str, Any]:
        """The policy knobs the core runs with, by name: what the arguments
        asked, after the manager's logic between knobs
        (:func:`vattn.core.policy.resolve_policy`)."""
        return self._pages.policy.as_dict()

    @property
    def slot_bytes(self) -> int:
        """Deprecated name of :attr:`slice_bytes` (bytes of one reqid's slice of one buffer)."""
        warn_renamed("KVCacheManager.slot_bytes", "KVCacheManager.slice_bytes")
        return self.slice_bytes

    @property
    def page_tokens(self) -> int | None:
        """Tokens one page id holds, when a page is a whole number of tokens
        (otherwise None: tokens straddle page boundaries)."""
        per = self.config.token_bytes_per_buffer
        return self.page_size // per if self.page_size % per == 0 else None

    # ---- tensors -------------------------------------------------------------

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer ``index``: two ``[B, L, H, D]`` views of the reservation.

        Only rows ``[:n]`` of a reqid that :meth:`step` covered for ``n`` tokens
        are backed by memory; reading other rows faults. Never call ops that read
        the whole tensor (``.contiguous()``, ``.clone()``, ``zero_()``).
        """
        index = _bounded_int("layer index", index, self.config.num_layers)
        self._check_process()
        views = self._views()
        if self._closing:  # cleanup() ran while the views were built
            self._layers = None
            self._pages.check_usable()
        return views[index]

    def kv_tensor(self, index: int) -> torch.Tensor:
        """K and V of layer ``index`` as one ``[2, B, L, H, D]`` view (``[0]`` is
        K, ``[1]`` V): the layout of vLLM's FlashAttention KV cache with
        ``num_blocks = B`` and ``block_size = L``. Same rules as :meth:`layer`.
        """
        k, _ = self.layer(index)
        cfg, nbytes = self.config, self._pages.buffer_bytes
        first = 2 * index if cfg.layout == "per_layer" else 0  # K's buffer; V's is the next one
        raw = torch.from_dlpack(self._pages.memory.dlpack(first * nbytes, 2 * nbytes))
        offset = (k.data_ptr() - self.buffer_address(first)) // cfg.element_bytes  # layer column (all_layers)
        return raw.view(cfg.dtype).as_strided((2, *k.shape), (nbytes // cfg.element_bytes, *k.stride()), offset)

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer as a tensor: per_layer ``2N x [B, L, H, D]`` in order
        K0, V0, K1, V1, ...; all_layers ``[K, V]``, each ``[B, L, N, H, D]``."""
        self._check_process()
        return [self._buffer_tensor(b) for b in range(self.config.num_buffers)]

    def token_rows(self) -> torch.Tensor:
        """Every buffer's token rows as one ``[num_buffers, B, R, row_bytes]`` uint8 view (``R``: a slice's rows)."""
        size, row, n = self._pages.buffer_bytes, self.config.token_bytes_per_buffer, self.config.num_buffers
        return torch.from_dlpack(self._pages.memory.dlpack(0, n * size)).as_strided(
            (n, self.config.max_batch_size, self.slice_bytes // row, row), (size, self.slice_bytes, row, 1))

    def buffer_address(self, buffer: int) -> int:
        """Virtual address (int) of buffer ``buffer``'s first byte, for custom kernels."""
        buffer = _bounded_int("buffer", buffer, self.config.num_buffers)
        return self._pages.memory.base + buffer * self._pages.buffer_bytes

    def _views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        layers = self._layers  # one read: cleanup() may reset it from another thread
        if layers is None:
            bufs = self.buffers()
            if self.config.layout == "per_layer":
                layers = [(bufs[2 * i], bufs[2 * i + 1]) for i in range(self.config.num_layers)]
            else:
                k, v = bufs
                layers = [(k[:, :, i], v[:, :, i]) for i in range(self.config.num_layers)]
            self._layers = layers
        return layers

    def _buffer_tensor(self, buffer: int) -> torch.Tensor:
        cfg = self.config
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable(
                "this torch build has no CUDA support, so CUDA cache tensors cannot be "
                "created; use buffer_address() for raw access"
            )
        nbytes = self._pages.buffer_bytes
        raw = torch.from_dlpack(self._pages.memory.dlpack(buffer * nbytes, nbytes))
        elems = raw.view(cfg.dtype)
        row = cfg.num_kv_heads * cfg.head_dim
        slice_elems = self.slice_bytes // cfg.element_bytes
        if cfg.layout == "per_layer":
            shape = (cfg.max_batch_size, cfg.max_context_len, cfg.num_kv_heads, cfg.head_dim)
            strides = (slice_elems, row, cfg.head_dim, 1)
        else:
            shape = (cfg.max_batch_size, cfg.max_context_len, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
            strides = (slice_elems, cfg.num_layers * row, row, cfg.head_dim, 1)
        return elems.as_strided(shape, strides)

    # ---- requests ------------------------------------------------------------

    def alloc_reqid(self, prompt_len: int | None = None, reqid: int | None = None) -> int:
        """Returns a free reqid in ``[0, max_batch_size)``.

        Prefers the free reqid whose pages are still mapped: with ``prompt_len``
        (tokens) the smallest mapping that covers it, else the largest mapping.
        ``reqid`` asks for that reqid instead, for callers that number requests
        themselves (a framework's block id); it must be free, and pages it
        still holds beyond ``prompt_len`` tokens (all, when None) are unmapped
        first, so the request starts with no more than it needs. Pages a freed
        reqid shared with other requests are never handed to a new request.
        Raises :class:`vattn.OutOfReqids` when all reqids are in use.
        """
        wanted = -1 if reqid is None else self._reqid(reqid)
        if prompt_len is None:
            return self._pages.alloc_reqid(-1, wanted)
        prompt = _as_int("prompt_len", prompt_len)
        if not 0 <= prompt <= self.config.max_context_len:
            raise ValueError(f"prompt_len must be in [0, {self.config.max_context_len}] (max_context_len), "
                             f"got {prompt_len}")
        return self._pages.alloc_reqid(prompt, wanted)

    def free_reqid(self, reqid: int) -> None:
        """Ends a request. Its pages stay mapped for reuse until memory runs low
        (deferred reclaim); pages it shares stay with the requests and prefix
        handles that still use them."""
        self._pages.free_reqid(self._reqid(reqid))

    def step(self, seq_lens: SeqLens) -> bool:
        """Maps pages so every active reqid can hold its length.

        Args:
            seq_lens: ``max_batch_size`` token counts indexed by reqid: a list
                or tuple of ints, or a 1-D integer numpy array or CPU tensor of
                any stride; 0 for reqids not in this step (threads may step
                disjoint reqids concurrently).

        Returns:
            True when every reqid ``r`` has at least ``seq_lens[r]`` tokens
            mapped in every buffer. False when the physical pool cannot supply
            the pages even after unmapping pages of freed reqids, or they
            cannot be created now (the budget refuses them, the device or host
            is out of memory); no active request lost a page. The caller
            preempts a request and steps again.
        """
        if type(seq_lens) is not list:  # a list (the usual case) goes as it is: the core checks it
            seq_lens = _int_array("seq_lens", seq_lens)
        return self._pages.step(seq_lens)

    def reclaim(self, max_pages: int | None = None) -> int:
        """Unmaps up to ``max_pages`` pages (all buffers counted) held by freed
        reqids; all of them when None. A page id goes whole (one page in each
        of the ``num_buffers`` buffers), so ``max_pages`` is rounded up to a
        multiple of ``num_buffers``. Returns the number of pages returned to
        the pool."""
        limit = 2**63 - 1 if max_pages is None else _as_int("max_pages", max_pages)
        if not 0 <= limit < 2**63:
            raise ValueError(f"max_pages must be in [0, 2^63), got {limit}")
        return self._pages.reclaim(limit)

    def reclaim_freed(self, wait: bool = False) -> tuple[int, int]:
        """Deferred reclamation of freed reqids: unmaps every page position
        of the free reqids whose readers the device has finished (asked
        without waiting, so a forward never waits for the device here), or,
        with ``wait``, of every free reqid. Pages still used elsewhere stay
        there. Returns the positions unmapped (per buffer) and how many free
        reqids still map pages (their readers were not done)."""
        if not isinstance(wait, bool):
            raise TypeError(f"wait must be a bool, got {type(wait).__name__}")
        return self._pages.reclaim_freed(wait)

    def release_free_memory(self, max_bytes: int | None = None) -> int:
        """Gives free physical memory back to the OS or device (and to the budget): up to ``max_bytes``
        bytes (all when None) of the free pool, then of freed reqids' and eager pages (unmapped first).
        A page id goes whole (``page_size`` bytes in each of the ``num_buffers`` buffers), so
        ``max_bytes`` is rounded up to a multiple of ``page_size * num_buffers``.
        Pages under requests or prefix handles stay. Returns the bytes released (taken out of the pool: a
        page whose release the driver or the OS refused is among them, and counted in
        ``stats()["pages_release_failed"]``; it stays charged to the budget). What ``idle_release_s``
        does on its own in a budget; not for ``page_allocator="external"`` (ValueError; see release_pages).
        A preallocated pool (``preallocate=True``) is kept whole until cleanup: 0."""
        limit = 2**63 - 1 if max_bytes is None else _as_int("max_bytes", max_bytes)
        if not 0 <= limit < 2**63:
            raise ValueError(f"max_bytes must be in [0, 2^63), got {limit}")
        return self._pages.release_free(-(-limit // self.page_size)) * self.page_size

    def release_pages(self, page_ids: IntArray) -> list[int]:
        """With ``page_allocator="external"``: gives the physical pages of the given page ids back to
        the OS or device, and to the budget, for those that are created and mapped in no reqid (a
        framework's freed blocks whose contents are no longer wanted). A later :meth:`map_pages` of
        such an id creates (and charges) its pages again, with their contents gone. Ids still mapped
        somewhere, or never created, are left as they are, and so is every id of a preallocated pool
        (``preallocate=True``: kept whole until cleanup).

        Args:
            page_ids: ids in ``[0, num_page_ids)``, any order; repeats are released once.

        Returns:
            The ids released, in the order given. ValueError (nothing released) for an id out of
            range, or for a manager that hands out its own ids (use ``release_free_memory``).
        """
        return list(self._pages.release_external(_int_array("page_ids", page_ids)))

    def fits_alone(self, tokens: int) -> bool:
        """Whether one request of ``tokens`` tokens could ever be mapped here: its pages fit the
        physical pool. A budget's limit does not decide it: the limit is a live setting (lowered for
        a moment, raised again), so in a budget a request that fits the pool waits when ``step``
        refuses it; one that does not fit the pool can never run. False above ``max_context_len``
        (``step`` refuses those lengths); ``tokens`` below 0 raises ValueError."""
        count = _as_int("tokens", tokens)
        if count < 0:
            raise ValueError(f"tokens must be at least 0, got {tokens}")
        if count > self.config.max_context_len:
            return False
        return self.config.pages_for(count, self.page_size) <= self.num_page_ids  # page ids, one a position

    def budget_share(self) -> dict[str, Any] | None:
        """This manager's share of its budget now, in bytes: ``held_bytes``
        (every created page), of which ``in_use_bytes`` (under requests,
        prefix handles) and ``free_held_bytes`` (kept for reuse); with
        ``budget`` (its name) and ``detached`` (why the manager went on
        without it: the budget was removed or damaged; "" while it draws from
        it). None outside a budget. :meth:`vattn.Budget.usage`
        shows what every manager last reported (within 20 ms)."""
        share = self._pages.budget_share()
        return share if share["budget"] else None

    def wait_for_budget(self, timeout_s: float) -> bool:
        """After a :meth:`step` that returned False in a budget: blocks, using
        no CPU, until memory may have come free in the budget (another member
        gave pages back, left or died, the limit changed) or ``timeout_s``
        seconds (0-3600) pass. Returns whether something changed; False at
        once outside a budget. Step again within a second so the refusal keeps
        counting as a wait the other members give memory back for."""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise TypeError(f"timeout_s must be a number of seconds, got {type(timeout_s).__name__}")
        if not 0 <= timeout_s <= 3600:
            raise ValueError(f"timeout_s must be in [0, 3600] seconds, got {timeout_s}")
        return self._pages.wait_for_budget(float(timeout_s))

    def mapped_tokens(self, reqid: int) -> int:
        """Tokens reqid can hold with its pages mapped now (per buffer): the end of its mapping,
        over the holes a sliding window's front left below it (:meth:`mapped_bytes` counts pages)."""
        pages = self._pages.mapped_pages(self._reqid(reqid))
        return min(pages * self.page_size // self.config.token_bytes_per_buffer, self.config.max_context_len)

    def mapped_bytes(self, reqid: int) -> int:
        """Physical bytes mapped behind reqid's slices, all buffers together
        (shared pages counted in full; the holes a sliding window's front left
        below it, :meth:`unmap_pages_below`, not at all)."""
        pages = self._pages.backed_pages(self._reqid(reqid))
        return pages * self.page_size * self.config.num_buffers

    def is_allocated(self, reqid: int) -> bool:
        return self._pages.reqid_allocated(self._reqid(reqid))

    def reads_done(self, reqid: int) -> bool:
        """Whether the device has finished every kernel queued before
        ``reqid`` was freed (asked without waiting), so that unmapping its
        pages waits for nothing; False while ``reqid`` is allocated. Always
        True on the host backend once freed."""
        return self._pages.reads_done(self._reqid(reqid))

    def check_mapped(self, view: torch.Tensor, reqids: IntArray, seq_lens: IntArray,
                     what: str = "check_mapped", first_rows: IntArray | None = None) -> None:
        """Raises unless a kernel may read rows ``[0, seq_lens[i])`` of
        ``view[reqids[i]]``: each reqid allocated, with that many tokens mapped.

        Args:
            view: a ``[B, L, H, D]`` view of this cache (:meth:`layer`, a
                half of :meth:`kv_tensor`, or a slice of them along B or L).
            reqids: indices into ``view``'s first dimension.
            seq_lens: tokens read from each (0 .. ``max_context_len``).
            what: the caller's name, which starts the error message.
            first_rows: the first row read of each (None: row 0). Rows below
                the holes :meth:`unmap_pages_below` left are unmapped: a read
                from under them raises.

        Raises ``ValueError`` naming the reqid (not allocated; fewer tokens
        mapped), or when ``view``'s strides are not the cache's (reqid and token
        strides of :meth:`layer`). One call into the core for the whole batch.
        """
        origin = view_origin(self._span, view, what)
        rows, tokens = MappedCheck.rows(reqids, seq_lens, origin)
        self._pages.check_mapped(rows, tokens, what, MappedCheck.first_rows(first_rows, origin))

    def mapped_check(self, reqids: IntArray, seq_lens: IntArray, what: str, first_reqid: int = 0,
                     cached_lens: IntArray | None = None) -> ViewsCheck:
        """:meth:`check_mapped` prepared for one forward, built once and
        carried by its plan: ``check(k_cache, v_cache, what)`` raises as
        :meth:`check_mapped` would for layer views whose row 0 is reqid
        ``first_reqid`` (token 0). It asks the core only when a slice lost
        pages or a reqid was freed since it last passed (a counter the core
        keeps), so a layer costs a comparison of its views' addresses and
        strides and one read of that counter. Views of anything else are
        looked up by address (:class:`vattn.core.mapped_check.ViewsCheck`).
        With ``cached_lens`` (tokens cached before this forward, per request),
        ``check(k_cache, v_cache, what, sliding_window)`` checks the rows a
        sliding window reads, from ``cached_len - sliding_window + 1`` on."""
        first = _bounded_int("first_reqid", first_reqid, self.config.max_batch_size)
        if first not in self._bindings:  # one per origin for the cache's life: a forward's check points at it
            self._bindings[first] = ViewsBinding(self._span, (first, 0), self.config.element_bytes)
        return ViewsCheck(reqids, seq_lens, what, self._bindings[first], cached_lens)

    def _reqid(self, value: object, name: str = "reqid") -> int:
        return _bounded_int(name, value, self.config.max_batch_size)

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise ForkedError(
                "this KV cache manager was created by another process: a forked child cannot use its "
                "parent's cache (create a new manager in the child)"
            )

    # ---- accounting and lifetime -------------------------------------------------

    def stats(self) -> Stats:
        """Counters and memory figures. Bytes are bytes; pages count every buffer.

        ``bytes_used``: bytes the active tokens occupy; ``bytes_mapped``:
        physical bytes mapped; ``bytes_in_requests``: of those, the bytes
        allocated reqids map (not what only freed reqids still map);
        ``bytes_created``: physical bytes held; ``bytes_reserved``: virtual
        bytes reserved; ``bytes_static``: what a static max-length
        reservation would need. A page id counts in every buffer while any
        of its mappings lasts: an orphan (an unmap the driver or OS refused
        in some buffers, retried later) counts its whole id until settled.
        """
        s = Stats(self._pages.stats())
        cfg = self.config
        s.update(
            backend=self.backend.name,
            device=str(self.device),
            layout=cfg.layout,
            page_size=self.page_size,
            num_buffers=cfg.num_buffers,
            bytes_total=s["pages_total"] * self.page_size,
            bytes_created=s["pages_created"] * self.page_size,
            budget=self.budget.name if self.budget is not None else None,
            bytes_used=s["tokens_active"] * cfg.token_bytes,
            bytes_reserved=cfg.num_buffers * self._pages.buffer_bytes,
            bytes_static=cfg.static_bytes(),
        )
        return s

    @property
    def bytes_mapped(self) -> int:
        """Physical bytes mapped in the cache's slices, every buffer (a page
        mapped in several slices counts once): ``stats()["bytes_mapped"]``
        without the rest of the stats."""
        return self._pages.bytes_mapped

    @property
    def bytes_in_requests(self) -> int:
        """Physical bytes mapped in allocated reqids' slices, every buffer (a
        page in several counts once): ``bytes_mapped`` less what only free
        reqids still map (deferred reclamation, slices kept for reuse)."""
        return self._pages.bytes_in_requests

    def wait_idle(self) -> None:
        """Blocks until the background mapper has mapped everything it planned
        (for tests and benchmarks; serving code never needs it)."""
        self._pages.wait_idle()

    def _vmm_backend(self) -> Any:
        """The C++ VMM backend of the open cache (ClosedError after cleanup)."""
        self._pages.check_usable()
        return self._pages.memory.backend

    @property
    def closed(self) -> bool:
        return self._pages.closed

    def cleanup(self) -> None:
        """Releases the cache: stops the mapper, releases prefix handles, and
        unmaps every page and releases the pool and the address range once no
        tensor from :meth:`layer` is left (like a torch storage, a view that
        outlives cleanup keeps the memory it reads; drop views to free it).
        Every other call afterwards raises :class:`vattn.ClosedError`."""
        self._closing = True
        self._layers = None
        forget_span(self._span)
        self._pages.close()

    close = cleanup

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        c = self.config
        if os.getpid() != self._pid:
            state = "another process's (inherited by fork)"
        else:
            state = "closed" if self.closed else f"{self._pages.stats()['pages_mapped']} pages mapped"
        return (
            f"KVCacheManager(layers={c.num_layers}, kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, "
            f"dtype={c.dtype}, B={c.max_batch_size}, L={c.max_context_len}, layout={c.layout}, "
            f"device={self.device}, page_size={self.page_size}, {state})"
        )


# Managers still open at interpreter exit are closed then, so their mapper
# threads are joined before the interpreter and the driver go away.
_live_managers: weakref.WeakSet[KVCacheManager] = weakref.WeakSet()


@atexit.register
def _close_live_managers() -> None:
    for manager in list(_live_managers):
        try:
            manager.cleanup()
        except Exception:  # noqa: BLE001 - exit must go on; the OS reclaims the rest
            pass
