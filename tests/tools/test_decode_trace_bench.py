"""The varlen kernels' view of the cache (vattn.kernels.cache_rows, which
benchmarks/decode_trace.py and vattn.kernels.TorchFlashKernel use): a
request's slot is whole pages, so it holds more than max_context_len rows, and request r starts at row r * (rows per slot),
not r * max_context_len (``k.view(-1, H, D)`` raised there). The GPU suite's
dry run (tests/tools/test_gpu_suite.py) runs decode_trace's model forward
end to end on the host."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vattn
from conftest import load_benchmark
from vattn.kernels import cache_rows

decode_trace = load_benchmark("decode_trace")
KV_HEADS, HEAD_DIM, ModelForward = decode_trace.KV_HEADS, decode_trace.HEAD_DIM, decode_trace.ModelForward

KiB = 1024


def decode_trace_cache(layout: str, layers: int = 2, batch: int = 3) -> vattn.KVCacheManager:
    # decode_trace's shape, 2063 tokens: 64.5 pages of 64 KiB per layer (a slot of 65 pages: 2080 rows) and
    # 128.9 pages for 2 layers (129 pages: 2064 rows)
    return vattn.KVCacheManager(num_layers=layers, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float16,
                                max_batch_size=batch, max_context_len=2063, page_size=64 * KiB,
                                layout=layout, policy={"background": False, "eager": False})


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_cache_rows_puts_every_request_at_its_slot(layout):
    with decode_trace_cache(layout) as kv:
        assert kv.slice_bytes != kv.config.max_context_len * kv.config.token_bytes_per_buffer
        for r in range(3):
            kv.alloc_reqid()
        assert kv.step([1500, 1200, 2063])
        k, _ = kv.layer(1)
        with pytest.raises(RuntimeError):
            k.view(-1, KV_HEADS, HEAD_DIM)  # what both benchmarks did
        for r, n in enumerate((1500, 1200, 2063)):
            k[r, :n] = torch.randn(n, KV_HEADS, HEAD_DIM).half()
        rows, per_slot = cache_rows(k)
        assert per_slot == kv.slice_bytes // kv.config.token_bytes_per_buffer > kv.config.max_context_len
        for r, n in enumerate((1500, 1200, 2063)):
            assert torch.equal(rows[r * per_slot:r * per_slot + n], k[r, :n])


def test_cache_rows_refuses_slots_of_partial_rows():
    # all_layers, 3 layers: 6 KiB per token, and 64 KiB pages end inside a token's row
    with vattn.KVCacheManager(num_layers=3, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_batch_size=2,
                              max_context_len=100, page_size=64 * KiB, layout="all_layers",
                              policy={"background": False, "eager": False}) as kv:
        with pytest.raises(ValueError, match="whole number"):
            cache_rows(kv.layer(0)[0])


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_the_model_forward_reads_each_request_at_its_slot(layout):
    lens = [1500, 1200, 2063]
    with decode_trace_cache(layout) as kv:
        for _ in lens:
            kv.alloc_reqid()
        assert kv.step(lens)
        for i in range(kv.config.num_layers):
            for cache in kv.layer(i):
                for r, n in enumerate(lens):
                    cache[r, :n] = torch.randn(n, KV_HEADS, HEAD_DIM).half()
        fwd = ModelForward(kv, len(lens), torch.float16, hidden=64)
        fwd.lens.copy_(torch.tensor(lens, dtype=torch.int32))
        fwd()
        k, v = kv.layer(kv.config.num_layers - 1)
        for r, n in enumerate(lens):  # one query at the last position sees every key
            q = fwd.q[r][None, :, None].float()
            ref = F.scaled_dot_product_attention(q, k[r, :n].transpose(0, 1)[None].float(),
                                                 v[r, :n].transpose(0, 1)[None].float(), enable_gqa=True)
            torch.testing.assert_close(fwd.attention[r].float(), ref[0, :, 0], rtol=2e-3, atol=2e-3)
