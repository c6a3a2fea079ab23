"""One vLLM engine under a budget, run by tests/integrations/test_vllm_budget.py in vLLM's environment
(``VATTN_VLLM``, ``VATTN_BUDGET`` and ``VATTN_BUDGET_WAIT_S`` set by the caller). Prints one JSON line.

``python vllm_budget_waits.py MODE MODEL`` with MODE:

- ``over-limit``: a request whose blocks alone exceed the budget's limit, then three that fit; when
  each finished (seconds after they were added), with what reason; then idle, the bytes the budget holds
  for the engine against those its worker created.
- ``idle-wait``: every byte of the budget held by another member for ``HOLD_S`` seconds while one
  request waits; the CPU time of this process and its descendants (engine core, worker) while it waits
  (from ``SETTLE_S`` after it was added, when vLLM's worker has stopped polling its queue as it does for
  1 s after any step, to 0.5 s before the memory comes back).
- ``removed`` / ``truncated``: the budget removed (``rm --force``) or its segment truncated 0.5 s after
  12 requests were added; when that was, every request's finish reason and end, the engine core's
  budget counters.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from workloads.vllm_scenario import budget_stats, greedy, make_llm  # noqa: E402

ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=4, block_size=32, enable_prefix_caching=False)
HOLD_S = 5.0
SETTLE_S = 1.5


def prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 31) % 250 for i in range(n)]


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user and system) of this process and each of its descendants (vLLM's engine core
    and worker processes in its default layout), by pid."""
    import psutil

    me = psutil.Process()
    out = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[f"{p.pid} {p.name()}"] = t.user + t.system
    return out


def run_requests(llm, prompts: list[list[int]], max_tokens: int) -> dict[str, tuple[str, float, object]]:
    """Adds every prompt at once and steps the engine: per request id, (finish reason, seconds from the
    start to its end, stop_reason)."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    start = time.monotonic()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), greedy(max_tokens))
    done: dict[str, tuple[str, float, object]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.finish_reason, time.monotonic() - start, c.stop_reason)
    return done


def main(mode: str, model: str) -> dict:
    import vattn

    budget = vattn.Budget.attach(os.environ["VATTN_BUDGET"])
    llm = make_llm(model, ENGINE)
    result: dict = dict(mode=mode)
    if mode == "over-limit":
        # 200 + 8 tokens: 7 blocks, over a limit of 5; 20 + 8 tokens: 1 block each
        done = run_requests(llm, [prompt(200, 0), prompt(20, 1), prompt(20, 2), prompt(20, 3)], 8)
        result["requests"] = done
        time.sleep(float(os.environ.get("VATTN_VLLM_IDLE_RELEASE_S", "1")) + 1.5)  # idle: free blocks go back
        result["budget"] = budget_stats(llm)
        result["bytes_created"] = [s["bytes_created"] for s in llm.collective_rpc("vattn_stats")]
        result["held_bytes"] = budget.usage().held_bytes
    elif mode == "idle-wait":
        run_requests(llm, [prompt(20, 1)], 4)  # warm
        deadline = time.monotonic() + 10
        while budget.held_bytes and time.monotonic() < deadline:  # idle release: the engine holds nothing
            time.sleep(0.05)
        hog = budget.join("hog")
        assert hog.try_grant(budget.limit), budget.usage()
        threading.Timer(HOLD_S, hog.leave).start()
        t0 = time.monotonic()
        done: dict = {}
        waiting = threading.Thread(target=lambda: done.update(run_requests(llm, [prompt(60, 4)], 4)))
        waiting.start()
        time.sleep(SETTLE_S)  # refused, the engine core idles; vLLM's worker polls its queue 1 s after a step
        cpu0, w0 = cpu_seconds(), time.monotonic()
        time.sleep(HOLD_S - SETTLE_S - 0.5)  # still waiting: the hog holds the budget until HOLD_S
        cpu1, w1 = cpu_seconds(), time.monotonic()
        # what `python -m vattn top` shows for the engine: how long it has waited (its first refusal on)
        result["waited_s"] = [m.waiting_seconds for m in budget.usage().members if m.label.startswith("vllm")]
        waiting.join()
        result["wall_s"], result["window_s"] = time.monotonic() - t0, w1 - w0
        result["cpu_s"] = {p: cpu1[p] - cpu0.get(p, 0.0) for p in cpu1}  # in the window, by process
        result["requests"] = done
        result["budget"] = budget_stats(llm)
    else:
        start = time.monotonic()

        def damage() -> None:
            time.sleep(0.5)
            if mode == "removed":
                vattn.budget.remove(budget.name, force=True)
            else:
                os.truncate(f"/dev/shm/vattn-budget-{budget.name}", 64)
            result["damaged_s"] = time.monotonic() - start

        threading.Thread(target=damage).start()
        result["requests"] = run_requests(llm, [prompt(40 + 5 * i, i) for i in range(12)], 150)
        result["budget"] = budget_stats(llm)
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
