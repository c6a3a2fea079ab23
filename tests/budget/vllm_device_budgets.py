"""vLLM's scheduler under vattn's budget hooks, its blocks charged to two GPUs' budgets (two tensor
parallel ranks, one on each device), in one process without a model (run by
tests/budget/test_device_budgets.py in vLLM's environment). Prints one JSON line: what each device's
budget held and waited for after each stage, and the pool's counters.

``python vllm_device_budgets.py MODEL NAME``: NAME's per-device budgets exist for UUID_A and UUID_B.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
from vllm_scheduler_budget import BLOCK, make_config, make_scheduler, step  # noqa: E402

UUID_A = "GPU-0a0a0a0a-1111-2222-3333-aaaaaaaaaaaa"
UUID_B = "GPU-0b0b0b0b-1111-2222-3333-bbbbbbbbbbbb"
RANK_BLOCK_BYTES = BLOCK * 512  # the test model's 1 KiB a token, half on each rank


def main(model: str, name: str) -> dict:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from vattn.budget.devices import join_devices
    from vattn.integrations.vllm.engine_attach import POOL_ATTRIBUTE
    from vattn.integrations.vllm.engine_budget import BudgetedBlockPool
    from vattn.integrations.vllm.hooks import install_hooks

    install_hooks()
    scheduler = make_scheduler(make_config(model), 64)
    member = join_devices(name, {UUID_A: RANK_BLOCK_BYTES, UUID_B: RANK_BLOCK_BYTES}, "vllm sim tp2")
    pool = BudgetedBlockPool(scheduler, member, member.budget, member.unit_bytes, 2, idle_release_s=1e9)
    setattr(scheduler, POOL_ATTRIBUTE, pool)
    budget_a, budget_b = (share.budget for share in member.shares)
    stages: dict[str, dict] = {}

    def note(stage: str, scheduled: list[str]) -> None:
        ua, ub = budget_a.usage(), budget_b.usage()
        stages[stage] = dict(held=[ua.held_bytes, ub.held_bytes], waiting=[ua.waiting_bytes, ub.waiting_bytes],
                             scheduled=sorted(scheduled))

    def request(rid: str, blocks: int, max_tokens: int) -> Request:
        return Request(rid, [3 + i % 200 for i in range(blocks * BLOCK - 4)],
                       SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), None, arrival_time=0.0)

    try:
        scheduler.add_request(request("first", 4, 3))
        note("first admitted", step(scheduler))  # 4 blocks: each device charged its rank's half of each
        budget_b.set_limit(5 * RANK_BLOCK_BYTES)  # room for 1 more block on B, plenty on A
        scheduler.add_request(request("second", 3, 1))
        note("second refused", step(scheduler))  # A has room, B does not: nothing granted on either
        step(scheduler)  # first's last token: its blocks come free, with their pages
        note("second admitted", step(scheduler))
        with pool.lock:
            pool.release(None)  # every free block's pages back; uncharged when the next step's output is in
        note("released", step(scheduler))
    finally:
        stats = pool.stats()
        pool.close()
    return dict(stages=stages, grants_undone=stats["grants_undone"], held_by_device=stats["held_by_device"])


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
