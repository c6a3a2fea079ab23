"""One engine of the two-engine budget scenario
(tests/budget/test_engine_budget.py), in a process of its own: a tiny random
Llama generates a workload greedily in fp32 without a budget, then, started
together with the other engine, under the shared budget. Prints one JSON line."""

from __future__ import annotations

import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vattn.engine import Engine

VOCAB, PAGE = 96, 4096


def main(budget: str, seed: int) -> None:
    torch.set_num_threads(1)  # two engines share the machine
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(20, 60, (8,), generator=g)]
    news = torch.randint(10, 30, (8,), generator=g).tolist()
    options = dict(max_batch_size=4, max_context_len=128, page_size=PAGE)
    with Engine(model, budget=False, **options) as alone:
        expected = alone.generate(prompts, max_new_tokens=news)
    print("ready", flush=True)
    sys.stdin.readline()  # both engines start together
    with Engine(model, budget=budget, idle_release_s=0.2, **options) as engine:
        got = engine.generate(prompts, max_new_tokens=news)
        stats = engine.stats()
        print(json.dumps({"equal": got == expected, "preemptions": stats["preemptions"],
                          "refused": stats["creations_refused"], "failed_steps": stats["failed_steps"],
                          "label": engine.kv.budget_share() and engine.kv.budget.usage().members[0].label}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
