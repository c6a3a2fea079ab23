"""Attention on the vattn cache, one function per kernel: the public names of
:mod:`vattn.kernels.functions` (where they are documented), kept at the path
users import them from."""

from vattn.kernels.functions import (
    AttentionBatch,
    FlashInferAttention,
    attention,
    flash_attn_attention,
    flashinfer_single_prefill,
    host_attention,
    host_attention_info,
    sdpa_attention,
    sdpa_dense,
    write_kv,
)

__all__ = [
    "AttentionBatch",
    "write_kv",
    "attention",
    "host_attention",
    "host_attention_info",
    "sdpa_attention",
    "sdpa_dense",
    "flash_attn_attention",
    "flashinfer_single_prefill",
    "FlashInferAttention",
]
