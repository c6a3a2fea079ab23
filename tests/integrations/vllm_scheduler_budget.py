"""vLLM's scheduler under vattn's budget hooks, in one process without a model (run by
tests/integrations/test_vllm_budget.py in vLLM's environment): random limits, request sizes, arrivals
and limit changes on a simulated clock, every request one token long (it ends with its prefill).
Prints one JSON line: per run, the arrivals (iteration, prompt tokens), the limit at each iteration and
each request's outcome (finish reason, iteration), which the test checks against its reference.

``python vllm_scheduler_budget.py MODEL BUDGET RUNS``
"""

from __future__ import annotations

import json
import random
import sys

BLOCK = 32
STEP_S = 0.1
WAIT_S = 3.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_config(model: str):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, dtype="float32", max_model_len=256, max_num_seqs=4, block_size=BLOCK,
                      enable_prefix_caching=False, skip_tokenizer_init=True, enforce_eager=True).create_engine_config()


def make_scheduler(config, num_blocks: int):
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config.cache_config.num_gpu_blocks = num_blocks  # what the engine core sets after profiling
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(["layers.0", "layers.1"], spec)])
    return Scheduler(config, kv_config, StructuredOutputManager(config), block_size=BLOCK)


def step(scheduler) -> list[str]:
    """One schedule and its output: a token for every request past its prompt. Returns the ids scheduled."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    tokens = [[7] if scheduler.requests[rid].num_computed_tokens + out.num_scheduled_tokens[rid]
              >= scheduler.requests[rid].num_prompt_tokens else [] for rid in ids]
    scheduler.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                        sampled_token_ids=tokens))
    return ids


def simulate(config, budget, block_bytes: int, arrivals, limits, iterations: int) -> dict[str, list]:
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from vattn.integrations.vllm.engine_attach import POOL_ATTRIBUTE
    from vattn.integrations.vllm.engine_budget import BudgetedBlockPool

    scheduler = make_scheduler(config, 64)
    clock = Clock()
    member = budget.join("vllm sim")
    pool = BudgetedBlockPool(scheduler, member, budget, block_bytes, 1, idle_release_s=1e9)
    pool.waits.clock = clock
    setattr(scheduler, POOL_ATTRIBUTE, pool)
    outcome: dict[str, list] = {}
    try:
        for it in range(iterations):
            clock.now = it * STEP_S
            if it in limits:
                budget.set_limit(limits[it])
            for rid, (at, tokens) in enumerate(arrivals):
                if at == it:
                    scheduler.add_request(Request(str(rid), [3 + (rid + i) % 200 for i in range(tokens)],
                                                  SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                                                  None, arrival_time=clock.now))
            out = scheduler.schedule()
            ids = [rid for rid in out.num_scheduled_tokens]
            done = [[7] if scheduler.requests[rid].num_computed_tokens + out.num_scheduled_tokens[rid]
                    >= scheduler.requests[rid].num_prompt_tokens else [] for rid in ids]
            result = scheduler.update_from_output(out, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=done))
            for eco in result.values():
                for o in eco.outputs:
                    if o.finish_reason is not None:
                        assert o.request_id not in outcome, f"request {o.request_id} finished twice"
                        outcome[o.request_id] = [str(o.finish_reason), it, o.stop_reason]
    finally:
        pool.close()
    return outcome


def main(model: str, budget_name: str, runs: int) -> list[dict]:
    import vattn
    from vattn.integrations.vllm.hooks import install_hooks

    install_hooks()
    config = make_config(model)
    budget = vattn.Budget.attach(budget_name)
    block_bytes = BLOCK * 1024  # the test model: 1 KiB a token
    results = []
    for seed in range(runs):
        rng = random.Random(seed)
        n = rng.randint(3, 8)
        arrivals = [(rng.randint(0, 30), rng.randint(1, 200)) for _ in range(n)]
        changes = sorted(rng.sample(range(0, 60), rng.randint(1, 4)))
        limits = {it: rng.randint(1, 7) * block_bytes + rng.choice((0, 0, block_bytes // 2)) for it in changes}
        iterations = changes[-1] + round(WAIT_S / STEP_S) + n + 8
        budget.set_limit(8 * block_bytes)
        history = []  # the limit in force at every iteration
        current = 8 * block_bytes
        for it in range(iterations):
            current = limits.get(it, current)
            history.append(current)
        outcome = simulate(config, budget, block_bytes, arrivals, limits, iterations)
        results.append(dict(arrivals=arrivals, history=history, last_change=changes[-1], outcome=outcome))
    return results


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))), flush=True)
