"""The engine's prefix cache: whole-page token prefixes kept alive with
vattn prefix handles, found again by a chain hash of page-sized token blocks."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from vattn import KVCacheManager, PrefixHandle

__all__ = ["PrefixCache"]


class PrefixCache:
    """Whole-page token prefixes held by vattn prefix handles.

    Keys are chain hashes of page-sized token blocks (block i's key covers
    blocks 0..i), so a lookup finds the longest cached prefix of any token
    sequence. Each handle records its tokens and is checked on a hit, so a
    hash collision can only cost a miss. Least recently used handles go first.
    """

    def __init__(self, page_tokens: int) -> None:
        self.page_tokens = page_tokens  # tokens per page
        self.index: dict[int, PrefixHandle] = {}
        self.entries: collections.OrderedDict[PrefixHandle, tuple[list[int], list[int]]] = collections.OrderedDict()
        self.queries = self.query_tokens = self.hit_tokens = 0

    def keys(self, tokens: Sequence[int]) -> list[int]:
        keys, key = [], 0
        for start in range(0, len(tokens) - self.page_tokens + 1, self.page_tokens):
            key = hash((key, tuple(tokens[start:start + self.page_tokens])))
            keys.append(key)
        return keys

    def lookup(self, tokens: Sequence[int]) -> tuple[PrefixHandle | None, int]:
        """The cached handle and number of pages matching the longest whole-page
        prefix of ``tokens[:-1]`` (the last token is always computed again, for
        its logits)."""
        self.queries += 1
        self.query_tokens += len(tokens)
        keys = self.keys(tokens[:-1])
        for pages in range(len(keys), 0, -1):
            handle = self.index.get(keys[pages - 1])
            if handle is None:
                continue
            held = self.entries[handle][1]
            if list(tokens[:pages * self.page_tokens]) != held[:pages * self.page_tokens]:
                continue  # a hash collision
            self.entries.move_to_end(handle)
            self.hit_tokens += pages * self.page_tokens
            return handle, pages
        return None, 0

    def insert(self, kv: KVCacheManager, reqid: int, tokens: Sequence[int]) -> None:
        """Keeps the whole pages of reqid's first ``len(tokens)`` tokens (computed)."""
        pages = len(tokens) // self.page_tokens
        if pages == 0:
            return
        keys = self.keys(tokens[:pages * self.page_tokens])
        known = self.index.get(keys[-1])
        if known is not None:
            self.entries.move_to_end(known)
            return
        handle = kv.retain_prefix(reqid, pages * self.page_tokens)
        self.entries[handle] = (keys, list(tokens[:pages * self.page_tokens]))
        for key in keys:
            self.index[key] = handle

    def evict(self) -> bool:
        """Releases the least recently used entry; False when there is none."""
        if not self.entries:
            return False
        handle, (keys, _) = self.entries.popitem(last=False)
        for key in keys:
            if self.index.get(key) is handle:
                del self.index[key]
        handle.release()
        return True

    def clear(self) -> None:
        while self.evict():
            pass
