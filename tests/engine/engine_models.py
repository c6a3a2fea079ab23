"""What the engine's tests share: a tiny random-weight Llama, a seeded
workload, and the reference each request is held to (greedy generation of it
alone, with transformers and DynamicCache). Needs transformers."""

from __future__ import annotations

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

VOCAB = 96


def tiny_llama(num_layers: int) -> LlamaForCausalLM:
    """A seeded random-weight Llama of ``num_layers`` layers, 4 query and 2 KV heads of 16."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def workload(n: int, seed: int, prompt_tokens: tuple[int, int], new_tokens: tuple[int, int]
             ) -> tuple[list[list[int]], list[int]]:
    """``n`` prompts with lengths in ``[prompt_tokens[0], prompt_tokens[1])`` tokens and their new-token
    counts in ``[new_tokens[0], new_tokens[1])``, seeded."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(*prompt_tokens, (n,), generator=g).tolist()
    prompts = [torch.randint(2, VOCAB, (m,), generator=g).tolist() for m in lengths]
    return prompts, torch.randint(*new_tokens, (n,), generator=g).tolist()


def alone(model: LlamaForCausalLM, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy generation of one request with transformers and DynamicCache."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         past_key_values=DynamicCache(config=model.config))
    return out[0, len(prompt):].tolist()
