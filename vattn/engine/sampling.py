"""Choosing the next token from a row of logits: greedy, or temperature and
top-p with a seeded generator per completion (reproducible).

:func:`draw` takes every draw of an iteration at once and brings the token
ids back to the host in one copy: the one wait for the device an iteration
cannot avoid (the scheduler needs the ids to decide the next one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["Draw", "draw", "generators", "sample"]


class Draw(NamedTuple):
    """One token to draw: from logits row ``row``, with these settings."""

    row: int  # row of the iteration's logits ([rows, vocab])
    temperature: float  # 0: greedy
    top_p: float  # in (0, 1]
    generator: torch.Generator | None  # None when greedy


def generators(n: int, seed: int | None, temperature: float,
               device: torch.device) -> list[torch.Generator | None]:
    """One generator per completion (completion ``j`` seeded ``seed + j``; a
    random base without a seed); None each when greedy (``temperature`` 0)."""
    if temperature == 0:
        return [None] * n
    base = seed if seed is not None else int(torch.seed()) % (2**62)
    return [torch.Generator(device=device).manual_seed(base + j) for j in range(n)]


def draw(logits: torch.Tensor, draws: Sequence[Draw]) -> list[int]:
    """The token id of every draw, in order, from ``logits`` (``[rows, vocab]``,
    any device): the greedy ones from one argmax over the rows, each sampled
    one with its own generator, all brought to the host by one ``tolist``
    (indexing a device tensor with a host list would copy the list over first,
    and a pageable copy may wait for the device)."""
    if not draws:
        return []
    parts = [logits.argmax(-1)] if any(d.temperature == 0.0 for d in draws) else []
    base = logits.shape[0] if parts else 0  # where the sampled ids start in the one copy
    parts += [sampled(logits[d.row], d.temperature, d.top_p, d.generator) for d in draws if d.temperature != 0.0]
    ids = torch.cat(parts).tolist()
    out, at = [], base
    for d in draws:
        if d.temperature == 0.0:
            out.append(ids[d.row])
        else:
            out.append(ids[at])
            at += 1
    return out


def sampled(logits: torch.Tensor, temperature: float, top_p: float,
            generator: torch.Generator | None) -> torch.Tensor:
    """A token id drawn from ``logits`` (``[vocab]``) at ``temperature``, restricted to
    the smallest set of tokens whose probability reaches ``top_p``: a ``[1]``
    tensor on the logits' device (nothing waits for it)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p  # the smallest set reaching top_p
        # masked, not indexed by the mask: boolean indexing would wait for the device to count the kept tokens
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs * keep)
    return torch.multinomial(probs, 1, generator=generator)


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """A token id from ``logits`` (``[vocab]``): the argmax when ``temperature``
    is 0, else drawn from the softmax at ``temperature`` restricted to the
    smallest set of tokens whose probability reaches ``top_p``."""
    if temperature == 0.0:
        return int(logits.argmax())
    return int(sampled(logits, temperature, top_p, generator))
