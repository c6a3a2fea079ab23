"""The kernel protocol's limits and the one selection rule: which kernel a
case gets, why a kernel refuses one, and that the host kernel's limits are
the extension's own."""

from __future__ import annotations

import gc
import importlib.util
import sys
import weakref

import pytest
import torch

import vattn
from vattn import _cpu_attn
from vattn.attention import AttentionBatch, attention, host_attention, sdpa_attention
from vattn.integrations.vllm import check_kernel
from vattn.kernels import KERNELS, AttentionCase, NoKernel, select_kernel

HOST, SDPA, FLASH_ATTN, FLASHINFER = (KERNELS[k] for k in ("host", "sdpa", "flash_attn", "flashinfer"))


def test_cpu_cases_get_the_host_kernel_and_sdpa_past_its_limits():
    assert select_kernel(AttentionCase("cpu", 128, torch.bfloat16, torch.bfloat16, 32, 8, 4096)) is HOST
    assert select_kernel(AttentionCase("cpu", 80, sliding_window=512, logits_soft_cap=30.0)) is HOST
    wide = AttentionCase("cpu", 2048)
    assert select_kernel(wide) is SDPA  # a loop over requests still serves it
    with pytest.raises(NoKernel, match=r"^head_dim=2048 is not supported by vattn's host kernel "
                                       r"\(head_dim must be in \[1, 1024\]\)$"):
        select_kernel(wide, batched=True)  # what a serving framework asks for
    with pytest.raises(ValueError, match=r"vattn's host kernel takes float32, bfloat16, float16 tensors, not int8.*"
                                         r"torch SDPA takes .* not int8"):
        select_kernel(AttentionCase("cpu", 64, torch.int8))


def test_cuda_cases_get_flash_attention_where_it_serves_them():
    fa = AttentionCase("cuda", 128, torch.float16)
    assert select_kernel(fa, installed=False) is FLASH_ATTN
    assert select_kernel(AttentionCase("cuda", 36), installed=False) is SDPA  # FA: head_dim % 8
    with pytest.raises(NoKernel, match=r"FlashAttention-2 has no sliding windows \(sliding_window=4096.*; "
                                       r"torch SDPA has no sliding windows"):
        select_kernel(AttentionCase("cuda", 128, sliding_window=4096), installed=False)
    with pytest.raises(NoKernel, match=r"FlashAttention-2 takes float16, bfloat16 tensors, not float32"):
        select_kernel(AttentionCase("cuda", 128, torch.float32), batched=True, installed=False)
    if importlib.util.find_spec("flash_attn") is None:  # not installed here: torch's own FlashAttention-2
        assert not FLASH_ATTN.available() and "flash-attn" in FLASH_ATTN.available().reason
        assert select_kernel(fa) is KERNELS["torch_flash"]
    else:
        assert select_kernel(fa) is FLASH_ATTN


def test_the_vllm_check_is_the_same_rule():
    """check_kernel (vLLM's start-up check) is select_kernel for batched kernels."""
    for device, head_dim in (("cpu", 80), ("cuda", 128)):
        case = AttentionCase(device, head_dim)
        assert check_kernel(head_dim, device) == select_kernel(case, batched=True, installed=False).name
    with pytest.raises(ValueError, match=r"^vattn: head_dim=36 is not supported by FlashAttention-2 .*; unset "
                                         r"VATTN_VLLM for this model$"):
        check_kernel(36, "cuda")


def test_kernels_named_by_key():
    case = AttentionCase("cuda", 128, torch.bfloat16)
    assert select_kernel(case, prefer="flashinfer", installed=False) is FLASHINFER
    with pytest.raises(NoKernel, match="FlashInfer runs on CUDA tensors, not CPU ones"):
        select_kernel(case._replace(device_type="cpu"), prefer="flashinfer", installed=False)
    with pytest.raises(ValueError, match=r"prefer must be one of \['flash_attn', 'flashinfer', "):
        select_kernel(case, prefer="xformers")
    with pytest.raises(NoKernel, match="no batched attention kernel runs on MPS tensors"):
        select_kernel(case._replace(device_type="mps"), batched=True)


def test_host_limits_are_the_extensions():
    """The Python side states no limit of its own: what supports() accepts is
    what the C++ call accepts, at the edge."""
    top = _cpu_attn.MAX_HEAD_DIM
    assert HOST.head_dim_max == top and HOST.dtypes == tuple(getattr(torch, n) for n in _cpu_attn.DTYPES)
    assert HOST.supports(AttentionCase("cpu", top)) and not HOST.supports(AttentionCase("cpu", top + 1))
    for head_dim in (top, top + 1):
        batch = AttentionBatch([0], [0], [2])
        q, cache = torch.randn(2, 1, head_dim), torch.zeros(1, 2, 1, head_dim)
        if head_dim <= top:
            torch.testing.assert_close(host_attention(q, cache, cache.clone(), batch),
                                       sdpa_attention(q, cache, cache.clone(), batch))
        else:
            with pytest.raises(ValueError, match=rf"head_dim must be in \[1, {top}\], got {top + 1}"):
                host_attention(q, cache, cache.clone(), batch)


def test_attention_falls_back_to_sdpa_past_the_host_kernels_head_dim():
    torch.manual_seed(0)
    batch = AttentionBatch([1, 0], [3, 0], [1, 2])
    head_dim = HOST.head_dim_max + 16
    k_cache, v_cache = torch.randn(2, 4, 1, head_dim), torch.randn(2, 4, 1, head_dim)
    q = torch.randn(batch.num_tokens, 2, head_dim)
    torch.testing.assert_close(attention(q, k_cache, v_cache, batch), sdpa_attention(q, k_cache, v_cache, batch))


def test_a_batch_is_planned_once_and_its_plans_go_with_it():
    batch = AttentionBatch([0, 2], [5, 0], [1, 3])
    plan = batch.plan(HOST)
    assert batch.plan(HOST) is plan and plan.batch == batch
    assert plan.native.num_tokens == 4 and plan.native.num_requests == 2
    other = AttentionBatch([1], [0], [1])
    assert other.plan(HOST) is not plan and batch.plan(HOST) is plan  # kept per batch, not only the last
    assert batch.plan(SDPA) is not plan  # one per kernel
    gone = weakref.ref(batch)
    del batch  # the plans do not keep their batch alive: it goes when its caller drops it
    gc.collect()
    assert gone() is None


def test_the_function_api_runs_the_kernel_on_the_plan_its_batch_keeps(monkeypatch):
    """attention() is one run of the selected kernel on the batch's plan: the
    plan is made by the first layer and reused by the others."""
    batch = AttentionBatch([0], [3], [1])
    made = []
    monkeypatch.setattr(HOST, "plan", lambda b, case=None, plan=HOST.plan: made.append(b) or plan(b, case))
    k_cache = torch.randn(1, 8, 1, 32)
    v_cache = torch.randn(1, 8, 1, 32)
    for _ in range(3):  # three layers
        attention(torch.randn(1, 2, 32), k_cache, v_cache, batch)
    assert made == [batch]


def test_plans_belong_to_their_kernel():
    batch = AttentionBatch([0], [0], [1])
    q = torch.randn(1, 2, 16)
    with pytest.raises(TypeError, match="plan must be the host kernel's plan"):
        HOST.run(SDPA.plan(batch), q, torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 2, 16))
    with pytest.raises(ValueError, match="FlashInfer plans with the case's num_q_heads, num_kv_heads, "
                                         "max_context_len, dtype"):
        FLASHINFER.plan(batch, AttentionCase("cuda", 16))
    with pytest.raises(ValueError, match=r"torch SDPA has no logit soft-capping \(sliding_window=None, "
                                         r"logits_soft_cap=30.0\)"):
        SDPA.run(SDPA.plan(batch), q, torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 2, 16), logits_soft_cap=30.0)


def test_gpu_kernels_name_the_devices_they_were_given(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", type(sys)("flash_attn"))  # installed or not: the check comes next
    batch = AttentionBatch([0], [0], [1])
    q, cache = torch.zeros(1, 2, 16, dtype=torch.float16), torch.zeros(1, 2, 2, 16, dtype=torch.float16)
    case = AttentionCase.of(q, cache)
    assert case == AttentionCase("cpu", 16, torch.float16, torch.float16, 2, 2, 2, slice_stride=64, row_stride=32)
    with pytest.raises(vattn.BackendUnavailable, match="FlashInfer plans on a CUDA device, got a batch on cpu"):
        FLASHINFER.plan(batch, case)
    with pytest.raises(vattn.BackendUnavailable, match="needs CUDA tensors, got q on cpu and k_cache on cpu"):
        FLASH_ATTN.run(FLASH_ATTN.plan(batch), q, cache, cache)
