"""One validated description of a KV cache: shapes, units and derived sizes."""

from __future__ import annotations

import dataclasses

import torch

LAYOUTS = ("per_layer", "all_layers")

# dtypes a KV cache may hold; the core stores bytes, so any fixed-width dtype works.
SUPPORTED_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return value


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """Shapes of one KV cache. Sizes are in tokens unless the name says bytes.

    The page size and physical budget are resolved against the backend by the
    manager; this class checks what can be checked without one.
    """

    num_layers: int  # transformer layers held by this cache (N)
    num_kv_heads: int  # KV heads on this worker, after tensor-parallel split (H)
    head_dim: int  # elements per head (D)
    dtype: torch.dtype  # element type; element_size() bytes each (P)
    max_batch_size: int  # reqids 0 .. B-1 (B)
    max_context_len: int  # tokens per request at most (L)
    layout: str = "per_layer"  # "per_layer": 2N buffers [B, L, H, D]; "all_layers": 2 of [B, L, N, H, D]

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_batch_size", "max_context_len"):
            _positive_int(name, getattr(self, name))
        if self.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
            raise ValueError(f"dtype must be one of {names}; got {self.dtype}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def element_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def num_buffers(self) -> int:
        """K and V buffers: 2 per layer (per_layer) or 2 in all (all_layers)."""
        return 2 * self.num_layers if self.layout == "per_layer" else 2

    @property
    def token_bytes_per_buffer(self) -> int:
        """Bytes one token takes in one buffer (S_tok; times N for all_layers)."""
        per_layer = self.num_kv_heads * self.head_dim * self.element_bytes
        return per_layer if self.layout == "per_layer" else per_layer * self.num_layers

    @property
    def token_bytes(self) -> int:
        """Bytes one token takes in the whole cache (K and V of every layer)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_bytes

    def pages_for(self, tokens: int, page_size: int) -> int:
        """Pages one buffer maps for a request of ``tokens`` tokens."""
        return -(-tokens * self.token_bytes_per_buffer // page_size)

    def reservation_bytes(self, page_size: int) -> int:
        """Virtual bytes the cache reserves: every buffer's slice of every reqid."""
        return self.num_buffers * self.max_batch_size * self.slice_bytes(page_size)

    def slice_bytes(self, page_size: int) -> int:
        """Bytes of one reqid's slice of one buffer (S_req), a multiple of page_size."""
        return round_up(self.max_context_len * self.token_bytes_per_buffer, page_size)

    def static_bytes(self) -> int:
        """What a static max-length reservation (every reqid at L tokens) needs."""
        return self.max_batch_size * self.max_context_len * self.token_bytes
