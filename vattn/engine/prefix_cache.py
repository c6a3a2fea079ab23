"""The engine's prefix cache: whole-page token prefixes kept alive with
vattn prefix handles, found again by a chain hash of page-sized token blocks."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection, Sequence

from vattn.core import KVCacheManager, PrefixHandle

__all__ = ["PrefixCache"]


class PrefixCache:
    """Whole-page token prefixes held by vattn prefix handles.

    Keys are chain hashes of page-sized token blocks (block i's key covers
    blocks 0..i), so a lookup finds the longest cached prefix of any token
    sequence. Each entry records its tokens, checked on a hit (a hash
    collision can only cost a miss), and its page ids, so that eviction can
    tell the entries whose release returns pages to the pool from those whose
    pages running requests map anyway. Least recently used entries go first.
    """

    def __init__(self, page_tokens: int) -> None:
        self.page_tokens = page_tokens  # tokens per page
        self.index: dict[int, PrefixHandle] = {}  # chain key of blocks 0..i -> the entry holding them
        self.entries: collections.OrderedDict[PrefixHandle, _Entry] = collections.OrderedDict()  # LRU first
        self.queries = self.query_tokens = self.hit_tokens = 0
        self.evictions = 0

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
            held = self.entries[handle].tokens
            if list(tokens[:pages * self.page_tokens]) != held[:pages * self.page_tokens]:
                continue  # a hash collision
            self.entries.move_to_end(handle)
            self.hit_tokens += pages * self.page_tokens
            return handle, pages
        return None, 0

    def page_ids(self, handle: PrefixHandle) -> list[int]:
        """The page ids of a cached entry, position 0 first."""
        return self.entries[handle].page_ids

    def insert(self, kv: KVCacheManager, reqid: int, tokens: Sequence[int]) -> None:
        """Keeps the whole pages of reqid's first ``len(tokens)`` tokens (computed).

        Entries whose every key the new one takes over (a shorter prefix of
        the same tokens) can no longer be found and are released."""
        pages = len(tokens) // self.page_tokens
        if pages == 0:
            return
        keys = self.keys(tokens[:pages * self.page_tokens])
        known = self.index.get(keys[-1])
        if known is not None:
            self.entries.move_to_end(known)
            return
        handle = kv.retain_prefix(reqid, pages * self.page_tokens)
        try:
            page_ids = handle.page_ids
        except BaseException:
            handle.release()
            raise
        superseded = {self.index[key] for key in keys if key in self.index}
        self.entries[handle] = _Entry(keys, list(tokens[:pages * self.page_tokens]), page_ids)
        for key in keys:
            self.index[key] = handle
        for old in superseded:
            if all(self.index.get(key) is not old for key in self.entries[old].keys):
                self._release(old)

    def evict(self, mapped: Collection[int] = (), spare: Collection[PrefixHandle] = ()) -> bool:
        """Releases the least recently used entry (not in ``spare``) holding a
        page that no id in ``mapped`` (the pages running requests map) names;
        among those, one whose release returns a page to the pool (no other
        entry holds it) goes first. False when there is none: releasing an
        entry whose pages are all mapped frees nothing."""
        candidates = [handle for handle, entry in self.entries.items()
                      if handle not in spare and any(page not in mapped for page in entry.page_ids)]
        if not candidates:
            return False
        holds = collections.Counter(page for entry in self.entries.values() for page in entry.page_ids)
        victim = next((handle for handle in candidates
                       if any(holds[page] == 1 and page not in mapped for page in self.entries[handle].page_ids)),
                      candidates[0])
        self._release(victim)
        self.evictions += 1
        return True

    def clear(self) -> None:
        """Releases every entry."""
        while self.entries:
            self._release(next(iter(self.entries)))

    def _release(self, handle: PrefixHandle) -> None:
        entry = self.entries.pop(handle)
        for key in entry.keys:
            if self.index.get(key) is handle:
                del self.index[key]
        handle.release()


@dataclasses.dataclass
class _Entry:
    keys: list[int]  # chain keys of blocks 0 .. pages - 1
    tokens: list[int]  # the tokens the pages hold (pages x page_tokens)
    page_ids: list[int]  # the pages, position 0 first
