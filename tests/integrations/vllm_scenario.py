"""vLLM runs for tests/integrations/test_vllm.py and benchmarks/vllm_serving.py.

Runs under the interpreter of the vLLM environment (vLLM starts its workers
with spawn, so everything happens under ``__main__``):

    python tests/integrations/vllm_scenario.py make-model DIR [LAYERS HIDDEN [QUERY_HEADS MAX_POSITIONS]]
    python tests/integrations/vllm_scenario.py make-arch DIR ARCHITECTURE   (vllm_models.ARCHITECTURES)
    python tests/integrations/vllm_scenario.py run DIR SPEC.json OUT.json

SPEC: ``engine`` (keyword arguments of ``vllm.LLM``: dtype, max_model_len,
max_num_seqs, block_size, enable_prefix_caching, kv_cache_memory_bytes,
tensor_parallel_size, pipeline_parallel_size, enforce_eager (default True),
...) and ``phases``, each ``{"name", "prompts" (token id
lists), "max_tokens" (one per prompt)}``, generated one after the other on one
engine (so later phases can hit what earlier ones cached). vattn is used when
the caller sets VATTN_VLLM=1. ``barrier`` ``{"dir", "parties"}``: after start-up,
wait until that many engines (processes) reached it, so their phases overlap;
``idle_s``: afterwards, sleep that long and record the worker's stats again
(``vattn_idle``); ``sleep``: afterwards, ``llm.sleep()``, the worker's stats
(``vattn_asleep``), ``llm.wake_up()``. With ``record_usage`` the engine core runs in
this process and the scheduler's blocks in use are recorded at every step,
with the bytes one block holds (the layers of one KV cache group).

OUT: per phase the generated ids, seconds, generated tokens, time to first
token of every request, and the phase's prefix-cache hits, queries and
preemptions (vLLM's own counters); the engine's block count and size and KV
bytes per token; the attention backend vLLM selects; with vattn the worker
cache's stats and per-forward series.
"""

from __future__ import annotations

import json
import os
import sys
import time


def make_model(path: str, layers: int = 2, hidden: int = 128, query_heads: int = 4, max_positions: int = 1024) -> None:
    """A small random-weight Llama with GQA (``query_heads`` query heads, 2 KV
    heads of hidden / query_heads)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=query_heads, num_key_value_heads=2, head_dim=hidden // query_heads,
        max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2))
    model.to(torch.bfloat16).save_pretrained(path)


def counter(llm, name: str) -> int:
    return int(sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name))


class UsageRecorder:
    """The scheduler's blocks in use (held by requests) after every schedule()."""

    def __init__(self) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler

        self.series: list[tuple[float, int]] = []  # (time.monotonic(), blocks in use)
        self.block_bytes = 0  # bytes one block id holds: K and V of one KV cache group's layers
        original = Scheduler.schedule
        recorder = self

        def schedule(scheduler, *args, **kwargs):
            out = original(scheduler, *args, **kwargs)
            pool = scheduler.kv_cache_manager.block_pool
            recorder.series.append((time.monotonic(), pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()))
            recorder.block_bytes = max(len(g.layer_names) * g.kv_cache_spec.page_size_bytes
                                       for g in scheduler.kv_cache_config.kv_cache_groups)
            return out

        Scheduler.schedule = schedule


def wait_for_parties(dir: str, parties: int, timeout_s: float = 300) -> None:
    """A barrier between processes: one file per arrival in ``dir``."""
    open(os.path.join(dir, f"arrived-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while sum(n.startswith("arrived-") for n in os.listdir(dir)) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{parties} engines did not all start within {timeout_s} s")
        time.sleep(0.05)


def attention_backend(config, head_dim: int) -> str:
    """The attention backend class vLLM's selector picks for this model (the
    plugin, when switched on, registers its own), as ``module.ClassName``."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    with set_current_vllm_config(config):
        backend = get_attn_backend(head_dim, config.model_config.dtype, config.cache_config.cache_dtype)
    return f"{backend.__module__}.{backend.__name__}"


def run(model: str, spec: dict) -> dict:
    recorder = None
    if spec.get("record_usage"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process
        recorder = UsageRecorder()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=model, **dict(dict(skip_tokenizer_init=True, enforce_eager=True, disable_log_stats=False),
                                  **spec["engine"]))
    result: dict = {"startup_s": time.perf_counter() - start, "phases": {}}
    if spec.get("barrier"):
        wait_for_parties(**spec["barrier"])
    for phase in spec["phases"]:
        before = {n: counter(llm, n) for n in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries",
                                               "vllm:num_preemptions")}
        prompts = [TokensPrompt(prompt_token_ids=p) for p in phase["prompts"]]
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in phase["max_tokens"]]
        t0 = time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False)
        t1 = time.monotonic()
        result["phases"][phase["name"]] = {
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "start": t0,
            "generate_s": t1 - t0,
            "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "ttft_s": [o.metrics.first_token_latency if o.metrics else None for o in outs],
            "prefix_cache_hits": counter(llm, "vllm:prefix_cache_hits") - before["vllm:prefix_cache_hits"],
            "prefix_cache_queries": counter(llm, "vllm:prefix_cache_queries") - before["vllm:prefix_cache_queries"],
            "preemptions": counter(llm, "vllm:num_preemptions") - before["vllm:num_preemptions"],
        }
    if spec.get("sleep"):
        llm.sleep()
        result["vattn_asleep"] = llm.collective_rpc("vattn_stats")
        llm.wake_up()
    if spec.get("idle_s"):
        time.sleep(spec["idle_s"])
        result["vattn_idle"] = llm.collective_rpc("vattn_stats")
    config = llm.llm_engine.vllm_config
    model_config = config.model_config
    head_dim = model_config.get_head_size()
    per_token = (2 * model_config.hf_text_config.num_hidden_layers * model_config.get_total_num_kv_heads()
                 * head_dim * model_config.dtype.itemsize)
    cache = config.cache_config
    result.update(
        num_blocks=cache.num_gpu_blocks,
        block_size=cache.block_size,
        enable_prefix_caching=cache.enable_prefix_caching,
        kv_bytes_per_token=per_token,  # K and V of every layer, all ranks
        block_bytes=cache.block_size * per_token,
        kv_bytes_allocated=cache.num_gpu_blocks * cache.block_size * per_token,
        usage_series=recorder.series if recorder else None,
        usage_block_bytes=recorder.block_bytes if recorder else None,
        attention_backend=attention_backend(config, head_dim),
        vattn=llm.collective_rpc("vattn_stats") if os.environ.get("VATTN_VLLM") == "1" else None,
    )
    return result


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        make_model(sys.argv[2], *map(int, sys.argv[3:7]))
    elif sys.argv[1] == "make-arch":
        import vllm_models  # next to this file, on sys.path as the script's folder

        vllm_models.make(sys.argv[3], sys.argv[2])
    else:
        _, _, model_dir, spec_path, out_path = sys.argv
        with open(spec_path) as f:
            spec = json.load(f)
        with open(out_path, "w") as f:
            json.dump(run(model_dir, spec), f)
