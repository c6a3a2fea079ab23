"""A continuous-batching serving engine whose KV cache is vattn.

:class:`Engine` wraps a transformers causal LM. Each iteration it admits
waiting requests (first come, first served) while reqids allow, calls
``step`` with every running request's new length, and when ``step`` says the
pages are not there sends the most recently admitted requests back to the
head of the queue (a request admitted in this iteration simply waits; one
that had computed tokens is preempted: recompute, its tokens so far become
the prompt when it comes back). It then runs the model once over the tokens
of all running requests packed into one sequence, and samples. A request
leaves the batch the iteration it finishes. The parts: :mod:`.scheduler`
(queues, admission, pages, preemption), :mod:`.prefix_cache`,
:mod:`.sampling`, :mod:`.requests` (request state and checks).

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
  rest. When the pool runs short, least recently used entries holding pages
  that no running request maps are released (those return pages; an entry
  whose pages running requests map frees nothing and stays), before any
  request is preempted.

Failure contract. Any exception the KV cache raises during an iteration
(a driver or OS failure: :class:`vattn.DriverError`; also ``OutOfPages`` /
``OutOfReqids`` where they are not the expected answer) leaves the engine
consistent:

* Every request is in exactly one place: waiting, running (holding a reqid),
  or finished and returned by ``step`` once. No request disappears and no
  reqid leaks.
* An error while admitting a request (``alloc_reqid``, attaching its cached
  prefix) frees its reqid again and leaves it at the head of the queue;
  admission stops for this iteration, the running requests go on.
* An error in ``step`` or in the model's run (before any token is drawn) rolls
  the iteration back: no request's computed count, tokens or sampling state
  moved, and the same requests are retried in the next iteration.
* After the model ran, every token of the iteration is drawn before anything
  changes; then the KV-cache calls of the commit recover one by one: a failed
  ``fork`` sends that completion to the queue to be recomputed, a failed
  prefix-cache insert only costs the entry, a failed unmap in ``free_reqid``
  leaves the reqid free and the pages to the cache's own retry.
* A request that fails ``kv_retries`` + 1 iterations in a row (default 3 + 1)
  finishes with ``finish_reason="error"`` and ``error`` naming the last
  exception, and so do its completions not forked yet; its reqid is freed.
  ``generate`` raises :class:`GenerateError` (a ``RuntimeError``) for it,
  after every other request ran to the end, with their outputs.
* In a budget, a request the budget refuses that fits its current limit alone
  waits until others give memory back; one whose pages alone exceed the
  current limit is set aside, so the requests behind it run, and waits at
  most ``budget_wait_s`` seconds (default 30, ``VATTN_BUDGET_WAIT_S``) for the
  limit to rise before it finishes with an ``OutOfPages`` error; one larger
  than the cache's own pool fails at once. When nothing can run for want of
  the budget's memory, ``step`` blocks on the budget (up to
  ``BUDGET_WAIT_S``, using no CPU) until memory may have come free; when only
  requests over the limit wait, it sleeps (``LIMIT_POLL_S`` at a time) until
  the limit may have risen or the first of them is due to fail.
* Pages that a failed unmap left behind are reclaimed before any request is
  preempted or refused as too large for the pool.
* ``step`` does not raise for these errors (``stats()["kv_errors"]`` counts
  them, and each is logged as a warning on the ``vattn.engine`` logger).
  ``ClosedError`` (the cache was closed) and exceptions that are not the KV
  cache's (the model's) propagate before any token of the iteration is
  drawn: every request is waiting or running as a whole, and outputs the
  iteration had already decided come with the next ``step``.

The model's attention is replaced (for as long as the engine is open) by one
that writes each layer's new K/V into the vattn tensors and attends over
``k[reqid, :n]`` in place, with the kernel :func:`vattn.kernels.select_kernel`
picks when the engine opens (the native host kernel, one call per layer for
the whole batch, on CPU; FlashAttention-2 or SDPA on CUDA), planned once per
forward: no padding to the longest request, no block table, no copy of the cache.
A forward waits for the device once, for the sampled token ids (its inputs
go over in asynchronous copies from page-locked memory); on CUDA, decode
iterations replay CUDA graphs captured when the engine opens
(:mod:`.graphs`).

Example::

    engine = Engine(model, max_batch_size=16, max_context_len=2048)
    outputs = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)
    engine.close()
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from transformers import AttentionInterface

from vattn.budget.membership import budget_wait_seconds
from vattn.common.errors import ClosedError, VAttnError
from vattn.core import KVCacheManager
from vattn.integrations.hf_model import kv_shape
from vattn.kernels import AttentionBatch, AttentionCase, KernelPlan, select_kernel
from vattn.kernels.batch import index_tensor

from .prefix_cache import PrefixCache
from .requests import Request, RequestOutput, check_count, check_prompt, check_sampling, check_seed
from . import graphs as decode_graphs
from .sampling import Draw, draw, generators
from .scheduler import Scheduler

__all__ = ["Engine", "GenerateError", "RequestOutput"]

# Seconds a step blocks on the budget when nothing can run for want of its
# memory: short of the budget's 1 s wait expiry, so the waiting request is
# asked for again (and keeps counting as a wait others give memory back for).
BUDGET_WAIT_S = 0.25
# Seconds between looks at the limit while only requests over it wait: a
# limit raised is seen this late at most.
LIMIT_POLL_S = 0.1


class GenerateError(RuntimeError):
    """Some requests of :meth:`Engine.generate` failed; the others ran to the end.

    Attributes:
        outputs: per prompt, what ``generate`` would have returned for it
            (its tokens, or with ``n > 1`` its completions), None for a
            prompt whose request failed.
        failed: the :class:`RequestOutput` of every failed request and completion.
    """

    def __init__(self, message: str, outputs: list[Any], failed: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs
        self.failed = failed


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
        kv_retries: iterations in a row a request is retried after the KV
            cache raised in them (a driver or OS error); one more failure
            finishes it with ``finish_reason`` "error" (see the module
            docstring's failure contract).
        budget: a machine-wide :class:`vattn.Budget` (or its name) the KV
            cache draws its pages from, shared with engines in other
            processes; ``None``: the one ``VATTN_BUDGET`` names, if set;
            ``False``: none. When the budget cannot grant pages the engine
            preempts as for a full pool, and a request alone that fits the
            pool and the budget's limit waits for others to give memory back
            (docs/elastic.md).
        budget_wait_s: seconds a request whose pages alone exceed the
            budget's current limit waits for the limit to rise before it
            fails with ``OutOfPages`` (``None``: ``VATTN_BUDGET_WAIT_S`` when
            set, else 30; in [0, 1e6]).
        cuda_graphs: replay decode iterations (every request one token)
            from CUDA graphs captured when the engine opens, one per batch
            size of ``graph_batch_sizes`` (:mod:`vattn.engine.graphs`); a
            decode of ``n`` requests replays the smallest size holding it,
            padded. ``None``: on for a CUDA cache whose attention kernel
            plans into persistent buffers (FlashAttention-2, torch's or the
            flash-attn package's), off otherwise (the CPU). ``True`` where
            that does not hold raises ``ValueError``. The engine then holds
            one reqid of the cache for the padding (its first page mapped).
        graph_batch_sizes: the batch sizes captured (ints in
            ``[1, max_batch_size]``); None: 1, 2, 4, then every multiple of 8,
            and ``max_batch_size``.
        **vattn_options: passed to :class:`vattn.KVCacheManager` (``page_size``,
            ``physical_memory``, ``layout``, policy switches, ``idle_release_s``).

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
        kv_retries: int = 3,
        budget: Any = None,
        budget_wait_s: float | None = None,
        cuda_graphs: bool | None = None,
        graph_batch_sizes: Sequence[int] | None = None,
        **vattn_options: Any,
    ) -> None:
        if prefill_chunk_size is not None and (isinstance(prefill_chunk_size, bool)
                                               or not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1):
            raise ValueError(f"prefill_chunk_size must be a positive int or None, got {prefill_chunk_size!r}")
        if not isinstance(prefix_cache, bool):
            raise TypeError(f"prefix_cache must be a bool, got {type(prefix_cache).__name__}")
        if isinstance(kv_retries, bool) or not isinstance(kv_retries, int):
            raise TypeError(f"kv_retries must be an int >= 0, got {type(kv_retries).__name__}")
        if kv_retries < 0:
            raise ValueError(f"kv_retries must be an int >= 0, got {kv_retries}")
        budget_wait_s = budget_wait_seconds(budget_wait_s)  # checked before the cache exists
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool or None, got {type(cuda_graphs).__name__}")
        sizes = decode_graphs.capture_sizes(max_batch_size, graph_batch_sizes)
        cache_device = torch.device(device or model.device)
        if cuda_graphs and cache_device.type not in decode_graphs.GRAPH_DEVICES:
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got {cache_device}")
        # one more reqid where graphs may run: the padding slice of every padded decode
        padding = int(cuda_graphs is not False and cache_device.type in decode_graphs.GRAPH_DEVICES)
        self.max_batch_size = max_batch_size
        self.model = model.eval()
        name = "".join(c for c in str(getattr(model.config, "name_or_path", "")) if " " <= c <= "~")
        vattn_options.setdefault("budget_label", f"engine {name[-40:]}".strip())  # what `vattn top` shows
        shape = kv_shape(model)
        self.kv = KVCacheManager(**shape, dtype=model.dtype, max_batch_size=max_batch_size + padding,
                                 max_context_len=max_context_len, device=cache_device, budget=budget,
                                 **vattn_options)
        # the engine's attention kernel, chosen once: every forward plans its batch with it, every layer runs it
        k_cache = self.kv.layer(0)[0]  # the cache's geometry: kernels that read it as rows or pages check it
        self._case = AttentionCase(self.kv.device.type, shape["head_dim"], model.dtype, model.dtype,
                                   model.config.get_text_config(decoder=True).num_attention_heads,
                                   shape["num_kv_heads"], max_context_len, slice_stride=k_cache.stride(0),
                                   row_stride=k_cache.stride(1), page_tokens=self.kv.page_tokens)
        try:
            self._kernel = select_kernel(self._case)
            if cuda_graphs and not self._kernel.graphs:
                raise ValueError(f"cuda_graphs=True needs an attention kernel that runs in CUDA graphs; this "
                                 f"cache's is {self._kernel.name}, which does not")
        except BaseException:
            self.kv.cleanup()
            raise
        cache: PrefixCache | None = None
        if prefix_cache:
            if self.kv.page_tokens is None:
                self.kv.cleanup()
                raise ValueError(f"prefix_cache needs pages holding a whole number of tokens; page_size "
                                 f"{self.kv.page_size} is not a multiple of {self.kv.config.token_bytes_per_buffer} "
                                 f"bytes per token")
            cache = PrefixCache(self.kv.page_tokens)
        self.scheduler = Scheduler(self.kv, cache, prefill_chunk_size, kv_retries, budget_wait_s)
        self.scheduler.max_running = max_batch_size  # not the padding reqid
        text_config = model.config.get_text_config(decoder=True)
        self.vocab_size: int = text_config.vocab_size
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_token_ids: frozenset[int] = frozenset([eos] if isinstance(eos, int) else eos or [])
        self.iteration = 0
        self.history: list[dict[str, float]] = []  # one record per iteration (times, sizes, bytes)
        self._next_request_id = 0
        self._plan: KernelPlan | None = None  # the forward's batch as the kernel planned it
        self._input_device = self.kv.device  # where each forward's inputs and index tensors go
        self._undelivered: list[RequestOutput] = []  # outputs of an iteration an exception cut short
        # The model's attention calls back into this engine under a unique name.
        self._attn_name = f"vattn_engine_{next(Engine._ids)}"
        self._previous_attn = text_config._attn_implementation
        AttentionInterface.register(self._attn_name, self._attention)
        model.set_attn_implementation(self._attn_name)
        self._closed = False
        self.graphs: decode_graphs.DecodeGraphs | None = None  # the captured decode forwards, when on
        if padding and self._kernel.graphs:
            try:
                self.graphs = self._capture(sizes)
            except BaseException:
                self.close()
                raise

    def _capture(self, sizes: Sequence[int]) -> decode_graphs.DecodeGraphs:
        """Holds the padding reqid, maps its first page, captures the decode forwards."""
        padding_reqid = self.kv.alloc_reqid(reqid=self.max_batch_size)
        lens = [0] * (self.max_batch_size + 1)
        lens[padding_reqid] = 1
        if not self.kv.step(lens):
            raise ValueError("cuda_graphs: the cache's pool cannot map the padding slice's first page")
        return decode_graphs.DecodeGraphs(self._run_model, self._kernel, self.kv, padding_reqid, sizes,
                                          self.kv.config.max_context_len)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.scheduler.prefix_cache

    @property
    def waiting(self) -> Sequence[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    # ---- requests ------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], max_new_tokens: int = 16, temperature: float = 0.0,
                    top_p: float = 1.0, seed: int | None = None, n: int = 1) -> int:
        """Queues a request; returns its id. Greedy when ``temperature`` is 0.

        ``n`` completions of the prompt share its prefill (completion ``j``
        samples with seed ``seed + j``); each finishes as its own
        :class:`RequestOutput` with ``sample_index`` ``j``.

        Raises ValueError / TypeError (and queues nothing) for an empty prompt,
        a prompt longer than ``max_context_len`` tokens, token ids outside the
        vocabulary or not ints, ``max_new_tokens`` < 1, ``n`` outside
        ``[1, max_batch_size]`` (its completions run side by side, one reqid
        each), a seed outside ``[0, 2**63 - n]``, or sampling values out of range.
        """
        self._check_open()
        request = self._new_request(prompt, max_new_tokens, temperature, top_p, seed, n)
        self.scheduler.waiting.append(request)
        return request.request_id

    def _new_request(self, prompt: object, max_new_tokens: object, temperature: object, top_p: object,
                     seed: object, n: object) -> Request:
        """A validated, numbered request; raises (numbering nothing) on bad input."""
        prompt = check_prompt(prompt, self.vocab_size, self.kv.config.max_context_len)
        max_new_tokens = check_count("max_new_tokens", max_new_tokens)
        n = self._check_n(n)
        temperature, top_p = check_sampling(temperature, top_p)
        seed = check_seed(seed, n)
        samplers = generators(n, seed, temperature, self.kv.device)
        request_id = self._next_request_id
        self._next_request_id += 1
        return Request(request_id, prompt, max_new_tokens, temperature, top_p, samplers[0], time.perf_counter(),
                       pending_samples=samplers[1:])

    def _check_n(self, n: object) -> int:
        return check_count("n", n, self.max_batch_size, "max_batch_size")

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or outputs not yet returned by ``step``."""
        return self.scheduler.has_unfinished() or bool(self._undelivered)

    def generate(self, prompts: Iterable[Sequence[int]], max_new_tokens: int | Sequence[int] = 16,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 n: int = 1) -> list[list[int]] | list[list[list[int]]]:
        """Runs every prompt to completion; returns the generated ids per prompt
        (with ``n > 1``: per prompt, a list of ``n`` completions).

        ``max_new_tokens`` is one count for all or one per prompt; with
        sampling, completion ``j`` of prompt ``i`` uses seed ``seed + i * n + j``.
        Every prompt is checked before any is queued. Raises
        :class:`GenerateError` (a RuntimeError) when a request finished with an
        error: the others still ran to the end, and its ``outputs`` has theirs.
        Requests queued by :meth:`add_request` run alongside; those that finish
        meanwhile are returned by the next :meth:`step`.
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
        n = self._check_n(n)
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
        self.scheduler.waiting.extend(requests)
        ids = [r.request_id for r in requests]
        mine = set(ids)
        results: dict[tuple[int, int], RequestOutput] = {}
        others: list[RequestOutput] = []  # requests queued by add_request: the next step() returns them
        try:
            while len(results) < len(ids) * n:
                for out in self.step():
                    if out.request_id in mine:
                        results[out.request_id, out.sample_index] = out
                    else:
                        others.append(out)
        finally:
            self._undelivered[:0] = others
        failed = [out for out in results.values() if out.error]
        bad = {out.request_id for out in failed}
        if n == 1:
            outputs = [None if i in bad else results[i, 0].output for i in ids]
        else:
            outputs = [None if i in bad else [results[i, j].output for j in range(n)] for i in ids]
        if failed:
            failed.sort(key=lambda out: (out.request_id, out.sample_index))
            raise GenerateError(f"request {failed[0].request_id} failed: {failed[0].error}", outputs, failed)
        return outputs

    # ---- one iteration ---------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: admit, map pages (preempting if needed), run the
        model once, sample. Returns the requests that finished in it.

        A KV-cache error (a driver or OS failure) does not escape: the
        iteration's requests are retried in the next one or finish with an
        error (module docstring). Other exceptions (the model's) escape before
        any token is drawn, every request waiting or running as a whole; the
        outputs the iteration had already decided come with the next step.
        When nothing could run because the budget refused the memory, it
        blocks up to ``BUDGET_WAIT_S`` seconds for the budget first."""
        self._check_open()
        finished, self._undelivered = self._undelivered, []
        batch: list[tuple[Request, int]] = []
        try:
            batch = self.scheduler.schedule(finished)
            logits = self._forward(batch) if batch else None
        except ClosedError:
            raise
        except VAttnError as e:
            self.scheduler.failed(e, finished)
            batch = []
        except BaseException:
            self._undelivered = finished
            raise
        else:
            if batch:
                self._advance(batch, logits, finished)
            elif not finished:
                self._wait_for_budget()
        self.iteration += 1
        self._record(batch)
        return finished

    def _wait_for_budget(self) -> None:
        """Nothing ran for want of the budget's memory: blocks (no CPU) until it may have come free,
        or, with only requests over the limit waiting, until the limit may have risen; never past
        the moment the first of those is due to fail."""
        due = self.scheduler.seconds_to_deadline()
        if self.scheduler.budget_wait:  # not another refusal at once: wait for memory to move
            self.kv.wait_for_budget(BUDGET_WAIT_S if due is None else min(BUDGET_WAIT_S, due))
        elif due is not None and not self.scheduler.waiting and not self.scheduler.running:
            time.sleep(min(LIMIT_POLL_S, due))

    def _record(self, batch: list[tuple[Request, int]]) -> None:
        stats = self.kv.stats()
        self.history.append(dict(
            time=time.perf_counter(), running=len(self.running), waiting=len(self.waiting),
            tokens=sum(n for _, n in batch),
            bytes_mapped=stats["bytes_mapped"],  # all of it, pages kept for reuse included
            bytes_in_use=stats["pages_in_use"] * self.kv.page_size,  # distinct pages mapped or held by the prefix cache
            bytes_needed=self.scheduler.bytes_needed(),  # the pages running requests' tokens need
            bytes_used=stats["bytes_used"],  # the tokens of running requests
        ))

    def _forward(self, batch: list[tuple[Request, int]]) -> torch.Tensor:
        """Runs the model once over the batch's new tokens packed into one
        sequence; the logits of each request's last new token, ``[len(batch), vocab]``.
        Changes no request. Waits for nothing on the device: the inputs go
        over in one asynchronous copy, the attention batch's in another."""
        tokens, positions, sample_rows = [], [], []
        for req, n in batch:
            start = req.num_computed
            tokens.extend(req.tokens[start:start + n])
            positions.extend(range(start, start + n))
            sample_rows.append(len(tokens) - 1)
        device = self._input_device
        # planned once for every layer; the plan carries the mapping check built for this cache
        attention = AttentionBatch([r.reqid for r, _ in batch], [r.num_computed for r, _ in batch],
                                   [n for _, n in batch], device=device, cache=self.kv)
        if self.graphs is not None and attention.is_decode:
            logits = self.graphs.run(attention, tokens, positions)
            if logits is not None:
                return logits
        num_tokens = len(tokens)
        inputs = index_tensor(tokens + positions + sample_rows, torch.long, device)
        return self._run_model(self._kernel.plan(attention, self._case), inputs[:num_tokens][None],
                               inputs[num_tokens:2 * num_tokens][None], inputs[2 * num_tokens:])

    def _run_model(self, plan: KernelPlan, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   logits_to_keep: torch.Tensor | int = 0) -> torch.Tensor:
        """The model over ``input_ids`` / ``position_ids`` (``[1, T]``), every
        layer's attention on ``plan``: logits ``[rows, vocab]`` of the rows
        ``logits_to_keep`` names (0: every row)."""
        self._plan = plan
        try:
            with torch.inference_mode():
                return self.model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=logits_to_keep,
                                  use_cache=False).logits[0]
        finally:
            self._plan = None

    def _advance(self, batch: list[tuple[Request, int]], logits: torch.Tensor,
                 finished: list[RequestOutput]) -> None:
        """Commits the iteration: computed counts move on, tokens are appended,
        completions forked, finished requests retired. Every token is drawn
        before anything changes, and the KV-cache calls made here (prefix
        cache, fork, free) recover from their own errors, so no request is
        left half-way."""
        now = time.perf_counter()
        draws = [Draw(row, req.temperature, req.top_p, generator) for row, (req, n) in enumerate(batch)
                 if req.num_computed + n >= req.num_tokens for generator in (req.generator, *req.pending_samples)]
        ids = iter(draw(logits, draws))  # the iteration's one wait for the device
        drawn: list[list[int] | None] = []  # per request: its token, then its pending completions' first
        for req, n in batch:
            if req.num_computed + n < req.num_tokens:
                drawn.append(None)  # a prefill chunk that does not reach the end yet
            else:
                drawn.append([next(ids) for _ in range(1 + len(req.pending_samples))])
        for (req, n), tokens in zip(batch, drawn):
            req.num_computed += n
            req.kv_failures = 0
            if tokens is None:
                continue
            if not req.output:
                self.scheduler.computed(req)  # the prompt is computed
            samples = [req] + self._fork_samples(req, tokens[1:], now, finished)
            req.output.append(tokens[0])
            for done in samples:
                if done.first_token_time is None:
                    done.first_token_time = now
                reason = self._finish_reason(done)
                if reason:
                    self.scheduler.retire(done)
                    finished.append(done.finished(reason))

    def _fork_samples(self, req: Request, first_tokens: list[int], now: float,
                      finished: list[RequestOutput]) -> list[Request]:
        """Completions 1.. of a request whose prompt was just computed, with
        their first tokens (drawn from the prompt's logits): each gets a fork
        of the request's KV (or, when the fork fails, waits to be recomputed
        like a preempted request). Returns the forked ones."""
        forked = []
        for j, (generator, token) in enumerate(zip(req.pending_samples, first_tokens), start=1):
            child = dataclasses.replace(req, generator=generator, output=[token], pending_samples=[], sample_index=j,
                                        preemptions=0, first_token_time=now, reqid=-1, kv_failures=0)
            reason = self._finish_reason(child)
            if reason:  # done with its first token: no KV of its own needed
                finished.append(child.finished(reason))
                continue
            if self.scheduler.fork(req, child):
                forked.append(child)
        req.pending_samples = []
        return forked

    def _finish_reason(self, req: Request) -> str | None:
        if req.output[-1] in self.eos_token_ids:
            return "eos"
        if len(req.output) >= req.max_new_tokens:
            return "length"
        if req.num_tokens > self.kv.config.max_context_len:
            return "context"  # the next token would need a row past max_context_len
        return None

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
        out = self._kernel.run(self._plan, query[0].transpose(0, 1), k_cache, v_cache, key[0].transpose(0, 1),
                               value[0].transpose(0, 1), softmax_scale=scaling)
        return out.unsqueeze(0), None

    # ---- lifetime ------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The cache's stats plus iteration and preemption counts and, with
        ``prefix_cache``, its queries, tokens looked up and tokens hit.
        ``kv_errors``: KV-cache exceptions the engine recovered from;
        ``attention_kernel``: the name of the kernel every layer runs;
        ``decode_graph_replays``: decode iterations replayed from CUDA graphs
        (None when the engine captures none)."""
        self._check_open()
        out = dict(self.kv.stats(), iterations=self.iteration, preemptions=self.preemptions,
                   running=len(self.running), waiting=len(self.waiting), kv_errors=self.scheduler.kv_errors,
                   attention_kernel=self._kernel.name,
                   decode_graph_replays=None if self.graphs is None else self.graphs.replays)
        if self.prefix_cache is not None:
            pc = self.prefix_cache
            out.update(prefix_cache_queries=pc.queries, prefix_cache_query_tokens=pc.query_tokens,
                       prefix_cache_hit_tokens=pc.hit_tokens, prefix_cache_entries=len(pc.entries),
                       prefix_cache_evictions=pc.evictions)
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
