"""Helpers of the engine's failure tests: a tiny random Llama, the reference
(each prompt generated alone with transformers), and faults injected into the
KV cache's host backend (engines made with ``backend=FAULTY_HOST`` and the
``host_faults`` fixture's plan, tests/host_faults.py)."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Iterator
from typing import Any

import torch

import vattn
from host_faults import FAULTY_HOST  # noqa: F401 - the backend name the tests' engines use

VOCAB = 96
PAGE = 4096  # bytes: 32 tokens of one layer's K (2 KV heads x 16 x fp32)
# Calls of the fault-injecting host backend, each with an errno it fails with:
# creating pages (fallocate), a map or unmap run, and the mmap of an unmap
# (EINVAL: ENOMEM there takes the munmap fallback and succeeds).
HOST_FAULTS = {"create_pages": errno.ENOSPC, "map": errno.ENOMEM, "unmap": errno.EINVAL, "mmap_unmap": errno.EINVAL}


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """The tiny model's matrices are too small to split across threads, and
    on a loaded machine idle intra-op threads cost several times the work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_llama() -> Any:
    """3 layers, 2 KV heads of 16, fp32, random weights (seeded), no EOS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def alone(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy generation of one request with transformers and DynamicCache."""
    from transformers import DynamicCache

    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         past_key_values=DynamicCache(config=model.config))
    return out[0, len(prompt):].tolist()


def prompts(n: int, seed: int, low: int = 3, high: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(2, VOCAB, (m,), generator=g).tolist() for m in lengths]


class FailingCalls:
    """Makes ``kv.<method>`` fail inside: before each of its next ``times``
    calls one fault is armed in ``plan`` (the host backend's) on ``call``
    (cleared when the method returns), so the method meets the error
    part-way, as it would from the OS. ``raised`` counts the calls that ended
    in DriverError."""

    def __init__(self, kv: vattn.KVCacheManager, method: str, plan: Any, call: str, times: int = 1,
                 skip: int = 0) -> None:
        self.kv, self.method, self.original, self.plan = kv, method, getattr(kv, method), plan
        self.left, self.call, self.skip = times, call, skip
        self.err = HOST_FAULTS[call]
        self.raised = 0
        setattr(kv, method, self._wrapped)

    def _wrapped(self, *args: Any, **kwargs: Any) -> Any:
        if self.left <= 0:
            return self.original(*args, **kwargs)
        self.left -= 1
        self.plan.fail(self.call, self.skip, 1, self.err)
        try:
            return self.original(*args, **kwargs)
        except vattn.DriverError:
            self.raised += 1
            raise
        finally:
            self.plan.clear()

    def restore(self) -> None:
        setattr(self.kv, self.method, self.original)


def run_until_done(engine: Any, max_iterations: int = 500,
                   each: Callable[[Any], None] | None = None) -> dict[tuple[int, int], Any]:
    """Steps until nothing is unfinished (at most ``max_iterations``); the
    outputs by (request_id, sample_index). No output may come twice."""
    outs: dict[tuple[int, int], Any] = {}
    for _ in range(max_iterations):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            key = (out.request_id, out.sample_index)
            assert key not in outs, f"request {key} finished twice"
            outs[key] = out
        if each is not None:
            each(engine)
    return outs
