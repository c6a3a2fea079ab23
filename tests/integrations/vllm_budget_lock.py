"""vLLM's scheduler under vattn's budget hooks while another process holds the budget's lock past its
``lock_timeout_s`` (a stopped or stuck process), in one process without a model (run by
tests/integrations/test_vllm_budget.py in vLLM's environment, which holds and frees the lock when
this script asks, over stdin and stdout).

Prints ``hold`` and waits for a line (the lock is held then), ``let go`` and waits again (it is free
then), and last one JSON line: each stage's scheduled requests, the budget's bytes held and the pool's
counters.

``python vllm_budget_lock.py MODEL BUDGET``: BUDGET exists with room for 6 blocks.
"""

from __future__ import annotations

import json
import sys
import time

from vllm_scheduler_budget import BLOCK, make_config, make_scheduler, step  # the script's own folder

BLOCK_BYTES = BLOCK * 1024  # the test model: 1 KiB a token
LOCK_TIMEOUT_S = 0.3


def tell(line: str) -> None:
    """Says ``line`` to the test and waits for its answer."""
    print(line, flush=True)
    sys.stdin.readline()


def main(model: str, name: str) -> dict:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    import vattn
    from vattn.integrations.vllm.engine_attach import POOL_ATTRIBUTE
    from vattn.integrations.vllm.engine_budget import BudgetedBlockPool
    from vattn.integrations.vllm.hooks import install_hooks

    install_hooks()
    scheduler = make_scheduler(make_config(model), 64)
    budget = vattn.Budget.attach(name, lock_timeout_s=LOCK_TIMEOUT_S)
    pool = BudgetedBlockPool(scheduler, budget.join("vllm sim"), budget, BLOCK_BYTES, 1, idle_release_s=1e9)
    setattr(scheduler, POOL_ATTRIBUTE, pool)
    stages: dict[str, dict] = {}
    added: list[str] = []

    def note(stage: str, scheduled: list[list[str]]) -> None:
        stats = pool.stats()
        stages[stage] = dict(scheduled=scheduled, held=budget.held_bytes, detached=stats["detached"],
                             unreturned=stats["unreturned_bytes"], lock_timeouts=stats["lock_timeouts"],
                             finished=sorted(r for r in ("first", "second", "third") if r not in scheduler.requests
                                             and r in added))

    def request(rid: str, blocks: int, max_tokens: int) -> None:
        # the prompt and every token decoded fit in ``blocks`` blocks: only admission asks the budget
        scheduler.add_request(Request(rid, [3 + i % 200 for i in range(blocks * BLOCK - max_tokens - 4)],
                                      SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), None,
                                      arrival_time=0.0))
        added.append(rid)

    try:
        request("first", 4, 8)
        note("first admitted", [step(scheduler)])
        tell("hold")
        request("second", 3, 2)  # 3 blocks without pages: a grant the stuck lock cannot give
        note("second waits", [step(scheduler)])
        steps = [step(scheduler) for _ in range(10)]  # first ends; second runs on its blocks, which have pages
        note("second on first's blocks", steps)
        with pool.lock:
            pool.release(None)  # every free block's pages back: uncharged at the next step's output
        note("released", [step(scheduler)])
        tell("let go")
        deadline = time.monotonic() + 20
        while (pool.stats()["unreturned_bytes"] or pool.member.stalled) and time.monotonic() < deadline:
            time.sleep(0.05)  # the keeper finds the lock free and gives the owed bytes back
        note("lock free", [])
        request("third", 5, 2)  # beyond what has pages: charged to the budget again
        note("third admitted", [step(scheduler)])
    finally:
        stats = pool.stats()
        pool.close()
    return dict(stages=stages, held_after_close=budget.held_bytes, detached=stats["detached"])


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
