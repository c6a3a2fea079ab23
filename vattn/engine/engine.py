"""A continuous-batching serving engine whose KV cache is vattn.

:class:`Engine` wraps a transformers causal LM. Each iteration it admits
waiting requests (first come, first served) while reqids and pages allow,
calls ``step`` with every running request's new length, preempts the most
recently admitted requests when ``step`` says the pages are not there
(recompute: their tokens so far become the prompt when they come back, ahead
of everyone else), runs the model once over the tokens of all running requests
packed into one sequence, and samples. A request leaves the batch the
iteration it finishes.

Shared pages (vattn's fork and prefix handles):

* ``n`` completions of one prompt (``generate(..., n=4)``): the prompt is
  prefilled once; when its last token's logits are there, each completion
  samples its first token and the request is forked ``n - 1`` ways
  (:meth:`vattn.KVCacheManager.fork`: whole pages shared, the partial last
  page copied), so the prompt's KV exists once.
* ``Engine(..., prefix_cache=True)``: whole-page prefixes of requests (prompt
  and generated tokens, once computed) are kept with prefix handles, keyed by
  a chain hash of page-sized token blocks as vLLM does; a new request maps the
  longest cached prefix of its tokens into its slice and prefills only the
  rest. Least recently used entries are released when the pool runs short,
  before any request is preempted.

The model's attention is replaced (for as long as the engine is open) by one
that writes each layer's new K/V into the vattn tensors and attends over
``k[reqid, :n]`` in place (:func:`vattn.attention.attention`: the native host
kernel, one call per layer for the whole batch, on CPU; SDPA per request on
CUDA): no padding to the longest request, no block table, no copy of the cache.

Example::

    engine = Engine(model, max_batch_size=16, max_context_len=2048)
    outputs = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)
    engine.close()
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import operator
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from transformers import AttentionInterface

from vattn import ClosedError, KVCacheManager, OutOfPages, OutOfSlots, PrefixHandle
from vattn.attention import AttentionBatch, attention

from vattn.integrations.hf_model import kv_shape

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
    sample_index: int = 0  # which of the request's n completions (0 .. n-1)


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
    sample_index: int = 0
    # completions 1 .. n-1 still to fork off when the prompt's logits are there: their generators
    pending_samples: list[torch.Generator | None] = dataclasses.field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class _PrefixCache:
    """Whole-page token prefixes held by vattn prefix handles.

    Keys are chain hashes of page-sized token blocks (block i's key covers
    blocks 0..i), so a lookup finds the longest cached prefix of any token
    sequence. Each handle records its tokens and is checked on a hit, so a
    hash collision can only cost a miss. Least recently used handles go first.
    """

    def __init__(self, page_tokens: int) -> None:
        self.page_tokens = page_tokens
        self.index: dict[int, PrefixHandle] = {}
        self.entries: collections.OrderedDict[PrefixHandle, tuple[list[int], list[int]]] = collections.OrderedDict()
        self.queries = self.query_tokens = self.hit_tokens = 0

    def keys(self, tokens: Sequence[int]) -> list[int]:
        keys, key = [], 0
        for start in range(0, len(tokens) - self.page_tokens + 1, self.page_tokens):
            key = hash((key, tuple(tokens[start:start + self.page_tokens])))
            keys.append(key)
        return keys

    def lookup(self, tokens: Sequence[int]) -> tuple[PrefixHandle | None, int]:
        """The cached handle and number of pages matching the longest whole-page
        prefix of ``tokens[:-1]`` (the last token is always computed again, for
        its logits)."""
        self.queries += 1
        self.query_tokens += len(tokens)
        keys = self.keys(tokens[:-1])
        for pages in range(len(keys), 0, -1):
            handle = self.index.get(keys[pages - 1])
            if handle is None:
                continue
            held = self.entries[handle][1]
            if list(tokens[:pages * self.page_tokens]) != held[:pages * self.page_tokens]:
                continue  # a hash collision
            self.entries.move_to_end(handle)
            self.hit_tokens += pages * self.page_tokens
            return handle, pages
        return None, 0

    def insert(self, kv: KVCacheManager, reqid: int, tokens: Sequence[int]) -> None:
        """Keeps the whole pages of reqid's first ``len(tokens)`` tokens (computed)."""
        pages = len(tokens) // self.page_tokens
        if pages == 0:
            return
        keys = self.keys(tokens[:pages * self.page_tokens])
        known = self.index.get(keys[-1])
        if known is not None:
            self.entries.move_to_end(known)
            return
        handle = kv.retain_prefix(reqid, pages * self.page_tokens)
        self.entries[handle] = (keys, list(tokens[:pages * self.page_tokens]))
        for key in keys:
            self.index[key] = handle

    def evict(self) -> bool:
        """Releases the least recently used entry; False when there is none."""
        if not self.entries:
            return False
        handle, (keys, _) = self.entries.popitem(last=False)
        for key in keys:
            if self.index.get(key) is handle:
                del self.index[key]
        handle.release()
        return True

    def clear(self) -> None:
        while self.evict():
            pass


class Engine:
    """Continuous batching over a transformers causal LM with a vattn KV cache.

    Args:
        model: a transformers decoder-only causal LM (Llama, Qwen2, Mistral, ...).
        max_batch_size: requests running at once (vattn reqids).
        max_context_len: tokens per request at most, prompt included.
        device: where the cache lives; the model's device by default.
        prefill_chunk_size: at most this many prompt tokens of one request per
            iteration (chunked prefill); None: whole prompts.
        prefix_cache: keep whole-page prefixes of requests and reuse them for
            new requests with the same leading tokens (see the module
            docstring). Needs a ``page_size`` holding a whole number of tokens.
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
        prefix_cache: bool = False,
        **vattn_options: Any,
    ) -> None:
        if prefill_chunk_size is not None and (isinstance(prefill_chunk_size, bool)
                                               or not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1):
            raise ValueError(f"prefill_chunk_size must be a positive int or None, got {prefill_chunk_size!r}")
        if not isinstance(prefix_cache, bool):
            raise TypeError(f"prefix_cache must be a bool, got {type(prefix_cache).__name__}")
        self.model = model.eval()
        self.kv = KVCacheManager(**kv_shape(model), dtype=model.dtype, max_batch_size=max_batch_size,
                                 max_context_len=max_context_len, device=device or model.device, **vattn_options)
        self.prefix_cache: _PrefixCache | None = None
        if prefix_cache:
            if self.kv.page_tokens is None:
                self.kv.cleanup()
                raise ValueError(f"prefix_cache needs pages holding a whole number of tokens; page_size "
                                 f"{self.kv.page_size} is not a multiple of {self.kv.config.token_bytes_per_buffer} "
                                 f"bytes per token")
            self.prefix_cache = _PrefixCache(self.kv.page_tokens)
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
                    top_p: float = 1.0, seed: int | None = None, n: int = 1) -> int:
        """Queues a request; returns its id. Greedy when ``temperature`` is 0.

        ``n`` completions of the prompt share its prefill (completion ``j``
        samples with seed ``seed + j``); each finishes as its own
        :class:`RequestOutput` with ``sample_index`` ``j``.

        Raises ValueError / TypeError (and queues nothing) for an empty prompt,
        a prompt longer than ``max_context_len`` tokens, token ids outside the
        vocabulary or not ints, ``max_new_tokens`` or ``n`` < 1, a seed
        outside ``[0, 2**63)``, or sampling values out of range.
        """
        self._check_open()
        request = self._new_request(prompt, max_new_tokens, temperature, top_p, seed, n)
        self.waiting.append(request)
        return request.request_id

    def _new_request(self, prompt: object, max_new_tokens: object, temperature: object, top_p: object,
                     seed: object, n: object) -> _Request:
        """A validated, numbered request; raises (numbering nothing) on bad input."""
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
            raise TypeError(f"prompt must be a sequence of int token ids, got {type(prompt).__name__}")
        prompt = list(prompt)
        if any(isinstance(t, bool) or not hasattr(t, "__index__") for t in prompt):
            raise TypeError("prompt must be a sequence of int token ids (not bools or floats)")
        prompt = [operator.index(t) for t in prompt]
        limit = self.kv.config.max_context_len
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        if len(prompt) > limit:
            raise ValueError(f"prompt has {len(prompt)} tokens; max_context_len is {limit}")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size - 1}] (the vocabulary); got {bad[:5]}")
        max_new_tokens = _count("max_new_tokens", max_new_tokens)
        n = _count("n", n)
        temperature = _real("temperature", temperature)
        if not (0.0 <= temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        top_p = _real("top_p", top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if seed is not None:
            if isinstance(seed, bool) or not hasattr(seed, "__index__"):
                raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
            seed = operator.index(seed)
            if not 0 <= seed <= 2**63 - n:
                raise ValueError(f"seed must be in [0, 2**63 - n], got {seed}")
        generators: list[torch.Generator | None] = [None] * n
        if temperature > 0:
            base = seed if seed is not None else int(torch.seed()) % (2**62)
            generators = [torch.Generator(device=self.kv.device).manual_seed(base + j) for j in range(n)]
        request_id = self._next_request_id
        self._next_request_id += 1
        return _Request(request_id, prompt, max_new_tokens, temperature, top_p, generators[0], time.perf_counter(),
                        pending_samples=generators[1:])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts: Iterable[Sequence[int]], max_new_tokens: int | Sequence[int] = 16,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 n: int = 1) -> list[list[int]] | list[list[list[int]]]:
        """Runs every prompt to completion; returns the generated ids per prompt
        (with ``n > 1``: per prompt, a list of ``n`` completions).

        ``max_new_tokens`` is one count for all or one per prompt; with
        sampling, completion ``j`` of prompt ``i`` uses seed ``seed + i * n + j``.
        Every prompt is checked before any is queued.
        """
        self._check_open()
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Iterable):
            raise TypeError(f"prompts must be a list of token-id sequences, got {type(prompts).__name__}")
        prompts = list(prompts)
        if isinstance(max_new_tokens, bool) or hasattr(max_new_tokens, "__index__"):
            counts = [max_new_tokens] * len(prompts)
        elif isinstance(max_new_tokens, Iterable):
            counts = list(max_new_tokens)
        else:
            raise TypeError(f"max_new_tokens must be an int or a sequence of ints, got {type(max_new_tokens).__name__}")
        if len(counts) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(counts)} entries for {len(prompts)} prompts")
        n = _count("n", n)
        if seed is not None and (isinstance(seed, bool) or not hasattr(seed, "__index__")):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        first_id = self._next_request_id
        requests = []
        try:  # validate everything before queueing anything
            for i, (prompt, count) in enumerate(zip(prompts, counts)):
                requests.append(self._new_request(prompt, count, temperature, top_p,
                                                  None if seed is None else operator.index(seed) + i * n, n))
        except (ValueError, TypeError) as e:
            self._next_request_id = first_id
            raise type(e)(f"prompt {len(requests)}: {e}") from None
        self.waiting.extend(requests)
        ids = [r.request_id for r in requests]
        results: dict[tuple[int, int], RequestOutput] = {}
        while len(results) < len(ids) * n:
            for out in self.step():
                results[out.request_id, out.sample_index] = out
        failed = [out for out in results.values() if out.error]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
        if n == 1:
            return [results[i, 0].output for i in ids]
        return [[results[i, j].output for j in range(n)] for i in ids]

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
            bytes_in_use=stats["pages_in_use"] * self.kv.page_size,  # distinct pages mapped or held by the prefix cache
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
            self._attach_cached_prefix(req)
            self.running.append(req)
        while self.running:
            lens = [0] * self.kv.config.max_batch_size
            for req in self.running:
                lens[req.reqid] = req.num_computed + self._chunk(req)
            if self.kv.step(lens):
                return [(req, self._chunk(req)) for req in self.running]
            if self.prefix_cache is not None and self.prefix_cache.evict():
                continue  # cached prefixes go before any running request
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
            if not req.output and self.prefix_cache is not None:
                self.prefix_cache.insert(self.kv, req.reqid, req.prompt)  # the prompt is computed
            samples = [req] + self._fork_samples(req, logits[row], now, finished)
            req.output.append(self._sample(req, logits[row]))
            for sample in samples:
                if sample.first_token_time is None:
                    sample.first_token_time = now
                reason = self._finish_reason(sample)
                if reason:
                    self._retire(sample, reason, finished)

    def _fork_samples(self, req: _Request, logits: torch.Tensor, now: float,
                      finished: list[RequestOutput]) -> list[_Request]:
        """Completions 1.. of a request whose prompt was just computed: each
        samples its first token from the prompt's logits and gets a fork of
        the request's KV (or, without a free reqid or page, waits to be
        recomputed like a preempted request). Returns the forked ones."""
        forked = []
        for j, generator in enumerate(req.pending_samples, start=1):
            child = dataclasses.replace(req, generator=generator, output=[], pending_samples=[], sample_index=j,
                                        preemptions=0, first_token_time=now, reqid=-1)
            child.output.append(self._sample(child, logits))
            reason = self._finish_reason(child)
            if reason:  # done with its first token: no KV of its own needed
                finished.append(self._finish(child, reason))
                continue
            try:
                child.reqid = self.kv.fork(req.reqid, req.num_computed)
            except (OutOfSlots, OutOfPages):
                child.num_computed = 0
                self.waiting.appendleft(child)
                continue
            self.running.append(child)
            forked.append(child)
        req.pending_samples = []
        return forked

    def _retire(self, req: _Request, reason: str, finished: list[RequestOutput]) -> None:
        self.running.remove(req)
        if self.prefix_cache is not None:
            self.prefix_cache.insert(self.kv, req.reqid, req.tokens[:req.num_computed])
        self.kv.free_reqid(req.reqid)
        finished.append(self._finish(req, reason))

    def _attach_cached_prefix(self, req: _Request) -> None:
        """Maps the longest cached whole-page prefix of a new request's tokens
        into its slice: those tokens need no prefill."""
        if self.prefix_cache is None:
            return
        handle, pages = self.prefix_cache.lookup(req.tokens)
        if pages:
            self.kv.map_pages([req.reqid], [0], handle.page_ids[:pages], [pages])
            req.num_computed = pages * self.prefix_cache.page_tokens

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
                             req.first_token_time, time.perf_counter(), req.preemptions, error, req.sample_index)

    # ---- attention -----------------------------------------------------------

    def _attention(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
        """The model's attention: ``[1, heads, T, D]`` packed tokens of every
        running request; K/V go into the vattn cache, the attention kernel reads it back."""
        if self._plan is None:
            raise RuntimeError("this model's attention belongs to a vattn Engine; run it through the engine "
                               "or close() the engine first")
        k_cache, v_cache = self.kv.layer(module.layer_idx)
        out = attention(query[0].transpose(0, 1), k_cache, v_cache, self._plan,
                        k=key[0].transpose(0, 1), v=value[0].transpose(0, 1), softmax_scale=scaling)
        return out.unsqueeze(0), None

    # ---- lifetime ------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The cache's stats plus iteration and preemption counts and, with
        ``prefix_cache``, its queries, tokens looked up and tokens hit."""
        self._check_open()
        out = dict(self.kv.stats(), iterations=self.iteration, preemptions=self.preemptions,
                   running=len(self.running), waiting=len(self.waiting))
        if self.prefix_cache is not None:
            pc = self.prefix_cache
            out.update(prefix_cache_queries=pc.queries, prefix_cache_query_tokens=pc.query_tokens,
                       prefix_cache_hit_tokens=pc.hit_tokens, prefix_cache_entries=len(pc.entries))
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this Engine was closed")

    def close(self) -> None:
        """Restores the model's attention and releases the cache. Idempotent."""
        if not self._closed:
            self._closed = True
            self.model.set_attn_implementation(self._previous_attn)
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            self.kv.cleanup()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _count(name: str, value: object) -> int:
    """An int >= 1 (ints and integer scalars; not bools or floats)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__}")
    value = operator.index(value)
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value}")
    return value


def _real(name: str, value: object) -> float:
    """A real number (ints, floats, numpy scalars; not bools, strings or None)."""
    if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)
