"""Tiny random-weight checkpoints of the architectures users serve with vLLM,
made from transformers configs (nothing downloaded), for the model table of
docs/vllm.md (benchmarks/vllm_models.py) and tests/integrations/test_vllm_models.py.

Each is as small as its architecture allows (2-4 layers, hidden 128, vocab
256) and keeps what makes the architecture differ: GQA or multi-head
attention, learned positions (GPT-2, OPT), sliding windows (Mistral, Gemma),
sliding and global layers mixed (Gemma-2: alternating; Gemma-3: two sliding
per global), logit soft-capping (Gemma-2), q/k norms (Qwen3), fused QKV
(Phi-3), experts (Mixtral, Qwen3-MoE), multi-head latent attention
(DeepSeek-V2). Runs in the vLLM environment (its transformers).
"""

from __future__ import annotations

import random
from typing import Any

VOCAB, HIDDEN = 256, 128
WINDOW = 64  # tokens: short enough that the tests' prompts slide past it

# per architecture: (transformers config class, model class, config arguments)
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", COMMON),
    "mistral-sliding-window": ("MistralConfig", "MistralForCausalLM", dict(COMMON, sliding_window=WINDOW)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(COMMON, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=32,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                    layer_types=["sliding_attention", "full_attention"] * 2)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(COMMON, num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=32,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {k: v for k, v in COMMON.items() if k != "head_dim"}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", COMMON),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {k: v for k, v in COMMON.items() if k != "head_dim"}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=1024, bos_token_id=1,
                  eos_token_id=2)),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(vocab_size=VOCAB, hidden_size=HIDDEN, word_embed_proj_dim=HIDDEN, ffn_dim=2 * HIDDEN,
                 num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=1024, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(COMMON, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
                       decoder_sparse_step=1, mlp_only_layers=[])),
    "deepseek-v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(COMMON, num_key_value_heads=4, head_dim=None, q_lora_rank=None, kv_lora_rank=512,
                         qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=4,
                         n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
                         first_k_dense_replace=1, n_group=1, topk_group=1)),
}


def make(name: str, path: str) -> None:
    """Saves architecture ``name``'s tiny random-weight checkpoint (bf16,
    seeded) to ``path``."""
    import transformers

    from vattn.cli.make_model import save_random_weights

    config_cls, model_cls, kwargs = ARCHITECTURES[name]
    config = getattr(transformers, config_cls)(**{k: v for k, v in kwargs.items() if v is not None or k != "head_dim"})
    save_random_weights(config, path, model_cls, "bfloat16", seed=0)


ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=4, block_size=32, enable_prefix_caching=True)
"""vLLM engine arguments of the model runs (fp32: greedy tokens must match exactly)."""


def phases() -> list[dict]:
    """What every model serves: prompts of 20-150 tokens (windows of 64
    slide), then requests over three shared prefixes of 70-110 tokens, then
    some of them again (vllm_scenario.py's phases)."""
    rng = random.Random(2)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    mixed = [tokens(rng.randint(20, 150)) for _ in range(6)]
    systems = [tokens(rng.randint(70, 110)) for _ in range(3)]
    shared = [systems[i % 3] + tokens(rng.randint(3, 30)) for i in range(6)]
    return [dict(name="mixed", prompts=mixed, max_tokens=[rng.randint(30, 60) for _ in mixed]),
            dict(name="shared", prompts=shared, max_tokens=[rng.randint(20, 40) for _ in shared]),
            dict(name="shared-again", prompts=shared[:3], max_tokens=[24] * 3)]
