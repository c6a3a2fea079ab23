"""The host kernel's P in bf16 (``p_bf16``): decode rows' P V by VDPBF16PS on
pairs of keys with the softmax weights rounded to bf16. On the AVX512_BF16
paths over a bf16 cache with bf16 queries it changes decode rows only, and
stays within bf16's tolerance of the float64 reference (odd tiles, tile
boundaries, head dims of 64 to 256, split keys); elsewhere it changes
nothing. VATTN_CPU_ATTN_P_BF16=1 makes it the default."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels.host_attention_cases import DenseCase, check, reference
from vattn.attention import AttentionBatch, host_attention, host_attention_info

SUPPORTED = host_attention_info()["supported"]
DOT_ISAS = [isa for isa in ("avx512_bf16", "amx") if isa in SUPPORTED]
needs_dot = pytest.mark.skipif(not DOT_ISAS, reason="needs AVX512_BF16: P V by VDPBF16PS runs on the "
                                                    "avx512_bf16 and amx paths only")


def decodes(lengths: list[int]) -> AttentionBatch:
    """One decode per length (cached tokens + the new one), reqids out of order."""
    return AttentionBatch(list(range(len(lengths)))[::-1], [n - 1 for n in lengths], [1] * len(lengths))


# tile boundaries (128 keys), odd tiles (a key without a pair), one key, long enough to split
LENGTHS = [1, 2, 3, 127, 128, 129, 255, 300, 1001, 2900]


@needs_dot
@pytest.mark.parametrize("isa", DOT_ISAS)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("heads_q,heads_kv", [(8, 2), (4, 4), (6, 2)])
def test_decode_with_bf16_weights_matches_the_reference(isa: str, head_dim: int, heads_q: int, heads_kv: int) -> None:
    batch = decodes(LENGTHS)
    case = DenseCase(batch, heads_q, heads_kv, head_dim, torch.bfloat16, max_len=max(LENGTHS), seed=head_dim)
    scale = head_dim ** -0.5
    ref = reference(case.q, case.keys, case.values, batch, scale)
    out, lse = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v, return_lse=True,
                              isa=isa, p_bf16=True)
    check(out, lse, ref, f"p_bf16 decode on {isa}, {heads_q}/{heads_kv} heads of {head_dim}")
    fp32_weights = host_attention(case.q, case.k_cache, case.v_cache, batch, isa=isa, p_bf16=False)
    assert not torch.equal(out, fp32_weights), "p_bf16 changed nothing: the bf16 P V did not run"


@needs_dot
def test_bf16_weights_keep_the_row_sums_of_the_fp32_weights() -> None:
    """Only P V's weights are rounded: the log-sum-exp is the fp32 path's,
    bit for bit, and the outputs differ by about what rounding the weights
    to 8 bits moves them."""
    batch = decodes([700, 64, 1500])
    case = DenseCase(batch, 8, 2, 128, torch.bfloat16, max_len=1500, seed=3)
    out, lse = host_attention(case.q, case.k_cache, case.v_cache, batch, return_lse=True, p_bf16=True)
    base, base_lse = host_attention(case.q, case.k_cache, case.v_cache, batch, return_lse=True, p_bf16=False)
    assert torch.equal(lse, base_lse)
    assert (out.float() - base.float()).abs().max().item() < 1e-2


def test_elsewhere_bf16_weights_change_nothing() -> None:
    """Prefill blocks, fp32 and fp16 caches, and the paths without
    VDPBF16PS give the same bits with p_bf16 as without."""
    prefill = AttentionBatch([1, 0], [40, 0], [24, 17])
    mixed = AttentionBatch([2, 0, 1], [300, 0, 129], [1, 20, 1])
    vector_paths = [isa for isa in ("avx512", "avx2", "neon", "sve256") if isa in SUPPORTED]
    for dtype, batch, isas in [(torch.bfloat16, prefill, [None]), (torch.float32, mixed, [None]),
                               (torch.float16, mixed, [None]), (torch.bfloat16, mixed, vector_paths + ["scalar"])]:
        case = DenseCase(batch, 8, 2, 64, dtype, max_len=400, seed=5)
        for isa in isas:
            with_p = host_attention(case.q, case.k_cache, case.v_cache, batch, isa=isa, p_bf16=True)
            without = host_attention(case.q, case.k_cache, case.v_cache, batch, isa=isa, p_bf16=False)
            assert torch.equal(with_p, without), (dtype, batch, isa)


@needs_dot
def test_a_mixed_batch_rounds_only_its_decode_rows() -> None:
    batch = AttentionBatch([2, 0, 1], [300, 0, 129], [1, 20, 1])
    case = DenseCase(batch, 8, 2, 64, torch.bfloat16, max_len=400, seed=6)
    with_p = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v, p_bf16=True)
    without = host_attention(case.q, case.k_cache, case.v_cache, batch, p_bf16=False)
    rows_changed = [i for i in range(batch.num_tokens) if not torch.equal(with_p[i], without[i])]
    assert rows_changed == [0, 21], rows_changed  # the two decodes' rows; the prompt's 20 rows are untouched
    check(with_p, None, reference(case.q, case.keys, case.values, batch, 64 ** -0.5), "mixed batch, p_bf16")


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False), ("", False)])
def test_the_environment_sets_the_default(value: str, expected: bool) -> None:
    env = dict(os.environ, VATTN_CPU_ATTN_P_BF16=value)
    out = subprocess.run([sys.executable, "-c", "from vattn.kernels import KERNELS; print(KERNELS['host'].p_bf16)"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(expected)
