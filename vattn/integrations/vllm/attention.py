"""vattn's attention backend for vLLM: the metadata builder maps the
forward's blocks into the slices and plans the batch once; the
implementation runs the worker's kernel on the dense cache for every layer."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import numpy as np
import torch

from vattn.kernels import AttentionBatch, Kernel, KernelPlan

from .configuration import SWITCH, check_kernel
from .worker_cache import WorkerCache


@dataclasses.dataclass
class VAttnMetadata:
    kernel: Kernel  # the worker's attention kernel
    plan: KernelPlan  # the forward's batch as the kernel planned it; its reqids are the requests' slices


def _builder_cls() -> type:
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    class VAttnMetadataBuilder(AttentionMetadataBuilder[VAttnMetadata]):
        """Maps the forward's blocks into the rows' slices, then plans the batch
        once for every layer (the kernel's plan)."""

        def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any) -> None:
            # vLLM declares the builder's __init__ abstract
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            self.cache: WorkerCache | None = None  # bound by the worker once the cache exists

        def bind(self, cache: WorkerCache) -> None:
            """The worker's cache: vLLM makes the builders before the KV cache tensors."""
            self.cache = cache

        def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> VAttnMetadata:
            m = common_attn_metadata
            cache = self.cache
            if cache is None:
                raise RuntimeError("vattn: attention metadata built before the vattn KV cache exists")
            starts = m.query_start_loc_cpu[: m.num_reqs + 1].numpy()
            query_lens = np.diff(starts)
            n = int(np.count_nonzero(query_lens))  # rows past n are padding
            seq_lens = m.seq_lens_cpu_upper_bound if m.seq_lens_cpu_upper_bound is not None else m.seq_lens
            seq_lens = seq_lens[:n].numpy().astype(np.int64)  # exact: no speculative decoding
            query_lens = query_lens[:n]
            reqids = cache.map_batch(cache.group_of[self.layer_names[0]], seq_lens, query_lens)
            batch = AttentionBatch.of_arrays(reqids, seq_lens - query_lens, query_lens, device=self.device)
            return VAttnMetadata(cache.kernel, cache.kernel.plan(batch, cache.case))

    return VAttnMetadataBuilder


def _impl_cls() -> type:
    from vllm.v1.attention.backend import AttentionImpl, AttentionType

    class VAttnAttentionImpl(AttentionImpl):
        """Writes the new K/V into the request's slice and attends over ``k[reqid, :seq_len]``."""

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
backend_class = functools.cache(_backend_cls)
BACKEND_PATH = f"{__name__}.VAttnAttentionBackend"  # what vLLM's backend registry imports


def __getattr__(name: str) -> Any:
    # The backend class derives from vLLM's, so it is built on first use; vLLM
    # imports it by BACKEND_PATH.
    if name == "VAttnAttentionBackend":
        return backend_class()
    raise AttributeError(name)
