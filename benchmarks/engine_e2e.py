"""End to end: a Llama-3.2-1B-shaped model with random weights generating
with the vattn engine against transformers' ``generate`` with ``DynamicCache``
and ``StaticCache``.

    python benchmarks/engine_e2e.py                  # bf16 on the GPU (fp32 on the CPU)
    python benchmarks/engine_e2e.py --tiny           # a 2-layer model, for a smoke run
    python benchmarks/engine_e2e.py --dtype bfloat16 --rounds 5 --aa vattn   # the committed CPU run

Model: the shape of Llama-3.2-1B (16 layers, hidden 2048, 32 query heads,
8 KV heads x 64, MLP 8192, vocabulary 128256, tied embeddings), random
weights, so the text is noise but every kernel does the real work; EOS is
off and every request generates exactly ``--new-tokens`` tokens. Workload:
``--requests`` prompts of random token ids, lengths spread evenly over
[prompt_len / 2, prompt_len] (seeded).

  vattn    vattn.engine.Engine: continuous batching of up to
           ``--batch`` requests, K/V written into the vattn cache (per-layer
           pages) and read in place by the kernel select_kernel picks, named
           in the result (no padding, no block table); on CUDA its decode
           iterations replay CUDA graphs (the engine's default)
  vattn-nographs  the same with every iteration eager (cuda_graphs=False;
           on the CPU the same as vattn)
  vattn-all_layers  the same with the all_layers layout: a page holds a
           token's rows of every layer, so it holds num_layers times fewer
           tokens (less memory past each request's end, more pages)
  dynamic  model.generate over groups of ``--batch`` prompts, left-padded,
           DynamicCache (grows by concatenation)
  static   the same with cache_implementation="static" (StaticCache,
           preallocated for the longest prompt plus the new tokens; on
           CUDA transformers compiles its decode step, once per group's
           shape, in an untimed pass over every group: warmup_calls)

Reported per run: generated tokens per second (wall clock, prefill
included, after a warm-up run of each: on CUDA every cache runs the whole
trace once untimed), and KV bytes: vattn the peak
bytes mapped (pages_mapped_peak x page_size); dynamic and static the K/V
tensors' bytes at the end of the largest group.

Rounds. ``--rounds R`` runs every cache R times, the order reversed every
other round, so that a machine whose speed drifts (a shared one) favours no
cache; ``--aa CACHE`` runs that cache a second time in each round, at the
other end of the order, labelled ``CACHE-again``. Reported: per cache the
median tokens per second, and per pair (each vattn cache against dynamic
and static, and the A/A pair) the median of the per-round ratios with their
minimum and maximum. The A/A pair's interval is the noise floor: a ratio
whose interval lies within it is no difference.

Writes benchmarks/results/engine_e2e[_<tag>]_<machine>.json and a plot.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from harness import (ROOT, describe_ratio, git_revision, machine, machine_slug, pyplot, ratio_summary, round_order,
                     save_plot, write_json)

LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                    rope_theta=500000.0, tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True)


def make_model(shape: dict[str, int], device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(dtype).eval()
    model.generation_config.eos_token_id = None  # random weights: every request runs to --new-tokens
    return model


def prompts_for(n: int, prompt_len: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lens = [prompt_len // 2 + (prompt_len - prompt_len // 2) * i // max(1, n - 1) for i in range(n)]
    return [torch.randint(1, vocab, (length,), generator=gen).tolist() for length in lens]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_vattn(model: Any, prompts: list[list[int]], args: argparse.Namespace, device: torch.device,
              layout: str = "per_layer", graphs: bool | None = None) -> dict:
    from vattn.engine import engine as engine_module
    options: dict[str, Any] = {"layout": layout, "cuda_graphs": graphs}
    if device.type == "cuda":
        options["sync_streams"] = torch.cuda.current_stream()  # reclaim waits for the model's stream only
    with engine_module.Engine(model, max_batch_size=args.batch, max_context_len=args.prompt_len + args.new_tokens,
                              device=device, **options) as engine:
        # warm-up, as transformers' caches get theirs (warmup_calls): on CUDA the whole trace once, so that
        # every decode batch size has its CUDA graph captured before the timed run
        if device.type == "cuda":
            engine.generate(prompts, max_new_tokens=args.new_tokens)
        else:
            engine.generate(prompts[: args.batch], max_new_tokens=2)
        sync(device)
        t = time.perf_counter()
        outputs = engine.generate(prompts, max_new_tokens=args.new_tokens)
        sync(device)
        seconds = time.perf_counter() - t
        stats = engine.stats()
    tokens = sum(len(o) for o in outputs)
    return {"kernel": stats["attention_kernel"], "seconds": seconds, "generated_tokens": tokens,
            "tokens_per_s": tokens / seconds, "kv_bytes": stats["pages_mapped_peak"] * stats["page_size"],
            "kv_bytes_what": "peak bytes mapped", "page_size": stats["page_size"], "preemptions": stats["preemptions"],
            "iterations": stats["iterations"], "decode_graph_replays": stats["decode_graph_replays"]}


def cache_bytes(cache: Any) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if isinstance(t, torch.Tensor))


def warmup_calls(groups: list[list[list[int]]], new_tokens: int, device: torch.device) -> list[tuple[list, int]]:
    """The untimed ``generate`` calls before transformers' timed run. On the CPU one short call. On CUDA every
    group once as it will run: there ``generate`` compiles the decode step of a StaticCache with torch.compile,
    for each cache length (a group's longest prompt plus ``new_tokens``) and batch, and a user serving with a
    static cache compiles once, not per request group; DynamicCache is not compiled and gains only the warm
    allocator and kernels."""
    if device.type != "cuda":
        return [(groups[0], 2)]
    return [(group, new_tokens) for group in groups]


def run_hf(model: Any, prompts: list[list[int]], args: argparse.Namespace, device: torch.device, kind: str) -> dict:
    from transformers import DynamicCache

    def generate(group: list[list[int]], new_tokens: int) -> Any:
        width = max(len(p) for p in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for i, p in enumerate(group):  # left padding: every row ends at the last column
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        cache = {"past_key_values": DynamicCache()} if kind == "dynamic" else {"cache_implementation": "static"}
        with torch.no_grad():
            return model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                  return_dict_in_generate=True, **cache)

    groups = [prompts[start:start + args.batch] for start in range(0, len(prompts), args.batch)]
    for group, new_tokens in warmup_calls(groups, args.new_tokens, device):
        generate(group, new_tokens)
    sync(device)
    t = time.perf_counter()
    tokens, kv_bytes = 0, 0
    for group in groups:
        out = generate(group, args.new_tokens)
        tokens += (out.sequences.shape[1] - max(len(p) for p in group)) * len(group)
        kv_bytes = max(kv_bytes, cache_bytes(out.past_key_values))
    sync(device)
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "generated_tokens": tokens, "tokens_per_s": tokens / seconds,
            "kv_bytes": kv_bytes, "kv_bytes_what": "K/V tensors at the end of the largest group"}


def run_cache(kind: str, model: Any, prompts: list[list[int]], args: argparse.Namespace,
              device: torch.device) -> dict:
    """One run of ``kind``: vattn[-LAYOUT][-nographs], dynamic or static."""
    if kind.startswith("vattn"):
        parts = kind.split("-")[1:]
        layouts = [p for p in parts if p != "nographs"]
        return run_vattn(model, prompts, args, device, layouts[0] if layouts else "per_layer",
                         False if "nographs" in parts else None)
    return run_hf(model, prompts, args, device, kind)


def ratio_pairs(caches: list[str], aa: str | None) -> list[tuple[str, str]]:
    """(numerator, denominator): each vattn cache against each transformers cache, and the A/A pair."""
    pairs = [(v, h) for v in caches if v.startswith("vattn") for h in caches if not h.startswith("vattn")]
    if "vattn" in caches:
        pairs += [(v, "vattn") for v in caches if v.startswith("vattn") and v != "vattn"]
    if aa:
        pairs.append((f"{aa}-again", aa))
    return pairs


def summarize(runs: list[dict], caches: list[str], aa: str | None) -> tuple[dict, dict]:
    """Per cache: median, min and max tokens/s over rounds; per pair: the
    per-round ratios of tokens/s, their median, min, max and 95% interval
    (harness.ratio_summary)."""
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["cache"]] = r["tokens_per_s"]
    per_cache = {}
    for cache in caches + ([f"{aa}-again"] if aa else []):
        values = [rates[cache] for rates in by_round.values() if cache in rates]
        per_cache[cache] = {"tokens_per_s_median": statistics.median(values), "tokens_per_s_min": min(values),
                            "tokens_per_s_max": max(values), "rounds": len(values)}
    ratios = {}
    for num, den in ratio_pairs(caches, aa):
        values = [rates[num] / rates[den] for rates in by_round.values() if num in rates and den in rates]
        ratios[f"{num} / {den}"] = ratio_summary(values)
    return per_cache, ratios


def main() -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if gpu else "cpu")
    p.add_argument("--dtype", default="bfloat16" if gpu else "float32")
    p.add_argument("--requests", type=int, default=64 if gpu else 8)
    p.add_argument("--batch", type=int, default=32 if gpu else 4, help="requests at once (engine and HF groups)")
    p.add_argument("--prompt-len", type=int, default=1024 if gpu else 128, help="longest prompt (tokens)")
    p.add_argument("--new-tokens", type=int, default=128 if gpu else 16)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model instead of the 1B shape")
    p.add_argument("--caches", default="vattn,vattn-all_layers,dynamic,static",
                   help="comma-separated: vattn[-all_layers][-nographs], dynamic, static")
    p.add_argument("--rounds", type=int, default=1, help="runs of every cache, the order reversed every other round")
    p.add_argument("--aa", default=None, help="a cache of --caches run twice per round (the A/A pair)")
    p.add_argument("--tag", default="", help="a name part for the result files: engine_e2e_<tag>_<machine>")
    args = p.parse_args()
    caches = args.caches.split(",")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.aa is not None and args.aa not in caches:
        p.error(f"--aa must name one of --caches ({args.caches}), got {args.aa!r}")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shape = TINY if args.tiny else LLAMA_3_2_1B
    model = make_model(shape, device, dtype)
    prompts = prompts_for(args.requests, args.prompt_len, shape["vocab_size"])
    runs = []
    for round_index in range(args.rounds):
        for label in round_order(caches, args.aa, round_index):
            r = dict(cache=label, round=round_index,
                     **run_cache(label.removesuffix("-again"), model, prompts, args, device))
            runs.append(r)
            print(f"round {round_index} {label:16s}: {r['tokens_per_s']:9.1f} tokens/s ({r['generated_tokens']} "
                  f"tokens in {r['seconds']:.2f} s), KV {r['kv_bytes'] / 2**20:9.1f} MiB ({r['kv_bytes_what']})",
                  flush=True)
    per_cache, ratios = summarize(runs, caches, args.aa)
    for pair, q in ratios.items():
        print(describe_ratio(pair, q))
    m = machine()
    name = f"engine_e2e_{args.tag + '_' if args.tag else ''}{machine_slug(m)}"
    path = write_json(name, {
        "benchmark": "engine_e2e", "revision": git_revision(ROOT), "machine": m,
        "model": "tiny" if args.tiny else "Llama-3.2-1B shape, random weights",
        "config": shape, "device": str(device), "dtype": args.dtype, "requests": args.requests, "batch": args.batch,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rounds": args.rounds, "aa": args.aa,
        "order": "every cache once per round, the order reversed every other round",
        "caches": per_cache, "ratios": ratios, "results": runs})
    print(f"wrote {path}")
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    names = list(per_cache)
    medians = [per_cache[c]["tokens_per_s_median"] for c in names]
    spans = [[med - per_cache[c]["tokens_per_s_min"] for c, med in zip(names, medians)],
             [per_cache[c]["tokens_per_s_max"] - med for c, med in zip(names, medians)]]
    axes[0].bar(names, medians, yerr=spans, capsize=4)
    axes[0].set_ylabel(f"generated tokens / s (median, min-max of {args.rounds})")
    kv = {r["cache"]: r["kv_bytes"] for r in runs}
    axes[1].bar(names, [kv[c] / 2**20 for c in names])
    axes[1].set_ylabel("KV MiB")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.suptitle(f"{'tiny model' if args.tiny else 'Llama-3.2-1B shape'} {args.dtype}, {args.requests} requests, "
                 f"batch {args.batch}, {args.rounds} alternated rounds — {m['gpu'] or m['cpu']}", fontsize=9)
    fig.tight_layout()
    save_plot(fig, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
