"""What vattn serves under vLLM, decided at start-up in every process: the
switch, the kernel for a model's attention and whether it loads, the layout,
and the refusals (with the reason and what to unset) of what vattn cannot
serve."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from typing import Any

import torch

from vattn.budget.membership import budget_name_from_environment
from vattn.integrations import block_placer
from vattn.kernels import AttentionCase, Kernel, NoKernel, select_kernel
from vattn.kernels.flash_attn import FlashAttentionKernel

from . import engine_budget, runtime
from .flash_attn import VllmFlashAttentionKernel

SWITCH = "VATTN_VLLM"
ALLOW_UNTESTED = "VATTN_VLLM_ALLOW_UNTESTED"
TESTED_VLLM_VERSIONS = ("0.32.0",)
LAYOUT_SETTING = "VATTN_VLLM_LAYOUT"
PAGE_BYTES_SETTING = "VATTN_VLLM_PAGE_BYTES"


def enabled() -> bool:
    return os.environ.get(SWITCH, "") == "1"


def granularity(device: torch.device) -> int:
    """Bytes a vattn page must be a multiple of on ``device``'s backend."""
    from vattn.backends import cuda_info, host_granularity

    return host_granularity() if device.type == "cpu" else cuda_info(device.index or 0)["granularity"]


# :func:`vattn.integrations.block_placer.choose_layout`, the layout named as vattn's vLLM setting
choose_layout = functools.partial(block_placer.choose_layout, setting=LAYOUT_SETTING)


def serving_kernel(case: AttentionCase) -> Kernel:
    """The kernel vattn serves ``case`` with in vLLM: the batched kernel
    :func:`vattn.kernels.select_kernel` picks (vLLM brings its own build of
    the GPU kernel, so whether it loads is checked where it runs). Raises
    ValueError naming the kernel's limit otherwise."""
    try:
        return select_kernel(case, batched=True, installed=False)
    except NoKernel as e:
        raise ValueError(f"vattn: {e}; unset {SWITCH} for this model") from None


# vLLM's own build of FlashAttention (vLLM does not ship the flash-attn package); the flash-attn
# package is the fallback
VLLM_FLASH_ATTN = VllmFlashAttentionKernel()


def loaded_kernel(kernel: Kernel, head_size: int | None = None) -> Kernel:
    """The kernel a worker runs in place of ``kernel`` (a
    :func:`serving_kernel` choice), checked to load here, at start-up: for
    FlashAttention vLLM's bundled build first (at the version vLLM runs on
    this GPU: :meth:`VllmFlashAttentionKernel.for_this_gpu`), the flash-attn
    package second. Raises RuntimeError naming why each candidate does not
    load."""
    candidates = (VLLM_FLASH_ATTN, kernel) if isinstance(kernel, FlashAttentionKernel) else (kernel,)
    reasons = []
    for candidate in candidates:
        ok, reason = candidate.available()
        if ok:
            return candidate.for_this_gpu(head_size) if candidate is VLLM_FLASH_ATTN else candidate
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
                         f"{cache.cache_dtype!r} is not supported: drop --kv-cache-dtype, or unset {SWITCH}")
    engine_budget.check_config(vllm_config)
    device = runtime.platform_device()
    if model.use_mla:
        raise ValueError("vattn's vLLM integration does not serve multi-head latent attention (DeepSeek-V2/V3 "
                         "keep one latent vector per token, read by vLLM's MLA kernels through its block table); "
                         f"unset {SWITCH} for this model")
    hf = model.hf_text_config
    window = getattr(hf, "sliding_window", None) if not model.is_hybrid else None
    check_kernel(model.get_head_size(), device, sliding_window=window,
                 logits_soft_cap=getattr(hf, "attn_logit_softcapping", None))
    page_bytes, layout = page_bytes_setting(), layout_setting()  # either refused here, whatever the model
    parallel = vllm_config.parallel_config
    shape = (model.get_num_layers(parallel), model.get_num_kv_heads(parallel), model.get_head_size(),
             model.dtype.itemsize)
    if page_bytes is not None:
        check_subpage_blocks(device, window, budget_name_from_environment())
        page_geometry(*shape, cache.block_size, config_granularity(device), layout, page_bytes)
    # Models whose sliding-window and global layers form several KV cache groups are checked in the
    # worker, which knows the groups (a page holds one group's layers); a single group is fitted here.
    elif not window:
        fit_block_size(cache, *shape, config_granularity(device), layout)
    if device != "cpu" or window:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        attention = vllm_config.attention_config
        if attention.backend not in (None, AttentionBackendEnum.CUSTOM):
            raise ValueError(f"vattn serves attention itself; drop attention backend {attention.backend.name} "
                             f"or unset {SWITCH}")
        attention.backend = AttentionBackendEnum.CUSTOM


CUDA_GRANULARITY = 2 << 20
"""Bytes: the CUDA driver's VMM granularity on current NVIDIA GPUs. The
configuring process (an API server, the engine core) never initialises CUDA
itself; the worker checks its device's real granularity again."""


def config_granularity(device: str) -> int:
    """Bytes a page must be a multiple of on ``device``, as known before the worker starts."""
    return granularity(torch.device("cpu")) if device == "cpu" else CUDA_GRANULARITY


PREFIX_BLOCK_TOKENS = 256
"""Tokens: the largest block vattn picks without a warning. vLLM's prefix
cache hits whole blocks only, so prompts that share fewer tokens than a
block share nothing; where no layout gives a block this small (a model
with few KV bytes per token on a large page granularity) the block vattn
picks is logged as a warning with the arithmetic."""


def fit_block_size(cache: Any, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                   page_granularity: int, layout: str | None) -> int:
    """vLLM's block size for vattn, set on ``cache`` (vLLM's cache config):
    one block must be one page of every buffer, a multiple of
    ``page_granularity`` bytes. A block size vLLM chose itself that is too
    small becomes the smallest multiple of it that fills the page in
    ``layout`` (or in whichever layout needs the smaller one: the rule is
    the smallest block, and ``all_layers``, whose page holds a block of
    every layer, needs ``num_layers`` times fewer tokens than
    ``per_layer``), and the change is logged, as a warning where the block
    passes ``PREFIX_BLOCK_TOKENS``; one the user chose is refused here, at
    start-up, naming the flag. Returns the block size.

    No layout gets under the smallest block of ``all_layers``: a page is
    one buffer's block, and a buffer holds K or V of every layer at most, so
    ``page_granularity / gcd(page_granularity, num_layers * num_kv_heads *
    head_dim * dtype_bytes)`` tokens is the floor (Qwen2-0.5B: 24 layers x 2
    KV heads x 64 x 2 bytes = 6144 bytes per token and buffer, 3 x 2 KiB,
    so 1024 tokens on CUDA's 2 MiB; 4 KiB pages of the host take 2)."""
    block = cache.block_size
    try:
        choose_layout(num_layers, num_kv_heads, head_dim, dtype_bytes, block, page_granularity, layout)
        return block
    except ValueError as refusal:
        if cache.user_specified_block_size:
            raise ValueError(f"{refusal}; pass one of them as --block-size (LLM(block_size=...)), or unset "
                             f"{SWITCH}") from None
    per_layer = num_kv_heads * head_dim * dtype_bytes
    token_bytes = {"per_layer": per_layer, "all_layers": per_layer * num_layers}
    fits = {name: math.lcm(block, block_placer.smallest_block_size(token_bytes[name], page_granularity))
            for name in ([layout] if layout else block_placer.LAYOUTS)}
    chosen = min(fits, key=lambda name: (fits[name], name != "per_layer"))
    logger = logging.getLogger("vllm.vattn")  # under vLLM's logger, so vLLM's handlers show it
    logger.info("vattn: block_size %d makes pages below the %d-byte granularity; using block_size %d (%s layout: "
                "one block is one %d-byte page of every K/V buffer). Pass --block-size to choose another multiple.",
                block, page_granularity, fits[chosen], chosen, fits[chosen] * token_bytes[chosen])
    if fits[chosen] > PREFIX_BLOCK_TOKENS:
        floor = math.lcm(block, block_placer.smallest_block_size(token_bytes["all_layers"], page_granularity))
        how = (f"{LAYOUT_SETTING}=all_layers makes them {floor}" if floor < fits[chosen] else
               f"no layout makes them smaller: an all_layers page holds {token_bytes['all_layers']} bytes per token "
               f"({num_layers} layers x {num_kv_heads} KV heads x {head_dim} x {dtype_bytes} bytes), and a whole "
               f"number of {page_granularity}-byte granules takes a multiple of {floor} tokens; a backend with a "
               f"smaller granularity makes smaller blocks")
        logger.warning("vattn: blocks of %d tokens: vLLM's prefix cache hits whole blocks only, so prompts sharing "
                       "fewer than %d tokens share no KV; %s.", fits[chosen], fits[chosen], how)
    cache.block_size = fits[chosen]
    return fits[chosen]


def page_bytes_setting() -> int | None:
    """``VATTN_VLLM_PAGE_BYTES``: bytes of a vattn page of one K/V buffer,
    holding several vLLM blocks (None: unset, one block is one page).
    Raises ValueError naming the setting unless it is a positive integer."""
    raw = os.environ.get(PAGE_BYTES_SETTING, "")
    if not raw:
        return None
    value = int(raw) if raw.isdigit() else 0
    if value <= 0:
        raise ValueError(f"{PAGE_BYTES_SETTING} must be a positive number of bytes, got {raw!r}")
    return value


def layout_setting() -> str | None:
    """``VATTN_VLLM_LAYOUT``: the layout of the K/V buffers (None: unset, the fitting one is chosen).
    Raises ValueError naming the setting unless it names a layout."""
    raw = os.environ.get(LAYOUT_SETTING) or None
    if raw is not None and raw not in block_placer.LAYOUTS:
        raise ValueError(f"{LAYOUT_SETTING} must be one of {block_placer.LAYOUTS}, got {raw!r}")
    return raw


@dataclasses.dataclass(frozen=True)
class PageGeometry:
    """How vLLM's blocks lie in vattn's pages."""

    layout: str  # the vattn layout
    page_size: int  # bytes of one page of one K/V buffer
    blocks_per_page: int  # vLLM blocks per page: 1 unless VATTN_VLLM_PAGE_BYTES asks for larger pages


def page_geometry(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, block_size: int,
                  page_granularity: int, layout: str | None, page_bytes: int | None) -> PageGeometry:
    """The layout and pages for vLLM's blocks of ``block_size`` tokens:
    one block per page (:func:`choose_layout`) without ``page_bytes``,
    else pages of ``page_bytes`` (a multiple of ``page_granularity``) that
    hold whole blocks, in ``layout`` or the first layout where they do
    (per_layer, then all_layers). Raises ValueError naming the setting and
    the block bytes of each layout otherwise."""
    if page_bytes is None:
        name, page = choose_layout(num_layers, num_kv_heads, head_dim, dtype_bytes, block_size, page_granularity,
                                   layout)
        return PageGeometry(name, page, 1)
    if layout is not None and layout not in block_placer.LAYOUTS:
        raise ValueError(f"{LAYOUT_SETTING} must be one of {block_placer.LAYOUTS}, got {layout!r}")
    if page_bytes % page_granularity:
        raise ValueError(f"{PAGE_BYTES_SETTING}={page_bytes} must be a multiple of the backend's "
                         f"{page_granularity}-byte granularity")
    per_layer = num_kv_heads * head_dim * dtype_bytes
    block_bytes = {"per_layer": block_size * per_layer, "all_layers": block_size * per_layer * num_layers}
    candidates = [layout] if layout else list(block_placer.LAYOUTS)
    for name in candidates:
        if page_bytes % block_bytes[name] == 0:
            return PageGeometry(name, page_bytes, page_bytes // block_bytes[name])
    raise ValueError(f"{PAGE_BYTES_SETTING}={page_bytes} must hold whole blocks of block_size={block_size}: "
                     + " or ".join(f"{block_bytes[n]}-byte blocks ({n})" for n in candidates))


def check_subpage_blocks(device: str, window: int | None, budget: str | None) -> None:
    """Raises ValueError naming what ``VATTN_VLLM_PAGE_BYTES`` (several
    blocks per page, :class:`vattn.integrations.block_placer.SubPageBlockPlacer`)
    cannot serve: a GPU (its FlashAttention kernel reads rows past a
    request's end, which that placer does not map), sliding windows, a
    memory budget (it charges pages per block id)."""
    refused = {"a GPU (vattn's host kernel only)": device != "cpu", "sliding-window models": bool(window),
               "a memory budget (VATTN_BUDGET)": bool(budget)}
    reasons = [name for name, present in refused.items() if present]
    if reasons:
        raise ValueError(f"vattn: {PAGE_BYTES_SETTING} (several vLLM blocks per page) does not serve "
                         f"{', '.join(reasons)}; unset {PAGE_BYTES_SETTING}")
