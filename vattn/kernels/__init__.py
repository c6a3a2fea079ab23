"""Attention kernels on the vattn cache, one protocol for all of them.

Every kernel reads K/V straight from the cache tensors of
:meth:`vattn.KVCacheManager.layer` (``[B_max, L, H_kv, D]`` views, either
layout): no block table, no gather, no copy of the cache. Each request ``r``
is read only in rows ``[0, seq_len)``, which ``step`` has mapped, plus the
rows its :class:`ReadFootprint` declares (a kernel that loads whole key tiles
unmasked); nothing reads the rest of the slice (a read there would fault).

Modules:

- ``batch``: :class:`AttentionBatch` (one forward's requests), :func:`write_kv`
  and the input checks every kernel shares.
- ``protocol``: :class:`Kernel` (``supports`` a case and says why not,
  ``plan`` a batch once per forward, ``run`` one layer), :class:`AttentionCase`,
  :class:`Support`, :class:`KernelPlan`, :class:`ReadFootprint` (rows read
  past a request's own, which whoever maps the cache must map too).
- ``host``: vattn's own kernel (``vattn._cpu_attn``, ``csrc/cpu_attn``),
  :class:`HostKernel`; its limits are read from the extension.
- ``sdpa``: torch SDPA per request, :class:`SdpaKernel` (the reference).
- ``flash_attn``: FlashAttention's ``flash_attn_varlen_func``, one call per
  layer for the batch (the ``flash-attn`` package, or vLLM's build),
  :class:`FlashAttentionKernel`.
- ``torch_flash``: torch's own FlashAttention-2
  (``torch.ops.aten._flash_attention_forward``), one varlen call per layer on
  the cache's token rows, :class:`TorchFlashKernel`: CUDA without any package.
- ``flashinfer``: FlashInfer's batched paged kernels and its single prefill,
  :class:`FlashInferKernel`, :class:`FlashInferSinglePrefillKernel`.
- ``page_view``: the cache as a paged cache whose page table is plain
  ranges (what FlashInfer's ``"pages"`` presentation reads).
- ``select``: the kernel instances (:data:`KERNELS`), the preference per
  device and :func:`select_kernel`, the one rule that picks a kernel.

FlashAttention and FlashInfer are imported on first use; without them, or
without a CUDA tensor, their kernels raise :class:`vattn.BackendUnavailable`.
- ``functions``: the function-per-kernel API on top of these, which
  :mod:`vattn.attention` exports.
"""

from .batch import AttentionBatch, write_kv
from .flash_attn import FlashAttentionKernel, FlashAttentionPlan
from .flashinfer import FlashInferKernel, FlashInferPlan, FlashInferSinglePrefillKernel
from .host import HostKernel, HostPlan
from .protocol import AttentionCase, Kernel, KernelPlan, ReadFootprint, Support
from .sdpa import SdpaKernel, sdpa_dense
from .torch_flash import TorchFlashKernel, TorchFlashPlan, cache_rows
from .select import KERNELS, PREFERENCE, NoKernel, select_kernel

__all__ = [
    "AttentionBatch",
    "AttentionCase",
    "FlashAttentionKernel",
    "FlashAttentionPlan",
    "FlashInferKernel",
    "FlashInferPlan",
    "FlashInferSinglePrefillKernel",
    "HostKernel",
    "HostPlan",
    "KERNELS",
    "Kernel",
    "KernelPlan",
    "NoKernel",
    "PREFERENCE",
    "ReadFootprint",
    "SdpaKernel",
    "Support",
    "TorchFlashKernel",
    "TorchFlashPlan",
    "cache_rows",
    "sdpa_dense",
    "select_kernel",
    "write_kv",
]
