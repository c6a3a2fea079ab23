"""The engine core's waits under a budget (docs/elastic.md "Liveness", docs/vllm.md
"Under a budget"): the budget's current limit decides, and no wait is unbounded.

- **Over the limit.** A waiting request whose blocks alone (every KV cache
  group, with the padding block when this engine created one) exceed the
  budget's current limit can never run while the limit stays: it is set
  aside, out of vLLM's waiting queue, so the requests behind it are
  scheduled past it (vLLM's queue stops at the first request it cannot
  allocate). It goes back to the head of the queue as soon as the limit
  fits it, and after ``VATTN_BUDGET_WAIT_S`` seconds (default 30) without
  that it finishes with vLLM's ``FINISHED_ERROR`` (the reason, naming the
  limit and what it needs, is the output's ``stop_reason``, the API
  server's answer, status 400, and a warning in the engine core's log).
  A request preempted past the limit (it grew) is set aside at the next
  step. While requests wait set aside the keeper renews a wait for the
  largest one's bytes, which ``python -m vattn top`` shows.
- **Idle while refused.** When a step scheduled nothing because the budget
  refused the blocks (nothing running, requests waiting), the engine core
  does not step again until something may have changed: the waiting queue,
  the limit, the budget's free bytes, or a request set aside becoming due.
  vLLM's engine-core process then blocks on its input queue as with nothing
  to run; the keeper thread renews the recorded wait (so other members keep
  giving memory back) and wakes it through the queue. With the engine core
  in the caller's process a step blocks on the budget's futex instead.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from vattn.budget.membership import WAIT_ENV_VAR, budget_wait_seconds

RENEW_S = 0.5  # how often the keeper renews a recorded wait: within the budget's 1 s expiry
IDLE_WAIT_S = 0.25  # the longest one block on the budget's futex, with the engine core in the caller's process
REASON_PREFIX = "vattn: budget "  # how a request's error reason over the limit begins
LIMIT_POLL_S = 0.1  # between looks at the limit while only requests over it wait, in the caller's process


class BudgetWaits:
    """The waits of one engine core's scheduler under a budget.

    ``budget``, ``member``: the budget and the engine core's membership.
    ``blocks_alone(tokens)``: the blocks one request of ``tokens`` tokens needs on its own.
    ``block_bytes``: a block on every rank; ``padding_bytes``: what this
    engine's padding block holds (0 when no worker created one).
    ``clock``: seconds, monotonic (``time.monotonic``; a test passes its own).
    """

    def __init__(self, scheduler: Any, budget: Any, member: Any, blocks_alone: Callable[[int], int],
                 block_bytes: int, padding_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.scheduler = scheduler
        self.budget = budget
        self.member = member
        self.blocks_alone = blocks_alone
        self.block_bytes = block_bytes
        self.padding_bytes = padding_bytes
        self.wait_s = budget_wait_seconds()
        self.over_limit: dict[str, tuple[Any, float]] = {}  # request id -> (request, when set aside)
        self.failed: list[tuple[Any, str]] = []  # finished in schedule, reported by update_from_output
        self.refused = 0  # bytes of the last allocation the budget refused in this step (0: none)
        self.idle_since: tuple | None = None  # what the engine saw when it went idle waiting for the budget
        self.want = 0  # bytes the idle engine's wait is for
        self.renewed = 0.0
        self.over_limit_renewed = 0.0  # when the keeper last renewed the wait of the requests set aside (0: not)
        self.counters = dict(requests_over_limit=0, requests_failed_over_limit=0, idle_waits=0)

    def need_bytes(self, request: Any) -> int:
        """Bytes ``request`` needs in the budget on its own, the padding block included."""
        return self.bytes_alone(request.num_tokens)

    def bytes_alone(self, tokens: int) -> int:
        return self.blocks_alone(tokens) * self.block_bytes + self.padding_bytes

    def start_up_warning(self, max_model_len: int) -> str | None:
        """At start-up: a limit that cannot hold one request of ``max_model_len`` tokens alone is said,
        with the numbers (such requests wait for the limit to rise, then fail). Returns the warning."""
        need, limit = self.bytes_alone(max_model_len), self.budget.limit
        if need <= limit:
            return None
        fits = max(t for t in range(0, max_model_len + 1, 16) if t == 0 or self.bytes_alone(t) <= limit)
        text = (f"vattn: budget '{self.budget.name}' (limit {limit} bytes) cannot hold one request of "
                f"max-model-len {max_model_len} tokens: that needs {need} bytes ({self.blocks_alone(max_model_len)} "
                f"blocks of {self.block_bytes} bytes on every rank, and {self.padding_bytes} bytes of padding); "
                f"requests longer than about {fits} tokens wait up to {self.wait_s:g} s ({WAIT_ENV_VAR}) for the "
                f"limit to rise, then fail. Raise the limit (python -m vattn budget set {self.budget.name} "
                f"--limit ...) or lower --max-model-len")
        _log().warning("%s", text)
        return text

    # ---- requests over the limit -----------------------------------------------------------

    def before_schedule(self) -> None:
        """Sets aside the waiting requests over the current limit, returns those that fit again and
        finishes those whose wait is up. Caller holds the pool's lock. Raises ``BudgetError`` when the
        limit cannot be read (the pool then gives every request back with :meth:`give_back`)."""
        waiting = self.scheduler.waiting
        if not self.over_limit and not waiting:
            return
        limit = self.budget.limit
        now = self.clock()
        back, due = [], []
        for rid, (request, since) in list(self.over_limit.items()):
            if self.need_bytes(request) <= limit:
                back.append(request)
            elif now - since >= self.wait_s:
                due.append(request)
            else:
                continue
            del self.over_limit[rid]
        aside = [r for r in waiting if self.need_bytes(r) > limit]
        if aside:
            waiting.remove_requests(aside)
            for request in aside:
                self.over_limit[request.request_id] = (request, now)
                self.counters["requests_over_limit"] += 1
                _log().warning(
                    "vattn: request %s needs %d bytes of budget '%s' alone (%d tokens), over its limit of %d "
                    "bytes: it waits up to %g s (%s) for the limit to rise; the requests behind it run",
                    request.request_id, self.need_bytes(request), self.budget.name, request.num_tokens, limit,
                    self.wait_s, WAIT_ENV_VAR)
        if back:
            waiting.prepend_requests(sorted(back, key=lambda r: r.arrival_time, reverse=True))
        if due:
            from vllm.v1.request import RequestStatus

            for request in due:
                reason = (f"{REASON_PREFIX}'{self.budget.name}': this request needs {self.need_bytes(request)} "
                          f"bytes ({request.num_tokens} tokens) alone, more than the budget's limit of {limit} "
                          f"bytes, and the limit did not rise within {self.wait_s:g} s ({WAIT_ENV_VAR}); raise "
                          f"the limit (python -m vattn budget set {self.budget.name} --limit ...) or send less")
                _log().warning("%s (request %s)", reason, request.request_id)
                self.failed.append((request, reason))
                self.counters["requests_failed_over_limit"] += 1
            waiting.prepend_requests(due)  # where finish_requests takes a waiting request from
            self.scheduler.finish_requests([r.request_id for r in due], RequestStatus.FINISHED_ERROR)

    def report_failed(self, outputs: dict) -> None:
        """In ``update_from_output``: the requests finished over the limit, as error outputs to their
        clients (``outputs``: its result, by client index)."""
        if not self.failed:
            return
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

        for request, reason in self.failed:
            eco = outputs.get(request.client_index)
            if eco is None:
                eco = outputs[request.client_index] = EngineCoreOutputs()
            eco.outputs.append(EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                                finish_reason=FinishReason.ERROR, stop_reason=reason,
                                                events=request.take_events(), trace_headers=request.trace_headers))
        self.failed = []

    def take_back(self, request_ids: Any) -> None:
        """Before ``finish_requests``: requests set aside that it names go back to the waiting queue, where
        vLLM finishes (aborts) a waiting request from."""
        if not self.over_limit:
            return
        ids = self.over_limit.keys() if request_ids is None else \
            ((request_ids,) if isinstance(request_ids, str) else request_ids)
        named = [self.over_limit.pop(rid)[0] for rid in list(ids) if rid in self.over_limit]
        if named:
            self.scheduler.waiting.prepend_requests(named)

    def give_back(self) -> None:
        """Every request set aside back to the queue (the budget can no longer be read)."""
        self.take_back(None)

    def due(self) -> bool:
        """A request set aside fits the limit now or its wait is up: the engine must step."""
        if not self.over_limit:
            return False
        limit = self.budget.limit
        now = self.clock()
        return any(self.need_bytes(r) <= limit or now - since >= self.wait_s
                   for r, since in self.over_limit.values())

    def seconds_to_due(self) -> float:
        """Seconds until the first request set aside is due to fail (inf when none is)."""
        if not self.over_limit:
            return float("inf")
        return max(0.0, min(since for _, since in self.over_limit.values()) + self.wait_s - self.clock())

    # ---- idle while the budget refuses -------------------------------------------------------

    def _view(self) -> tuple:
        """What a step's outcome depends on, from the budget's side and the queue's."""
        return len(self.scheduler.waiting), self.budget.limit, self.budget.available_bytes

    def after_schedule(self, scheduled_tokens: int) -> None:
        """After ``schedule``: nothing scheduled because the budget refused (nothing running, requests
        waiting): the engine idles until something changes."""
        refused, self.refused = self.refused, 0
        if scheduled_tokens or self.scheduler.running or not self.scheduler.waiting or not refused:
            self.idle_since = None
            return
        limit = self.budget.limit
        if any(self.need_bytes(r) > limit for r in self.scheduler.waiting):
            # preempted in this step past the limit (it grew to need more than the limit alone): the next
            # step sets it aside and its bounded wait starts; idling here would leave it in the queue until
            # something else moved
            self.idle_since = None
            return
        if self.idle_since is None:
            self.counters["idle_waits"] += 1
        self.idle_since = self._view()
        self.want = refused
        self.renewed = time.monotonic()

    def idle(self) -> bool:
        """The engine waits for the budget and nothing it depends on moved: no step would schedule more."""
        if self.idle_since is None or self.scheduler.running or self.scheduler.has_finished_requests():
            return False
        if self._view() != self.idle_since:
            self.idle_since = None
            return False
        return True

    def keeper_tick(self) -> bool:
        """From the keeper thread, under the pool's lock: renews an idle engine's wait (every
        ``RENEW_S``) and says whether the engine must be woken: memory came free, the limit or the
        queue moved, or a request set aside is due."""
        if self.idle_since is not None:
            if not self.idle():
                return True
            if time.monotonic() - self.renewed >= RENEW_S:
                self.renewed = time.monotonic()
                if self.member.try_grant(self.want):  # it would fit now: no grant needed, a step
                    self.member.release(self.want)
                    self.idle_since = None
                    return True
        self.renew_over_limit()
        return self.due()

    def renew_over_limit(self) -> None:
        """From the keeper: requests set aside over the limit wait too. Every ``RENEW_S`` the largest one's
        need is asked of the budget as this member's wait, so ``python -m vattn top`` shows the engine
        waiting, and for how long, until they run or fail (the other members see it as pressure, as any
        wait). Refused while the limit stays below it; granted, the limit rose: the grant goes straight
        back and the next step takes the request back. Once none is set aside the wait is cleared."""
        if not self.over_limit:
            if self.over_limit_renewed:
                self.over_limit_renewed = 0.0
                if self.idle_since is None:
                    self.member.clear_wait()
            return
        if time.monotonic() - self.over_limit_renewed < RENEW_S:
            return
        self.over_limit_renewed = time.monotonic()
        need = max(self.need_bytes(request) for request, _ in self.over_limit.values())
        if self.member.try_grant(need):
            self.member.release(need)

    def block(self) -> None:
        """With the engine core in the caller's process (stepped in a loop): before a step, blocks while
        the engine waits for the budget (on its futex) or only requests over the limit wait (sleeping),
        never past the first one's due time."""
        if self.idle():
            self.member.wait_for_memory(min(IDLE_WAIT_S, self.seconds_to_due()))
        elif self.over_limit and not self.scheduler.waiting and not self.scheduler.running and not self.due():
            time.sleep(min(LIMIT_POLL_S, self.seconds_to_due()))

    def stats(self) -> dict[str, Any]:
        return dict(self.counters, requests_waiting_over_limit=len(self.over_limit), budget_wait_s=self.wait_s)


def over_limit_reason(output: Any) -> str | None:
    """In the API server's process: the reason a finished ``RequestOutput`` carries when the engine core
    finished it over the budget's limit (its ``stop_reason``, set by :meth:`BudgetWaits.before_schedule`),
    else None."""
    if not output.finished:
        return None
    for completion in output.outputs:
        reason = completion.stop_reason
        if completion.finish_reason == "error" and isinstance(reason, str) and reason.startswith(REASON_PREFIX):
            return reason
    return None


def over_limit_error(reason: str) -> Exception:
    """The exception vLLM's API server answers with the reason itself, as status 400 (the request alone
    exceeds what the server may hold now, as a prompt longer than ``--max-model-len`` does): vLLM's own
    answer to an error finish is status 500 "Internal server error", without the reason, and clients such
    as ``openai`` send a request answered 500 again, each time waiting out the bounded wait."""
    from http import HTTPStatus

    from vllm.exceptions import GracefulHTTPError

    return GracefulHTTPError(reason, HTTPStatus.BAD_REQUEST)


def has_requests(pool: Any, stock: bool) -> bool:
    """``Scheduler.has_requests`` under a budget (``pool``: the scheduler's ``BudgetedBlockPool``, None
    outside one; ``stock``: vLLM's answer): releases to carry and requests set aside that are due (fit
    now, or their wait is up) make the engine step; an engine idle while the budget refuses, with
    nothing it depends on moved, does not (the keeper wakes it)."""
    if pool is None:
        return stock
    if pool.has_pending():
        return True
    if pool.detached:
        return stock
    with pool.lock:
        if pool.waits.over_limit and pool.guarded(pool.waits.due):
            return True
        return stock and not pool.guarded(pool.waits.idle)


def block_before_step(pool: Any) -> None:
    """``EngineCore.step`` with the engine core in the caller's process (no input queue to wake it, so
    ``pool.wake`` is None): blocks while the engine waits for the budget, instead of the caller stepping
    in a loop."""
    if pool is not None and pool.wake is None and not pool.detached:
        pool.guarded(pool.waits.block)


def _log() -> Any:
    from vllm.logger import init_logger

    return init_logger("vllm.vattn")
