"""One engine of the two-engine budget scenario
(tests/budget/test_engine_budget.py), in a process of its own: a tiny random
Llama generates a workload greedily in fp32 without a budget, then, started
together with the other engine, under the shared budget.

It says ``ready``, waits for a line, serves until two of its requests are
decoding with a page crossing ahead of each (or 3 s passed), gives its free
pages back, says ``paused N`` (N such requests) and waits for a line: the test lowers the budget's limit
then. It serves to the end, saying ``preempted N`` each time its preemption
count grows, and prints one JSON line."""

from __future__ import annotations

import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vattn.engine import Engine

VOCAB, PAGE = 96, 4096
PAGE_TOKENS = PAGE // (2 * 16 * 4)  # 2 kv heads of 16 fp32 values a token: 32 tokens a page


def crossing_ahead(engine: Engine) -> int:
    """Running requests past their prompt with a page crossing before they finish: each will ask the
    budget for a page while it still runs."""
    return sum(1 for r in engine.running if r.output and r.max_new_tokens - len(r.output) > PAGE_TOKENS)


def main(budget: str, seed: int) -> None:
    torch.set_num_threads(1)  # two engines share the machine
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(20, 60, (8,), generator=g)]
    news = torch.randint(40, 60, (8,), generator=g).tolist()  # more than a page of new tokens each
    options = dict(max_batch_size=4, max_context_len=128, page_size=PAGE)
    with Engine(model, budget=False, **options) as alone:
        expected = alone.generate(prompts, max_new_tokens=news)
    print("ready", flush=True)
    sys.stdin.readline()  # both engines start together
    with Engine(model, budget=budget, idle_release_s=0.2, **options) as engine:
        ids = [engine.add_request(p, n) for p, n in zip(prompts, news)]
        outputs = {}
        preemptions = 0

        def serve_while(more) -> None:
            nonlocal preemptions
            while engine.has_unfinished() and more():
                for out in engine.step():
                    outputs[out.request_id] = out.output
                if engine.preemptions > preemptions:
                    preemptions = engine.preemptions
                    print(f"preempted {preemptions}", flush=True)

        until = time.monotonic() + 3.0
        serve_while(lambda: crossing_ahead(engine) < 2 and time.monotonic() < until)
        # Free pages go back first (what idle_release_s does after 0.2 s): a crossing after the pause then
        # needs a page the budget must grant, not one the engine still holds.
        engine.kv.reclaim_freed(wait=True)
        engine.kv.release_free_memory()
        print(f"paused {crossing_ahead(engine)}", flush=True)
        sys.stdin.readline()
        serve_while(lambda: True)
        stats = engine.stats()
        print(json.dumps({"equal": [outputs.get(i) for i in ids] == expected, "preemptions": stats["preemptions"],
                          "refused": stats["creations_refused"], "failed_steps": stats["failed_steps"],
                          "label": engine.kv.budget_share() and engine.kv.budget.usage().members[0].label}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
