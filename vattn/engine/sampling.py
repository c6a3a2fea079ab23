"""Choosing the next token from a row of logits: greedy, or temperature and
top-p with a seeded generator per completion (reproducible)."""

from __future__ import annotations

import torch

__all__ = ["generators", "sample"]


def generators(n: int, seed: int | None, temperature: float,
               device: torch.device) -> list[torch.Generator | None]:
    """One generator per completion (completion ``j`` seeded ``seed + j``; a
    random base without a seed); None each when greedy (``temperature`` 0)."""
    if temperature == 0:
        return [None] * n
    base = seed if seed is not None else int(torch.seed()) % (2**62)
    return [torch.Generator(device=device).manual_seed(base + j) for j in range(n)]


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """A token id from ``logits`` (``[vocab]``): the argmax when ``temperature``
    is 0, else drawn from the softmax at ``temperature`` restricted to the
    smallest set of tokens whose probability reaches ``top_p``."""
    if temperature == 0.0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p  # the smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
