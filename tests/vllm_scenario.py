"""One offline vLLM run, for tests/test_vllm.py and benchmarks/vllm_serving.py.

Runs under the interpreter of the vLLM environment (vLLM starts its workers
with spawn, so everything happens under ``__main__``):

    python tests/vllm_scenario.py make-model DIR [LAYERS HIDDEN]
    python tests/vllm_scenario.py run DIR SPEC.json OUT.json

SPEC holds ``prompts`` (token id lists), ``max_tokens`` (one per prompt),
``max_model_len`` and ``max_num_seqs``. vattn is used when the caller sets
VATTN_VLLM=1. OUT gets the generated ids, the preemption count, the KV bytes
stock vLLM allocates for this configuration and, with vattn, the worker
cache's stats and per-step series.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def make_model(path: str, layers: int = 2, hidden: int = 128) -> None:
    """A small random-weight Llama with GQA (4 query heads, 2 KV heads of 32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=hidden // 4, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def preemptions(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def run(model: str, spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=model, skip_tokenizer_init=True, dtype=spec.get("dtype", "float32"), max_model_len=spec["max_model_len"],
              max_num_seqs=spec["max_num_seqs"], enforce_eager=True, disable_log_stats=False)
    started = time.perf_counter()
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in spec["max_tokens"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    done = time.perf_counter()
    config = llm.llm_engine.vllm_config
    hf = config.model_config.hf_text_config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * config.model_config.dtype.itemsize
    result = {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "preemptions": preemptions(llm),
        "startup_s": started - start,
        "generate_s": done - started,
        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "num_blocks": config.cache_config.num_gpu_blocks,
        "block_size": config.cache_config.block_size,
        "kv_bytes_per_token": per_token,  # K and V of every layer
        "kv_bytes_allocated": config.cache_config.num_gpu_blocks * config.cache_config.block_size * per_token,
        "vattn": llm.collective_rpc("vattn_stats")[0] if os.environ.get("VATTN_VLLM") == "1" else None,
    }
    return result


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        make_model(sys.argv[2], *map(int, sys.argv[3:5]))
    else:
        _, _, model_dir, spec_path, out_path = sys.argv
        with open(spec_path) as f:
            spec = json.load(f)
        with open(out_path, "w") as f:
            json.dump(run(model_dir, spec), f)
