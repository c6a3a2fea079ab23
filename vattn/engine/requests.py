"""A request's life in the engine: the checks of what a caller asks for, the
state a request carries while it waits or runs, and the record it finishes with."""

from __future__ import annotations

import dataclasses
import math
import operator
import time
from collections.abc import Iterable

import torch

__all__ = ["Request", "RequestOutput", "check_count", "check_prompt", "check_real", "check_sampling",
           "check_seed"]


@dataclasses.dataclass
class RequestOutput:
    """A finished request. Times are ``time.perf_counter()`` seconds."""

    request_id: int
    prompt: list[int]
    output: list[int]  # generated token ids
    finish_reason: str  # "length" (max_new_tokens), "eos", "context" (max_context_len) or "error"
    arrival_time: float
    first_token_time: float | None
    finish_time: float
    preemptions: int  # times the request lost its cache and was recomputed
    error: str | None = None
    sample_index: int = 0  # which of the request's n completions (0 .. n-1)


@dataclasses.dataclass(eq=False)
class Request:
    """One completion while it waits or runs (compared by identity)."""

    request_id: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    generator: torch.Generator | None
    arrival_time: float
    output: list[int] = dataclasses.field(default_factory=list)
    reqid: int = -1  # vattn reqid while running
    num_computed: int = 0  # tokens whose K/V are in the cache
    first_token_time: float | None = None
    preemptions: int = 0
    sample_index: int = 0
    kv_failures: int = 0  # iterations in a row in which the KV cache raised for this request
    # completions 1 .. n-1 still to fork off when the prompt's logits are there: their generators
    pending_samples: list[torch.Generator | None] = dataclasses.field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens (what the cache holds once all are computed)."""
        return len(self.prompt) + len(self.output)

    def finished(self, reason: str, error: str | None = None) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.output, reason, self.arrival_time,
                             self.first_token_time, time.perf_counter(), self.preemptions, error, self.sample_index)

    def failed(self, error: str) -> list[RequestOutput]:
        """Error outputs for this completion and for every completion still to
        be forked from it (they share its prompt, so they fail with it)."""
        outs = [self.finished("error", error)]
        for j in range(1, len(self.pending_samples) + 1):
            outs.append(RequestOutput(self.request_id, self.prompt, [], "error", self.arrival_time, None,
                                      time.perf_counter(), self.preemptions, error, j))
        self.pending_samples = []
        return outs


def check_prompt(prompt: object, vocab_size: int, max_context_len: int) -> list[int]:
    """``prompt`` as a list of token ids in the vocabulary, at most ``max_context_len`` of them."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
        raise TypeError(f"prompt must be a sequence of int token ids, got {type(prompt).__name__}")
    tokens = list(prompt)
    if any(isinstance(t, bool) or not hasattr(t, "__index__") for t in tokens):
        raise TypeError("prompt must be a sequence of int token ids (not bools or floats)")
    tokens = [operator.index(t) for t in tokens]
    if not tokens:
        raise ValueError("prompt must hold at least one token")
    if len(tokens) > max_context_len:
        raise ValueError(f"prompt has {len(tokens)} tokens; max_context_len is {max_context_len}")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size - 1}] (the vocabulary); got {bad[:5]}")
    return tokens


def check_count(name: str, value: object, limit: int | None = None, limit_name: str = "") -> int:
    """An int >= 1 (ints and integer scalars; not bools or floats), and at
    most ``limit`` (named ``limit_name`` in the error) when one is given."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__}")
    value = operator.index(value)
    if limit is not None and not 1 <= value <= limit:
        raise ValueError(f"{name} must be an int >= 1 and <= {limit} ({limit_name}), i.e. in [1, {limit}], "
                         f"got {value}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value}")
    return value


def check_real(name: str, value: object) -> float:
    """A real number (ints, floats, numpy scalars; not bools, strings or None)."""
    if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def check_sampling(temperature: object, top_p: object) -> tuple[float, float]:
    """``temperature`` (finite, >= 0; 0 is greedy) and ``top_p`` (in (0, 1])."""
    temperature = check_real("temperature", temperature)
    if not (0.0 <= temperature < math.inf):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    top_p = check_real("top_p", top_p)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    return temperature, top_p


def check_seed(seed: object, n: int) -> int | None:
    """``seed`` (None or an int in ``[0, 2**63 - n]``: completion j samples with ``seed + j``)."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not hasattr(seed, "__index__"):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    seed = operator.index(seed)
    if not 0 <= seed <= 2**63 - n:
        raise ValueError(f"seed must be in [0, 2**63 - n], got {seed}")
    return seed
