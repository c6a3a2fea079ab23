"""The scheduler and the prefix cache on a tiny pool, without a model: which
cached prefixes are released, who is sent back and what counts as a
preemption, checked exactly (ids, orders, counts)."""

from __future__ import annotations

import pytest
import torch

import vattn

pytest.importorskip("transformers", reason="needs transformers: pip install -e \".[transformers]\"")

from conftest import assert_invariants  # noqa: E402

from vattn.engine.prefix_cache import PrefixCache  # noqa: E402
from vattn.engine.requests import Request  # noqa: E402
from vattn.engine.scheduler import Scheduler  # noqa: E402

PAGE_TOKENS = 32  # 4 KiB pages of 128-byte tokens (1 KV head x 32 x fp32)


def make(pool_ids: int) -> tuple[vattn.KVCacheManager, Scheduler]:
    kv = vattn.KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=32, dtype=torch.float32, max_batch_size=4,
                              max_context_len=128, page_size=4096, physical_memory=pool_ids * 2 * 4096,
                              policy={"background": False, "eager": False})
    return kv, Scheduler(kv, PrefixCache(PAGE_TOKENS), prefill_chunk_size=None)


def request(rid: int, prompt: list[int], max_new_tokens: int = 100) -> Request:
    return Request(rid, prompt, max_new_tokens, 0.0, 1.0, None, 0.0)


def iterate(sched: Scheduler) -> list[Request]:
    """One iteration as the engine commits it (the model's token is always 7);
    returns the batch's requests."""
    batch = sched.schedule([])
    for req, n in batch:
        req.num_computed += n
        if req.num_computed == req.num_tokens:
            if not req.output:
                sched.computed(req)
            req.output.append(7)
    return [req for req, _ in batch]


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_a_newcomer_sent_back_is_not_preempted():
    """A request admitted with a cached prefix that does not fit this iteration
    goes back to the queue; it had computed nothing, so it is not a preemption
    (it used to count as one: its computed count came from the cache), and the
    prefix it attached is released only after it left, for a running request."""
    kv, sched = make(pool_ids=3)
    prompt = tokens(100, 32)
    sched.waiting.append(request(0, prompt + [1], max_new_tokens=1))
    iterate(sched)  # request 0's prompt: one whole page, cached
    sched.retire(sched.running[0])
    entry = next(iter(sched.prefix_cache.entries))
    r1 = request(1, tokens(200, 63))
    sched.waiting.append(r1)
    iterate(sched)
    iterate(sched)  # r1: 64 tokens, two pages, the pool's last two
    newcomer = request(2, prompt + [2])
    sched.waiting.append(newcomer)
    batch = iterate(sched)  # r1 needs a third page; the newcomer one more too
    assert batch == [r1]
    assert list(sched.waiting) == [newcomer] and newcomer.reqid == -1 and newcomer.num_computed == 0
    assert sched.preemptions == 0 and newcomer.preemptions == 0
    assert entry not in sched.prefix_cache.entries  # released for r1, once the newcomer was gone
    assert sched.prefix_cache.evictions == 1
    assert_invariants(kv)
    kv.cleanup()


def test_prefixes_that_free_nothing_stay_cached():
    """On a failed step, an entry whose pages a running request maps is kept
    (releasing it frees nothing; it used to be released first, being least
    recently used); an entry whose pages nobody maps is released; with none
    of those left, the most recently admitted request is preempted and the
    mapped entry still stays."""
    kv, sched = make(pool_ids=5)
    r1 = request(1, tokens(100, 63))
    sched.waiting.append(r1)
    iterate(sched)  # r1: 2 pages; its prompt's whole page cached (e1, mapped by r1)
    (e1,) = sched.prefix_cache.entries
    done = request(2, tokens(300, 32), max_new_tokens=1)
    sched.waiting.append(done)
    iterate(sched)
    sched.retire(done)  # e2: 1 page that no request maps
    (e2,) = (e for e in sched.prefix_cache.entries if e is not e1)
    r3 = request(3, tokens(400, 31))
    sched.waiting.append(r3)
    while sched.prefix_cache.evictions == 0:  # r1 and r3 grow until the pool (5 pages) is short
        assert iterate(sched) == [r1, r3]
    assert list(sched.prefix_cache.entries) == [e1] and sched.preemptions == 0  # e1 was the LRU one
    while sched.preemptions == 0:
        batch = iterate(sched)
    assert batch == [r1] and r3.preemptions == 1 and list(sched.waiting) == [r3]  # r3: admitted last
    assert list(sched.prefix_cache.entries) == [e1] and sched.prefix_cache.evictions == 1
    assert_invariants(kv)
    kv.cleanup()


def test_a_longer_prefix_replaces_the_entries_it_covers():
    """An entry whose every key a longer entry of the same tokens takes over
    can no longer be found: it is released at once instead of holding pages
    until it is least recently used."""
    kv, sched = make(pool_ids=8)
    prompt = tokens(100, 40)
    r = request(1, prompt, max_new_tokens=40)
    sched.waiting.append(r)
    iterate(sched)  # the prompt: one whole page cached
    first = next(iter(sched.prefix_cache.entries))
    for _ in range(39):
        iterate(sched)
    sched.retire(r)  # 79 computed tokens: two whole pages, the first one the same
    assert first not in sched.prefix_cache.entries and first.released
    (entry,) = sched.prefix_cache.entries
    assert entry.num_tokens == 64
    assert sched.prefix_cache.lookup(prompt + [7] * 30) == (entry, 2)
    assert_invariants(kv)
    kv.cleanup()
