"""The primitives: :class:`KVCacheManager` (one virtual-memory KV cache, its
CUDA streams and graph capture), its :class:`Policy`, :class:`PrefixHandle`,
the mapping check a forward's plan carries, and which cache owns a tensor's
memory; docs/design.md section 1."""

from .manager import KVCacheManager, SeqLens
from .policy import Policy
from .prefix_handle import PrefixHandle

__all__ = ["KVCacheManager", "Policy", "PrefixHandle", "SeqLens"]
