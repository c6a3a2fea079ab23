"""What vattn serves under vLLM, decided at start-up in every process: the
switch, the kernel for a model's attention and whether it loads, the layout,
and the refusals (with the reason and what to unset) of what vattn cannot
serve."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from vattn.integrations import block_mapper
from vattn.kernels import AttentionCase, Kernel, NoKernel, select_kernel
from vattn.kernels.flash_attn import FlashAttentionKernel

from . import budget as vllm_budget
from .worker_cache import LAYOUT_SETTING, granularity

SWITCH = "VATTN_VLLM"
ALLOW_UNTESTED = "VATTN_VLLM_ALLOW_UNTESTED"
TESTED_VLLM_VERSIONS = ("0.32.0",)


def enabled() -> bool:
    return os.environ.get(SWITCH, "") == "1"


# :func:`vattn.integrations.block_mapper.choose_layout`, the layout named as vattn's vLLM setting
choose_layout = functools.partial(block_mapper.choose_layout, setting=LAYOUT_SETTING)


def serving_kernel(case: AttentionCase) -> Kernel:
    """The kernel vattn serves ``case`` with in vLLM: the batched kernel
    :func:`vattn.kernels.select_kernel` picks (vLLM brings its own build of
    the GPU kernel, so whether it loads is checked where it runs). Raises
    ValueError naming the kernel's limit otherwise."""
    try:
        return select_kernel(case, batched=True, installed=False)
    except NoKernel as e:
        raise ValueError(f"vattn: {e}; unset {SWITCH} for this model") from None


# vLLM's own build of FlashAttention-2 (vLLM does not ship the flash-attn package), through
# vattn.integrations.vllm.flash_attn; the flash-attn package is the fallback
VLLM_FLASH_ATTN = FlashAttentionKernel("vattn.integrations.vllm.flash_attn",
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
    return serving_kernel(case).name


def configure(vllm_config: Any) -> None:
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


