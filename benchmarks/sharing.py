"""Shared pages end to end: parallel sampling and a shared-prefix trace, with
and without sharing, through the engine (vattn/engine/engine.py).

    python benchmarks/sharing.py [--quick]

A Llama-architecture model with random weights (4 layers, 8 query / 2 KV heads
of 64, fp32) runs on the host backend; each configuration gets a fresh engine.

  parallel  one 1000-token prompt, n = 1, 2, 4, 8 sampled completions of 128
            tokens. shared: generate([p], n=k) (the prompt is computed once and
            forked k ways: whole pages shared, the partial one copied).
            copies: generate([p] * k) (every completion computes and holds its
            own prompt).
  prefix    48 requests over 4 system prompts of 768 tokens plus a 16-128
            token question each, 32 new tokens, greedy, 8 at a time.
            shared: Engine(prefix_cache=True). copies: no prefix cache. The
            outputs must be equal (checked).

Reported per run: peak and mean over the iterations of the bytes of KV pages
mapped behind running requests (distinct physical pages, from the cache's own
page table; deferred reclamation and eager allocation are off in both runs,
so neither finished requests' pages nor a pre-mapped next reqid count) and of the same plus pages only the prefix cache holds
(evictable), tokens the model computed, best wall seconds of two runs and 
generated tokens per second. Writes benchmarks/results/sharing_<machine>.json
and a plot; prints progress.
"""

from __future__ import annotations

import argparse
import time

import torch
from harness import machine, machine_slug, pyplot, save_plot, write_json
from transformers import LlamaConfig, LlamaForCausalLM

from vattn.engine import Engine

MiB = 2**20
VOCAB = 2000
PAGE = 32 * 1024  # 2 KV heads x 64 x fp32 = 512 bytes per token per buffer: 64 tokens per page


def make_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                      pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()


def run(model, prompts, max_new_tokens, engine_options, reps: int = 2, **generate_options) -> tuple[dict, list]:
    """Best wall time of ``reps`` fresh engines; memory from the last (it is deterministic)."""
    seconds = []
    for _ in range(reps):
        with Engine(model, **engine_options) as engine:
            t = time.perf_counter()
            out = engine.generate(prompts, max_new_tokens=max_new_tokens, **generate_options)
            seconds.append(time.perf_counter() - t)
            stats, history = engine.stats(), engine.history
            cached = engine.prefix_cache is not None
    generated = sum(len(o) for p in out for o in (p if generate_options.get("n", 1) > 1 else [p]))
    record = dict(
        seconds=min(seconds),
        seconds_all=seconds,
        generated_tokens=generated,
        tokens_per_s=generated / min(seconds),
        computed_tokens=sum(h["tokens"] for h in history),
        # pages mapped in running requests (deferred reclaim is off: finished requests' pages are gone)
        peak_bytes_mapped=max(h["bytes_mapped"] for h in history),
        mean_bytes_mapped=sum(h["bytes_mapped"] for h in history) / len(history),
        # plus pages only the prefix cache holds (evicted when the pool runs short)
        peak_bytes_in_use=max(h["bytes_in_use"] for h in history),
        mean_bytes_in_use=sum(h["bytes_in_use"] for h in history) / len(history),
        forks=stats["forks"],
        pages_copied=stats["pages_copied"],
        preemptions=stats["preemptions"],
    )
    if cached:
        record.update(prefix_hit_tokens=stats["prefix_cache_hit_tokens"],
                      prefix_query_tokens=stats["prefix_cache_query_tokens"])
    return record, out


def parallel(model, quick: bool) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    prompt_len, new = (300, 16) if quick else (1000, 128)
    prompt = tokens(g, prompt_len)
    rows = []
    for n in (1, 2, 4) if quick else (1, 2, 4, 8):
        options = dict(max_batch_size=8, max_context_len=prompt_len + new, page_size=PAGE,
                       policy={"deferred_reclaim": False, "eager": False})
        shared, _ = run(model, [prompt], new, options, n=n, temperature=1.0, seed=3)
        copies, _ = run(model, [prompt] * n, new, options, temperature=1.0, seed=3)
        rows.append(dict(n=n, shared=shared, copies=copies))
        print(f"parallel n={n}: peak KV {shared['peak_bytes_mapped'] / MiB:.1f} MiB shared vs "
              f"{copies['peak_bytes_mapped'] / MiB:.1f} MiB copies; {shared['seconds']:.2f} s vs "
              f"{copies['seconds']:.2f} s", flush=True)
    return rows


def prefix_trace(model, quick: bool) -> dict:
    g = torch.Generator().manual_seed(2)
    systems = [tokens(g, 200 if quick else 768) for _ in range(4)]
    count = 12 if quick else 48
    questions = torch.randint(16, 129, (count,), generator=g).tolist()
    prompts = [systems[i % 4] + tokens(g, q) for i, q in enumerate(questions)]
    new = 8 if quick else 32
    options = dict(max_batch_size=8, max_context_len=max(map(len, prompts)) + new, page_size=PAGE,
                   policy={"deferred_reclaim": False, "eager": False})
    copies, want = run(model, prompts, new, options)
    print(f"prefix trace without cache: {copies['seconds']:.2f} s, mean KV {copies['mean_bytes_mapped'] / MiB:.1f} MiB",
          flush=True)
    shared, got = run(model, prompts, new, dict(options, prefix_cache=True))
    print(f"prefix trace with cache: {shared['seconds']:.2f} s, mean KV {shared['mean_bytes_mapped'] / MiB:.1f} MiB, "
          f"{shared['prefix_hit_tokens']} prompt tokens found cached", flush=True)
    if got != want:
        raise AssertionError("the prefix cache changed the outputs")
    return dict(requests=count, system_prompts=4, system_tokens=len(systems[0]), new_tokens=new,
                outputs_equal=True, shared=shared, copies=copies)


def plot(result: dict, name: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    rows = result["parallel"]
    ns = [r["n"] for r in rows]
    for key, label in (("shared", "vattn, shared pages (fork)"), ("copies", "vattn, one copy per sample")):
        axes[0].plot(ns, [r[key]["peak_bytes_mapped"] / MiB for r in rows], "o-", label=label)
        axes[1].plot(ns, [r[key]["seconds"] for r in rows], "o-", label=label)
    axes[0].set(xlabel="parallel samples n", ylabel="peak KV mapped (MiB)", xticks=ns,
                title=f"{result['parallel_prompt_tokens']}-token prompt, n samples")
    axes[1].set(xlabel="parallel samples n", ylabel="wall time (s)", xticks=ns, title="time to finish all samples")
    for ax in axes[:2]:
        ax.legend()
        ax.grid(alpha=0.3)
    trace = result["prefix"]
    labels = ["peak KV\nmapped (MiB)", "mean KV\nmapped (MiB)", "mean KV with\ncache (MiB)",
              "tokens\ncomputed (K)", "wall time (s)"]
    values = {key: [trace[key]["peak_bytes_mapped"] / MiB, trace[key]["mean_bytes_mapped"] / MiB,
                    trace[key]["mean_bytes_in_use"] / MiB, trace[key]["computed_tokens"] / 1000,
                    trace[key]["seconds"]] for key in ("copies", "shared")}
    x = range(len(labels))
    axes[2].bar([i - 0.2 for i in x], values["copies"], 0.4, label="no prefix cache")
    axes[2].bar([i + 0.2 for i in x], values["shared"], 0.4, label="prefix cache (shared pages)")
    axes[2].set_xticks(list(x), labels, fontsize=8)
    axes[2].set_title(f"{trace['requests']} requests over {trace['system_prompts']} system prompts")
    axes[2].legend()
    fig.suptitle(f"vattn shared pages, {result['machine']['cpu']} ({result['machine']['cores']} cores)")
    save_plot(fig, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke run, not for the results)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = make_model()
    m = machine()
    result = dict(machine=m, model="Llama, 4 layers, 8 q / 2 kv heads x 64, fp32, random weights",
                  page_size=PAGE, parallel_prompt_tokens=300 if args.quick else 1000)
    result["parallel"] = parallel(model, args.quick)
    result["prefix"] = prefix_trace(model, args.quick)
    big = result["parallel"][-1]
    result["summary"] = dict(
        parallel_n=big["n"],
        parallel_memory_ratio=big["copies"]["peak_bytes_mapped"] / big["shared"]["peak_bytes_mapped"],
        parallel_speedup=big["copies"]["seconds"] / big["shared"]["seconds"],
        prefix_mapped_ratio_mean=result["prefix"]["copies"]["mean_bytes_mapped"]
        / result["prefix"]["shared"]["mean_bytes_mapped"],
        prefix_in_use_ratio_mean=result["prefix"]["copies"]["mean_bytes_in_use"]
        / result["prefix"]["shared"]["mean_bytes_in_use"],
        prefix_computed_ratio=result["prefix"]["copies"]["computed_tokens"]
        / result["prefix"]["shared"]["computed_tokens"],
        prefix_speedup=result["prefix"]["copies"]["seconds"] / result["prefix"]["shared"]["seconds"],
    )
    print("summary:", {k: round(v, 2) for k, v in result["summary"].items()}, flush=True)
    name = f"sharing_{machine_slug(m)}" + ("_quick" if args.quick else "")
    print(f"wrote {write_json(name, result)}")
    plot(result, name)


if __name__ == "__main__":
    main()
