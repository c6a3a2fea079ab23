"""A transformers ``Cache`` whose K/V live in a vattn cache.

Each batch row ``b`` of the model's input is vattn reqid ``b`` of a
:class:`vattn.KVCacheManager` the cache owns. ``update`` writes the new K/V in
place, calls ``step`` when the sequence grows (so physical pages follow the
tokens held), and returns the views ``k[:B, :n]`` of the filled rows, never the
whole ``max_context_len`` buffer, so attention reads only mapped memory.

Checked against transformers 5.22 and 5.23 (``pip install vattn[transformers]``).

Example::

    from vattn.integrations.transformers import VAttnCache

    cache = VAttnCache.from_model(model, max_batch_size=4, max_context_len=2048)
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache,
                         max_new_tokens=64)
    print(cache.stats()["bytes_mapped"])
    cache.close()
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from vattn.core import KVCacheManager
from vattn.common.errors import OutOfPages

from .hf_model import kv_shape

__all__ = ["VAttnCache"]

class _Batch:
    """State the layers share: the manager, the batch size, the mapped lengths."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.size = 0  # batch rows in use (reqids 0 .. size-1)
        # tokens step() has covered per reqid; rows of an earlier, larger batch
        # keep theirs, so their pages stay mapped for the next batch
        self.row_tokens = [0] * manager.config.max_batch_size

    def start(self, size: int) -> None:
        limit = self.manager.config.max_batch_size
        if not 1 <= size <= limit:
            raise ValueError(f"batch size must be in [1, {limit}] (max_batch_size of this VAttnCache), got {size}")
        if self.size and size != self.size:
            raise ValueError(f"this VAttnCache holds a batch of {self.size}; got {size} rows "
                             "(call reset() before a new batch)")
        self.size = size

    def cover(self, tokens: int, size: int | None = None) -> None:
        """Maps pages so rows 0 .. size-1 hold ``tokens`` tokens each."""
        size = self.size if size is None else size
        if min(self.row_tokens[:size]) >= tokens:
            return  # the per-token fast path: no call into vattn
        limit = self.manager.config.max_context_len
        if tokens > limit:
            raise ValueError(f"sequence length {tokens} exceeds max_context_len={limit} of this VAttnCache")
        lens = [max(n, tokens) if row < size else n for row, n in enumerate(self.row_tokens)]
        if not self.manager.step(lens):
            raise OutOfPages(f"the vattn page pool ({self.manager.stats()['bytes_total']} bytes) cannot hold "
                             f"{size} sequences of {tokens} tokens; pass a larger physical_memory")
        self.row_tokens = lens


class VAttnLayer(CacheLayerMixin):
    """One decoder layer's K/V: views into the owning cache's vattn buffers."""

    is_sliding = False
    is_croppable = True

    def __init__(self, batch: _Batch, layer_idx: int) -> None:
        super().__init__()
        self._batch = batch
        self.layer_idx = layer_idx
        self.length = 0  # tokens this layer holds per row

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = self._batch.manager.config
        want = (cfg.num_kv_heads, cfg.head_dim)
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if t.dim() != 4 or tuple(t.shape[1::2]) != want:
                raise ValueError(f"{name} must be [batch, {want[0]}, tokens, {want[1]}] for this VAttnCache, "
                                 f"got {tuple(t.shape)}")
            if t.dtype != cfg.dtype or t.device != self._batch.manager.device:
                raise TypeError(f"{name} is {t.dtype} on {t.device}; this VAttnCache holds {cfg.dtype} on "
                                f"{self._batch.manager.device} (from_model(..., dtype=, device=))")
        self._batch.start(key_states.shape[0])
        self.dtype, self.device = cfg.dtype, self._batch.manager.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends ``[B, H_kv, q, D]`` K/V; returns ``[B, H_kv, n + q, D]`` views."""
        self.lazy_initialization(key_states, value_states)
        old, new = self.length, self.length + key_states.shape[2]
        self._batch.cover(new)
        k_rows, v_rows = self._rows(new)
        k_rows[:, old:new].copy_(key_states.transpose(1, 2))
        v_rows[:, old:new].copy_(value_states.transpose(1, 2))
        self.length = new
        self.keys, self.values = k_rows.transpose(1, 2), v_rows.transpose(1, 2)
        return self.keys, self.values

    def _rows(self, tokens: int, size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``[size, tokens, H, D]`` views of the first ``size`` reqids' filled rows."""
        size = self._batch.size if size is None else size
        k_cache, v_cache = self._batch.manager.layer(self.layer_idx)
        return k_cache[:size, :tokens], v_cache[:size, :tokens]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self._batch.manager.config.max_context_len

    def reset(self) -> None:
        self.length = 0
        self.keys = self.values = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last ``-tokens_to_remove`` tokens (a negative count, as in DynamicLayer)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative token count, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)
        self._refresh_views()

    def select_rows(self, index: torch.Tensor) -> None:
        """Row ``b`` becomes old row ``index[b]``, for all ``len(index)`` rows.

        Reads and writes only filled rows; the caller has mapped the new rows.
        """
        if self.length:
            k_old, v_old = self._rows(self.length)
            k_new, v_new = self._rows(self.length, size=len(index))
            index = index.to(k_old.device)
            # index_select copies first, so rows may overlap their sources
            k_new.copy_(k_old.index_select(0, index))
            v_new.copy_(v_old.index_select(0, index))

    def _refresh_views(self) -> None:
        if self.is_initialized:
            k_rows, v_rows = self._rows(self.length)
            self.keys, self.values = k_rows.transpose(1, 2), v_rows.transpose(1, 2)


class VAttnCache(Cache):
    """A transformers ``Cache`` backed by an own :class:`vattn.KVCacheManager`.

    Args:
        num_layers, num_kv_heads, head_dim, dtype: the model's KV shape (see
            :meth:`from_model`, which reads them from a model).
        max_batch_size: batch rows the cache can hold.
        max_context_len: tokens per row at most (prompt, padding included, plus
            generated tokens).
        device: ``"cpu"`` or ``"cuda[:i]"``; the model's device.
        **vattn_options: passed to :class:`vattn.KVCacheManager` (``page_size``,
            ``layout``, ``physical_memory``, ``policy``). The ``eager`` knob
            defaults to False here (a ``policy`` mapping without it gets it;
            a ``vattn.Policy`` is taken as given): the cache owns every reqid,
            so there is nothing to pre-map.

    Physical memory follows the tokens held: after ``n`` tokens each of ``B``
    rows has ``ceil(n * token_bytes / page_size)`` pages mapped per buffer (one
    more with the mapper's lookahead), not ``max_context_len``. The batch is
    fixed from the first forward until :meth:`reset`. :meth:`close` (or garbage
    collection) releases the memory; the K/V views handed out earlier must not
    be read after that.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        max_batch_size: int,
        max_context_len: int,
        device: str | torch.device = "cpu",
        **vattn_options: Any,
    ) -> None:
        # Every reqid belongs to the cache from the start, so there is no next
        # request to pre-map for; eager mapping would only map memory no row uses.
        # A vattn.Policy names every knob, so it is taken as given.
        policy = vattn_options.pop("policy", None)
        if "eager" not in vattn_options and (policy is None or isinstance(policy, Mapping)):
            policy = {"eager": False, **(policy or {})}
        manager = KVCacheManager(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 dtype=dtype, max_batch_size=max_batch_size, max_context_len=max_context_len,
                                 device=device, policy=policy, **vattn_options)
        # Batch row b is reqid b: the cache owns every reqid of its manager.
        for _ in range(max_batch_size):
            manager.alloc_reqid()
        self.manager = manager
        self._batch = _Batch(manager)
        self._finalizer = weakref.finalize(self, manager.cleanup)
        super().__init__(layers=[VAttnLayer(self._batch, i) for i in range(num_layers)])

    @classmethod
    def from_model(
        cls,
        model: Any,
        max_batch_size: int,
        max_context_len: int,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        **vattn_options: Any,
    ) -> VAttnCache:
        """A cache shaped for ``model`` (a transformers decoder-only model).

        Layers, KV heads and head dim come from the model's text config; dtype
        and device from the model's parameters unless given.
        """
        return cls(
            **kv_shape(model),
            dtype=dtype or model.dtype,
            max_batch_size=max_batch_size,
            max_context_len=max_context_len,
            device=device or model.device,
            **vattn_options,
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the new tokens of layer ``layer_idx`` (in ``[0, num_layers)``)
        into the vattn cache; returns ``[B, H, tokens, D]`` views of its filled rows."""
        return super().update(key_states, value_states, self._layer_index(layer_idx), *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(self._layer_index(layer_idx))

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return super().get_mask_sizes(query_length, self._layer_index(layer_idx))

    def _layer_index(self, layer_idx: object) -> int:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx must be an int in [0, {len(self.layers) - 1}] (the cache's layers), "
                             f"got {layer_idx!r}")
        return layer_idx

    # ---- batch reshaping (beam search, contrastive search) ----------------------

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
        self._select_rows(torch.arange(self._batch.size).repeat_interleave(repeats))

    def _select_rows(self, index: torch.Tensor) -> None:
        # Integer row indices only: a float would be truncated and a bool mask
        # read as rows 0 and 1, both silently changing the batch.
        raw = index if isinstance(index, torch.Tensor) else torch.as_tensor(index)
        if raw.dtype == torch.bool or raw.is_floating_point() or raw.is_complex():
            raise TypeError(f"row indices must be integers, got a {raw.dtype} tensor")
        index = raw.to(torch.long).flatten()
        if self._batch.size == 0:
            return
        if index.numel() and not 0 <= int(index.min()) <= int(index.max()) < self._batch.size:
            raise ValueError(f"row indices must be in [0, {self._batch.size - 1}], got {index.tolist()}")
        size = index.numel()
        limit = self.manager.config.max_batch_size
        if not 1 <= size <= limit:
            raise ValueError(f"the new batch size must be in [1, {limit}] (max_batch_size), got {size}")
        self._batch.cover(max(layer.length for layer in self.layers), size=size)
        for layer in self.layers:
            layer.select_rows(index)
        self._batch.size = size
        for layer in self.layers:
            layer._refresh_views()

    # ---- lifetime ------------------------------------------------------------

    def reset(self) -> None:
        """Forgets every token; the next forward may bring a new batch size.
        Mapped pages are kept for the next batch."""
        super().reset()
        self._batch.size = 0

    def stats(self) -> dict[str, Any]:
        """The manager's stats (``bytes_mapped`` etc., see KVCacheManager.stats)."""
        return self.manager.stats()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Releases the vattn cache. Idempotent."""
        for layer in self.layers:
            layer.keys = layer.values = None
        self._finalizer()

    def __enter__(self) -> VAttnCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        cfg = self.manager.config
        state = "closed" if self.closed else f"batch={self._batch.size}, tokens={self.get_seq_length()}"
        return (f"VAttnCache(layers={cfg.num_layers}, kv_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim}, "
                f"dtype={cfg.dtype}, max_batch_size={cfg.max_batch_size}, "
                f"max_context_len={cfg.max_context_len}, {state})")
