"""map_pages in managed mode with ids that are already mapped: a page kept and
moved to another position of its request, pages swapped between two requests.
The new references are taken before the old positions are cut, so a moved
page never passes through the free pool while it is mapped (a later step would
hand it to another request, whose writes would overwrite these rows). And page
ids no uint32 holds are refused with the range map_pages accepts.
"""

from __future__ import annotations

import pytest
import torch

import vattn
from conftest import assert_invariants

PAGE = 4096
B, L = 4, 128
TOKENS_PER_PAGE = 32  # fp32, 2 KV heads x 16: 128 bytes a token in each buffer


def make(background: bool = False) -> vattn.KVCacheManager:
    return vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                                max_batch_size=B, max_context_len=L, page_size=PAGE, policy={"background": background})


def grow(kv: vattn.KVCacheManager, reqid: int, tokens: int) -> None:
    lens = [0] * B
    lens[reqid] = tokens
    assert kv.step(lens)
    kv.wait_idle()


def stamp(kv: vattn.KVCacheManager, reqid: int, values: torch.Tensor) -> None:
    """Rows 0.. of reqid in every K and V buffer get ``values`` (one per row)."""
    for layer in range(2):
        k, v = kv.layer(layer)
        k[reqid, : len(values)] = values.view(-1, 1, 1) + layer
        v[reqid, : len(values)] = -values.view(-1, 1, 1) - layer


def rows(kv: vattn.KVCacheManager, reqid: int, count: int) -> list[torch.Tensor]:
    return [t[reqid, :count].clone() for layer in range(2) for t in kv.layer(layer)]


def request(kv: vattn.KVCacheManager, pages: int, base: float) -> tuple[int, torch.Tensor]:
    reqid = kv.alloc_reqid()
    kv.unmap_pages([reqid], [0])  # a reused reqid may bring pages kept for reuse
    grow(kv, reqid, pages * TOKENS_PER_PAGE)
    values = base + torch.arange(pages * TOKENS_PER_PAGE, dtype=torch.float32)
    stamp(kv, reqid, values)
    return reqid, values


def page_rows(values: torch.Tensor, page: int) -> torch.Tensor:
    return values[page * TOKENS_PER_PAGE: (page + 1) * TOKENS_PER_PAGE]


def assert_reads(kv: vattn.KVCacheManager, reqid: int, values: torch.Tensor) -> None:
    n = len(values)
    for layer in range(2):
        k, v = kv.layer(layer)
        assert torch.equal(k[reqid, :n], (values.view(-1, 1, 1) + layer).expand(-1, *k.shape[2:]))
        assert torch.equal(v[reqid, :n], (-values.view(-1, 1, 1) - layer).expand(-1, *v.shape[2:]))


def new_request_takes_none_of(kv: vattn.KVCacheManager, kept: set[int]) -> None:
    """The next steps hand fresh pages to a new request; none may be a kept one."""
    c, _ = request(kv, 3, base=9000.0)
    assert not kept & set(kv.page_ids(c)), f"page(s) {kept & set(kv.page_ids(c))} mapped twice"
    assert_invariants(kv)


@pytest.mark.parametrize("background", [False, True], ids=["mapper-off", "mapper-on"])
def test_a_page_kept_and_moved_within_its_request(background):
    with make(background) as kv:
        a, values = request(kv, 2, base=1000.0)
        x, y = kv.page_ids(a)[:2]  # the mapper may have mapped a third ahead
        kv.map_pages([a], [0], [[y]])  # keep y, at position 0 now; x (and the rest) go
        assert kv.page_ids(a) == [y]
        assert_invariants(kv)
        if not background:
            assert kv.stats()["pages_in_use"] == 4  # y in each of the 4 buffers
        new_request_takes_none_of(kv, {y})
        assert_reads(kv, a, page_rows(values, 1))  # y's rows, unharmed by the new request's writes


@pytest.mark.parametrize("background", [False, True], ids=["mapper-off", "mapper-on"])
def test_pages_swapped_between_two_requests(background):
    with make(background) as kv:
        a, a_values = request(kv, 2, base=1000.0)
        b, b_values = request(kv, 2, base=5000.0)
        a_ids, b_ids = kv.page_ids(a), kv.page_ids(b)
        kv.map_pages([a, b], [0, 0], [b_ids, a_ids])
        kv.wait_idle()
        assert (kv.page_ids(a), kv.page_ids(b)) == (b_ids, a_ids)
        assert_invariants(kv)
        new_request_takes_none_of(kv, set(a_ids) | set(b_ids))
        assert_reads(kv, a, b_values)
        assert_reads(kv, b, a_values)


def test_pages_reordered_within_a_request_and_one_moved_in_from_another():
    with make() as kv:
        a, a_values = request(kv, 3, base=1000.0)
        b, b_values = request(kv, 1, base=5000.0)
        x, y, z = kv.page_ids(a)
        (w,) = kv.page_ids(b)
        kv.map_pages([a, b], [1, 0], [[z, y], [x]])  # a: x z y (swap), b: x (w goes)
        assert (kv.page_ids(a), kv.page_ids(b)) == ([x, z, y], [x])
        assert_invariants(kv)
        new_request_takes_none_of(kv, {x, y, z})
        assert_reads(kv, a, torch.cat([page_rows(a_values, 0), page_rows(a_values, 2), page_rows(a_values, 1)]))
        assert_reads(kv, b, page_rows(a_values, 0))
        kv.unmap_pages([a], [0])  # x stays with b
        assert_invariants(kv)
        assert_reads(kv, b, page_rows(a_values, 0))


@pytest.mark.parametrize("page_id", [2**32 - 1, 2**32, 2**40, -1])
def test_page_ids_no_uint32_holds_name_the_accepted_range(page_id):
    with make() as kv:
        a, _ = request(kv, 1, base=1.0)
        b = kv.alloc_reqid()
        before = (kv.page_ids(a), kv.page_ids(b), kv.stats()["pages_in_use"])
        n = kv.num_page_ids
        with pytest.raises(ValueError, match=r"map_pages: page_ids\[0\] must be in \[0, %d\] \(num_page_ids\), got %d"
                                             % (n - 1, page_id)):
            kv.map_pages([b], [0], [[page_id]])
        assert (kv.page_ids(a), kv.page_ids(b), kv.stats()["pages_in_use"]) == before
        assert_invariants(kv)
