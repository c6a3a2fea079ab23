"""The reference model of bounded budget waits (docs/elastic.md "Liveness"), shared by the property
tests of vattn's engine scheduler (tests/budget/test_scheduler_budget_wait.py) and of vLLM's scheduler
under vattn's hooks (tests/integrations/test_vllm_budget.py).

A run: requests arrive at iterations, each needing a fixed number of bytes alone (it ends in the
iteration it runs); the budget's limit is set at some iterations and stays after the last change. The
reference says, from the limit's history alone, what every request's outcome must be."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def over_stretch_start(need: int, history: Sequence[int], since: int, until: int) -> int | None:
    """The first iteration of the stretch of iterations over the limit that reaches ``until``
    (inclusive), starting no earlier than ``since``; None when ``until`` is within the limit."""
    if need <= history[until]:
        return None
    start = until
    while start > since and need > history[start - 1]:
        start -= 1
    return start


def check_outcomes(arrivals: Sequence[tuple[int, int]], history: Sequence[int], outcome: dict,
                   last_change: int, need_bytes: Callable[[int], int], wait_iterations: int,
                   failed: str, finished: str) -> None:
    """``arrivals``: (iteration, tokens) by request id; ``history``: the limit at every iteration;
    ``outcome``: request id -> (reason, iteration, ...); ``failed`` / ``finished``: the reasons a
    request over the limit fails with and a request that ran finishes with.

    - A request fails only after ``wait_iterations`` iterations over the limit in a row ending at its
      failure (never early), and at most one iteration later than that (on time).
    - A request that ran, ran within the limit in force then.
    - A request over the final limit that has not ended is not due yet.
    - A request within the final limit ends (ran or failed earlier) within a few iterations (one per
      request, and two more) of the last change or of its arrival, whatever waits over the limit
      ahead of it: nothing holds it up for the wait."""
    iterations = len(history)
    n = len(arrivals)
    for rid, (at, tokens) in enumerate(arrivals):
        need = need_bytes(tokens)
        got = outcome.get(rid)
        if got is not None and got[0] == failed:
            start = over_stretch_start(need, history, at, got[1])
            assert start is not None and got[1] - start >= wait_iterations, (rid, tokens, got, start)
            assert got[1] - start <= wait_iterations + 1, (rid, got, start)
            continue
        if got is not None:
            assert got[0] == finished and need <= history[got[1]], (rid, tokens, got, history[got[1]])
        if need > history[-1]:
            if got is None:
                start = over_stretch_start(need, history, at, iterations - 1)
                assert start + wait_iterations + 1 >= iterations, (rid, tokens, start, history[-1])
            continue
        bound = max(last_change, at) + n + 2
        assert got is not None and got[1] <= bound, (rid, tokens, got, bound, history[-1])
