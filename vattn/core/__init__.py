"""The primitives: :class:`KVCacheManager` (one virtual-memory KV cache, its
CUDA streams and graph capture), :class:`PrefixHandle`, and which manager owns
a tensor's memory; docs/design.md section 1."""

from .manager import KVCacheManager, SeqLens
from .prefix_handle import PrefixHandle

__all__ = ["KVCacheManager", "PrefixHandle", "SeqLens"]
