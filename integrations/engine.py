"""A continuous-batching serving engine whose KV cache is vattn.

:class:`Engine` wraps a transformers causal LM. Each iteration it admits
waiting requests (first come, first served) while reqids and pages allow,
calls ``step`` with every running request's new length, preempts the most
recently admitted requests when ``step`` says the pages are not there
(recompute: their tokens so far become the prompt when they come back, ahead
of everyone else), runs the model once over the tokens of all running requests
packed into one sequence, and samples. A request leaves the batch the
iteration it finishes.

The model's attention is replaced (for as long as the engine is open) by one
that writes each layer's new K/V into the vattn tensors and runs SDPA on
``k[reqid, :n]`` per request (:func:`vattn.attention.sdpa_attention`): no
padding to the longest request, no block table, no copy of the cache.

Example::

    engine = Engine(model, max_batch_size=16, max_context_len=2048)
    outputs = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)
    engine.close()
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AttentionInterface

from vattn import KVCacheManager
from vattn.attention import AttentionBatch, sdpa_attention

from ._hf_model import kv_shape

__all__ = ["Engine", "RequestOutput"]


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


@dataclasses.dataclass(eq=False)
class _Request:
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

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class Engine:
    """Continuous batching over a transformers causal LM with a vattn KV cache.

    Args:
        model: a transformers decoder-only causal LM (Llama, Qwen2, Mistral, ...).
        max_batch_size: requests running at once (vattn reqids).
        max_context_len: tokens per request at most, prompt included.
        device: where the cache lives; the model's device by default.
        prefill_chunk_size: at most this many prompt tokens of one request per
            iteration (chunked prefill); None: whole prompts.
        **vattn_options: passed to :class:`vattn.KVCacheManager` (``page_size``,
            ``physical_memory``, ``layout``, policy switches).

    While the engine is open the model's attention implementation is the
    engine's; :meth:`close` restores it and releases the cache.
    """

    _ids = itertools.count()

    def __init__(
        self,
        model: Any,
        max_batch_size: int,
        max_context_len: int,
        device: str | torch.device | None = None,
        prefill_chunk_size: int | None = None,
        **vattn_options: Any,
    ) -> None:
        if prefill_chunk_size is not None and (isinstance(prefill_chunk_size, bool)
                                               or not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1):
            raise ValueError(f"prefill_chunk_size must be a positive int or None, got {prefill_chunk_size!r}")
        self.model = model.eval()
        self.kv = KVCacheManager(**kv_shape(model), dtype=model.dtype, max_batch_size=max_batch_size,
                                 max_context_len=max_context_len, device=device or model.device, **vattn_options)
        text_config = model.config.get_text_config(decoder=True)
        self.vocab_size: int = text_config.vocab_size
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_token_ids: frozenset[int] = frozenset([eos] if isinstance(eos, int) else eos or [])
        self.prefill_chunk_size = prefill_chunk_size
        self.waiting: collections.deque[_Request] = collections.deque()
        self.running: list[_Request] = []  # in admission order
        self.iteration = 0
        self.preemptions = 0
        self.history: list[dict[str, float]] = []  # one record per iteration (times, sizes, bytes)
        self._next_request_id = 0
        self._plan: AttentionBatch | None = None
        # The model's attention calls back into this engine under a unique name.
        self._attn_name = f"vattn_engine_{next(Engine._ids)}"
        self._previous_attn = text_config._attn_implementation
        AttentionInterface.register(self._attn_name, self._attention)
        model.set_attn_implementation(self._attn_name)
        self._closed = False

    # ---- requests ------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], max_new_tokens: int = 16, temperature: float = 0.0,
                    top_p: float = 1.0, seed: int | None = None) -> int:
        """Queues a request; returns its id. Greedy when ``temperature`` is 0.

        Raises ValueError (and queues nothing) for an empty prompt, a prompt
        longer than ``max_context_len`` tokens, token ids outside the
        vocabulary, ``max_new_tokens`` < 1, or sampling values out of range.
        """
        self._check_open()
        try:
            prompt = [operator.index(t) for t in prompt]
        except TypeError:
            raise ValueError("prompt must be a sequence of int token ids") from None
        limit = self.kv.config.max_context_len
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        if len(prompt) > limit:
            raise ValueError(f"prompt has {len(prompt)} tokens; max_context_len is {limit}")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size - 1}] (the vocabulary); got {bad[:5]}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=self.kv.device)
            generator.manual_seed(seed if seed is not None else torch.seed())
        request_id = self._next_request_id
        self._next_request_id += 1
        self.waiting.append(_Request(request_id, prompt, max_new_tokens, float(temperature), float(top_p),
                                     generator, time.perf_counter()))
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 16,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> list[list[int]]:
        """Runs every prompt to completion; returns the generated ids per prompt.

        ``max_new_tokens`` is one count for all or one per prompt; with
        sampling, prompt i uses seed ``seed + i``. Every prompt is checked
        before any is queued.
        """
        counts = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(counts) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(counts)} entries for {len(prompts)} prompts")
        ids = []
        try:
            for i, (prompt, n) in enumerate(zip(prompts, counts)):
                ids.append(self.add_request(prompt, n, temperature, top_p, None if seed is None else seed + i))
        except ValueError as e:
            for _ in ids:  # leave the queue as it was
                self.waiting.pop()
            raise ValueError(f"prompt {len(ids)}: {e}") from None
        results: dict[int, RequestOutput] = {}
        while not all(i in results for i in ids):
            for out in self.step():
                results[out.request_id] = out
        failed = [results[i] for i in ids if results[i].error]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return [results[i].output for i in ids]

    # ---- one iteration ---------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: admit, map pages (preempting if needed), run the
        model once, sample. Returns the requests that finished in it."""
        self._check_open()
        finished: list[RequestOutput] = []
        batch = self._schedule(finished)
        if batch:
            self._run(batch, finished)
        self.iteration += 1
        stats = self.kv.stats()
        self.history.append(dict(
            time=time.perf_counter(), running=len(self.running), waiting=len(self.waiting),
            tokens=sum(n for _, n in batch),
            bytes_mapped=stats["bytes_mapped"],  # all of it, pages kept for reuse included
            bytes_needed=self._bytes_needed(),  # the pages running requests' tokens need
            bytes_used=stats["bytes_used"],  # the tokens of running requests
        ))
        return finished

    def _bytes_needed(self) -> int:
        """Bytes of the pages that the running requests' cached tokens occupy."""
        kv, cfg = self.kv, self.kv.config
        pages = sum(cfg.pages_for(r.num_computed, kv.page_size) for r in self.running)
        return pages * kv.page_size * cfg.num_buffers

    def _chunk(self, req: _Request) -> int:
        """Tokens of ``req`` this iteration computes."""
        pending = len(req.prompt) + len(req.output) - req.num_computed
        return min(pending, self.prefill_chunk_size or pending)

    def _schedule(self, finished: list[RequestOutput]) -> list[tuple[_Request, int]]:
        """Admits waiting requests and maps pages for this iteration."""
        while self.waiting and len(self.running) < self.kv.config.max_batch_size:
            req = self.waiting.popleft()
            req.reqid = self.kv.alloc_reqid(len(req.prompt) + len(req.output))
            self.running.append(req)
        while self.running:
            lens = [0] * self.kv.config.max_batch_size
            for req in self.running:
                lens[req.reqid] = req.num_computed + self._chunk(req)
            if self.kv.step(lens):
                return [(req, self._chunk(req)) for req in self.running]
            victim = self.running.pop()  # the most recently admitted
            self.kv.free_reqid(victim.reqid)
            if not self.running:  # alone, and still too large for the pool
                finished.append(self._finish(victim, "error", error=(
                    f"needs {lens[victim.reqid]} tokens of KV cache, more than the physical pool holds "
                    f"({self.kv.stats()['bytes_total']} bytes)")))
                break
            if victim.num_computed:  # not just admitted: its cache is lost, recompute later
                victim.preemptions += 1
                self.preemptions += 1
            victim.num_computed = 0
            self.waiting.appendleft(victim)
        return []

    def _run(self, batch: list[tuple[_Request, int]], finished: list[RequestOutput]) -> None:
        tokens, positions, sample_rows = [], [], []
        for req, n in batch:
            start = req.num_computed
            tokens.extend(req.tokens[start:start + n])
            positions.extend(range(start, start + n))
            sample_rows.append(len(tokens) - 1)
        device = self.kv.device
        self._plan = AttentionBatch([r.reqid for r, _ in batch], [r.num_computed for r, _ in batch],
                                    [n for _, n in batch], device=device)
        with torch.inference_mode():
            logits = self.model(
                input_ids=torch.tensor([tokens], device=device),
                position_ids=torch.tensor([positions], device=device),
                logits_to_keep=torch.tensor(sample_rows, device=device),
                use_cache=False,
            ).logits[0]
        self._plan = None
        now = time.perf_counter()
        for row, (req, n) in enumerate(batch):
            req.num_computed += n
            if req.num_computed < len(req.prompt) + len(req.output):
                continue  # a prefill chunk that does not reach the end yet
            req.output.append(self._sample(req, logits[row]))
            if req.first_token_time is None:
                req.first_token_time = now
            reason = self._finish_reason(req)
            if reason:
                self.running.remove(req)
                self.kv.free_reqid(req.reqid)
                finished.append(self._finish(req, reason))

    def _sample(self, req: _Request, logits: torch.Tensor) -> int:
        if req.temperature == 0.0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / req.temperature, dim=-1)
        if req.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < req.top_p  # the smallest set reaching top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=req.generator))

    def _finish_reason(self, req: _Request) -> str | None:
        if req.output[-1] in self.eos_token_ids:
            return "eos"
        if len(req.output) >= req.max_new_tokens:
            return "length"
        if len(req.prompt) + len(req.output) > self.kv.config.max_context_len:
            return "context"  # the next token would need a row past max_context_len
        return None

    def _finish(self, req: _Request, reason: str, error: str | None = None) -> RequestOutput:
        return RequestOutput(req.request_id, req.prompt, req.output, reason, req.arrival_time,
                             req.first_token_time, time.perf_counter(), req.preemptions, error)

    # ---- attention -----------------------------------------------------------

    def _attention(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
        """The model's attention: ``[1, heads, T, D]`` packed tokens of every
        running request; K/V go into the vattn cache, SDPA reads it back."""
        if self._plan is None:
            raise RuntimeError("this model's attention belongs to a vattn Engine; run it through the engine "
                               "or close() the engine first")
        k_cache, v_cache = self.kv.layer(module.layer_idx)
        out = sdpa_attention(query[0].transpose(0, 1), k_cache, v_cache, self._plan,
                             k=key[0].transpose(0, 1), v=value[0].transpose(0, 1), softmax_scale=scaling)
        return out.unsqueeze(0), None

    # ---- lifetime ------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The cache's stats plus iteration and preemption counts."""
        return dict(self.kv.stats(), iterations=self.iteration, preemptions=self.preemptions,
                    running=len(self.running), waiting=len(self.waiting))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine was closed")

    def close(self) -> None:
        """Restores the model's attention and releases the cache. Idempotent."""
        if not self._closed:
            self._closed = True
            self.model.set_attn_implementation(self._previous_attn)
            self.kv.cleanup()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
