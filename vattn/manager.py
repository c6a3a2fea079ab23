"""KVCacheManager: the public object that owns one virtual-memory KV cache."""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from . import _C
from .backends import BackendSpec, resolve_backend
from .config import KVCacheConfig, parse_device
from .errors import BackendUnavailable

SeqLens = Sequence[int] | torch.Tensor


class KVCacheManager:
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
        device: ``"cpu"`` (host backend) or ``"cuda"`` / ``"cuda:i"``.
        layout: ``"per_layer"`` (2N buffers ``[B, L, H, D]``) or ``"all_layers"``
            (2 buffers ``[B, L, N, H, D]``; layer i is the strided view ``[:, :, i]``).
        physical_memory: bytes of the physical page pool. ``None``: the smaller
            of what every reqid at full length needs and a share of free memory
            (half of MemAvailable on the host, 90% of free device memory on CUDA).
            Pages are committed only when first mapped.
        background: run one background mapper thread that, after each step,
            maps what the next step will need (every active request
            ``lookahead_tokens`` longer), so ``step`` maps on the critical path
            only what the mapper has not.
        deferred_reclaim: ``free_reqid`` keeps the request's pages mapped for
            the next request; the mapper unmaps pages of freed reqids when free
            pages fall below ``reclaim_threshold`` of the pool, and ``step`` does
            as a last resort. False: ``free_reqid`` unmaps them at once.
        eager: the mapper keeps the reqid ``alloc_reqid`` returns next mapped
            for ``eager_tokens`` tokens (default ``min(max_context_len, 1024)``),
            so a new request's prefill maps little or nothing. Needs ``background``.
        lookahead_tokens: how far ahead (tokens) the mapper maps active requests.
        reclaim_threshold: fraction of the pool, in [0, 1].

    With ``background``, ``deferred_reclaim`` and ``eager`` all False the
    manager maps and unmaps only inside ``step`` and ``free_reqid``.

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
        background: bool = True,
        deferred_reclaim: bool = True,
        eager: bool = True,
        lookahead_tokens: int = 1,
        eager_tokens: int | None = None,
        reclaim_threshold: float = 0.1,
    ) -> None:
        self.config = KVCacheConfig(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            max_batch_size=max_batch_size,
            max_context_len=max_context_len,
            layout=layout,
        )
        policy = _policy_args(background, deferred_reclaim, eager, lookahead_tokens, eager_tokens,
                              reclaim_threshold, self.config.max_context_len)
        kind, index = parse_device(device)
        self.device = torch.device("cpu") if kind == "host" else torch.device("cuda", index)
        self.backend: BackendSpec = resolve_backend(kind, index, self.config, page_size, physical_memory)
        self.page_size: int = self.backend.page_size
        self.slot_bytes: int = self.config.slot_bytes(self.page_size)
        self._pages = _C.PageManager(
            self.backend.make(),
            num_buffers=self.config.num_buffers,
            num_slots=self.config.max_batch_size,
            slot_bytes=self.slot_bytes,
            bytes_per_token=self.config.token_bytes_per_buffer,
            max_tokens=self.config.max_context_len,
            **policy,
        )
        self.policy: dict[str, Any] = policy
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        _live_managers.add(self)

    # ---- tensors -------------------------------------------------------------

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer ``index``: two ``[B, L, H, D]`` views of the reservation.

        Only rows ``[:n]`` of a reqid that :meth:`step` covered for ``n`` tokens
        are backed by memory; reading other rows faults. Never call ops that read
        the whole tensor (``.contiguous()``, ``.clone()``, ``zero_()``).
        """
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"layer index must be an int, got {type(index).__name__}")
        if not 0 <= index < self.config.num_layers:
            raise ValueError(f"layer index must be in [0, {self.config.num_layers - 1}], got {index}")
        return self._views()[index]

    def kv_tensor(self, index: int) -> torch.Tensor:
        """K and V of layer ``index`` as one ``[2, B, L, H, D]`` view (``[0]`` is
        K, ``[1]`` V): the layout of vLLM's FlashAttention KV cache with
        ``num_blocks = B`` and ``block_size = L``. Same rules as :meth:`layer`.
        """
        k, _ = self.layer(index)
        cfg, nbytes = self.config, self._pages.buffer_bytes
        first = 2 * index if cfg.layout == "per_layer" else 0  # K's buffer; V's is the next one
        raw = torch.from_dlpack(self._pages.reservation.dlpack(first * nbytes, 2 * nbytes))
        offset = (k.data_ptr() - self.buffer_address(first)) // cfg.element_bytes  # layer column (all_layers)
        return raw.view(cfg.dtype).as_strided((2, *k.shape), (nbytes // cfg.element_bytes, *k.stride()), offset)

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer as a tensor: per_layer ``2N x [B, L, H, D]`` in order
        K0, V0, K1, V1, ...; all_layers ``[K, V]``, each ``[B, L, N, H, D]``."""
        return [self._buffer_tensor(b) for b in range(self.config.num_buffers)]

    def buffer_address(self, buffer: int) -> int:
        """Virtual address (int) of buffer ``buffer``'s first byte, for custom kernels."""
        if not 0 <= buffer < self.config.num_buffers:
            raise ValueError(f"buffer must be in [0, {self.config.num_buffers - 1}], got {buffer}")
        return self._pages.reservation.base + buffer * self._pages.buffer_bytes

    def _views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._layers is None:
            bufs = self.buffers()
            if self.config.layout == "per_layer":
                self._layers = [(bufs[2 * i], bufs[2 * i + 1]) for i in range(self.config.num_layers)]
            else:
                k, v = bufs
                self._layers = [(k[:, :, i], v[:, :, i]) for i in range(self.config.num_layers)]
        return self._layers

    def _buffer_tensor(self, buffer: int) -> torch.Tensor:
        cfg = self.config
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable(
                "this torch build has no CUDA support, so CUDA cache tensors cannot be "
                "created; use buffer_address() for raw access"
            )
        reservation = self._pages.reservation
        nbytes = self._pages.buffer_bytes
        raw = torch.from_dlpack(reservation.dlpack(buffer * nbytes, nbytes))
        elems = raw.view(cfg.dtype)
        row = cfg.num_kv_heads * cfg.head_dim
        slot_elems = self.slot_bytes // cfg.element_bytes
        if cfg.layout == "per_layer":
            shape = (cfg.max_batch_size, cfg.max_context_len, cfg.num_kv_heads, cfg.head_dim)
            strides = (slot_elems, row, cfg.head_dim, 1)
        else:
            shape = (cfg.max_batch_size, cfg.max_context_len, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
            strides = (slot_elems, cfg.num_layers * row, row, cfg.head_dim, 1)
        return elems.as_strided(shape, strides)

    # ---- requests ------------------------------------------------------------

    def alloc_reqid(self, prompt_len: int | None = None, reqid: int | None = None) -> int:
        """Returns a free reqid in ``[0, max_batch_size)``.

        Prefers the free reqid whose pages are still mapped: with ``prompt_len``
        (tokens) the smallest mapping that covers it, else the largest mapping.
        ``reqid`` asks for that reqid instead, for callers that number requests
        themselves (a framework's block id); it must be free, and pages it
        still holds beyond ``prompt_len`` tokens (all, when None) are unmapped
        first, so the request starts with no more than it needs. Raises
        :class:`vattn.OutOfSlots` when all reqids are in use.
        """
        wanted = -1
        if reqid is not None:
            wanted = _as_int("reqid", reqid)
            if not 0 <= wanted < self.config.max_batch_size:
                raise ValueError(f"reqid must be in [0, {self.config.max_batch_size - 1}], got {reqid}")
        if prompt_len is None:
            return self._pages.alloc_slot(-1, wanted)
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int):
            raise TypeError(f"prompt_len must be an int or None, got {type(prompt_len).__name__}")
        if not 0 <= prompt_len <= self.config.max_context_len:
            raise ValueError(
                f"prompt_len must be in [0, {self.config.max_context_len}] (max_context_len), got {prompt_len}"
            )
        return self._pages.alloc_slot(prompt_len, wanted)

    def free_reqid(self, reqid: int) -> None:
        """Ends a request. Its pages stay mapped for reuse until memory runs low."""
        self._pages.free_slot(_as_int("reqid", reqid))

    def step(self, seq_lens: SeqLens) -> bool:
        """Maps pages so every active reqid can hold its length.

        Args:
            seq_lens: ``max_batch_size`` token counts indexed by reqid (list,
                tuple, int32/int64 array or CPU tensor); 0 for inactive reqids.

        Returns:
            True when every reqid ``r`` has at least ``seq_lens[r]`` tokens
            mapped in every buffer. False when the physical pool cannot supply
            the pages even after unmapping pages of freed reqids; no active
            request lost a page. The caller preempts a request and steps again.
        """
        if isinstance(seq_lens, torch.Tensor):
            seq_lens = seq_lens.tolist()
        return self._pages.step(seq_lens)

    def reclaim(self, max_pages: int | None = None) -> int:
        """Unmaps up to ``max_pages`` pages (all buffers counted) held by freed
        reqids; all of them when None. Returns the number of pages unmapped."""
        limit = 2**63 - 1 if max_pages is None else _as_int("max_pages", max_pages)
        if limit < 0:
            raise ValueError(f"max_pages must be >= 0, got {limit}")
        return self._pages.reclaim(limit)

    def mapped_tokens(self, reqid: int) -> int:
        """Tokens reqid can hold with its pages mapped now (per buffer)."""
        pages = self._pages.mapped_pages(_as_int("reqid", reqid))
        return min(pages * self.page_size // self.config.token_bytes_per_buffer, self.config.max_context_len)

    def mapped_bytes(self, reqid: int) -> int:
        """Physical bytes mapped behind reqid's slices, all buffers together."""
        pages = self._pages.mapped_pages(_as_int("reqid", reqid))
        return pages * self.page_size * self.config.num_buffers

    def is_allocated(self, reqid: int) -> bool:
        return self._pages.slot_allocated(_as_int("reqid", reqid))

    # ---- accounting and lifetime -------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters and memory figures. Bytes are bytes; pages count every buffer.

        ``bytes_used``: bytes the active tokens occupy; ``bytes_mapped``:
        physical bytes mapped; ``bytes_reserved``: virtual bytes reserved;
        ``bytes_static``: what a static max-length reservation would need.
        """
        s = self._pages.stats()
        cfg = self.config
        s.update(
            backend=self.backend.name,
            device=str(self.device),
            layout=cfg.layout,
            page_size=self.page_size,
            num_buffers=cfg.num_buffers,
            bytes_total=s["pages_total"] * self.page_size,
            bytes_used=s["tokens_active"] * cfg.token_bytes,
            bytes_reserved=cfg.num_buffers * self._pages.buffer_bytes,
            bytes_static=cfg.static_bytes(),
        )
        return s

    def wait_idle(self) -> None:
        """Blocks until the background mapper has mapped everything it planned
        (for tests and benchmarks; serving code never needs it)."""
        self._pages.wait_idle()

    @property
    def closed(self) -> bool:
        return self._pages.closed

    def cleanup(self) -> None:
        """Unmaps every page and releases the pool. Tensors from :meth:`layer`
        must not be used afterwards (their range stays reserved, unbacked)."""
        self._layers = None
        self._pages.close()

    close = cleanup

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        c = self.config
        state = "closed" if self.closed else f"{self._pages.stats()['pages_mapped']} pages mapped"
        return (
            f"KVCacheManager(layers={c.num_layers}, kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, "
            f"dtype={c.dtype}, B={c.max_batch_size}, L={c.max_context_len}, layout={c.layout}, "
            f"device={self.device}, page_size={self.page_size}, {state})"
        )


def _policy_args(background: bool, deferred_reclaim: bool, eager: bool, lookahead_tokens: int,
                 eager_tokens: int | None, reclaim_threshold: float, max_context_len: int) -> dict[str, Any]:
    for name, flag in (("background", background), ("deferred_reclaim", deferred_reclaim), ("eager", eager)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    lookahead_tokens = _as_int("lookahead_tokens", lookahead_tokens)
    if lookahead_tokens < 0:
        raise ValueError(f"lookahead_tokens must be >= 0, got {lookahead_tokens}")
    if eager_tokens is None:
        eager_tokens = min(max_context_len, 1024)
    eager_tokens = _as_int("eager_tokens", eager_tokens)
    if eager_tokens < 0:
        raise ValueError(f"eager_tokens must be >= 0, got {eager_tokens}")
    if isinstance(reclaim_threshold, bool) or not isinstance(reclaim_threshold, (int, float)):
        raise TypeError(f"reclaim_threshold must be a number, got {type(reclaim_threshold).__name__}")
    if not 0.0 <= reclaim_threshold <= 1.0:
        raise ValueError(f"reclaim_threshold must be in [0, 1], got {reclaim_threshold}")
    return dict(background=background, deferred_reclaim=deferred_reclaim, eager=eager and background,
                lookahead_tokens=lookahead_tokens, eager_tokens=eager_tokens,
                reclaim_threshold=float(reclaim_threshold))


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


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value.__index__())  # type: ignore[attr-defined]
