"""`python -m vattn demo`: serve a model with continuous batching on vattn, on the CPU.

By default the model is a small random-weight Llama-style model built from a
config (no download); ``--model PATH`` loads a local transformers checkpoint
instead. A synthetic trace of requests with varied prompt and output lengths
arrives over time; :class:`vattn.engine.Engine` serves it and the
demo reports throughput, time to first token, and the KV memory vattn mapped
over time against what a static max-length reservation (Orca-style: every
reqid holds ``max_context_len`` tokens) would hold for the same trace.
Needs transformers (``pip install -e ".[transformers]"``).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vattn.common.config import LAYOUTS
from vattn.common.errors import VAttnError
from vattn.common.sizes import parse_size

MiB = 1024 * 1024


# The trace's shortest prompt (8 tokens) and output (4 tokens) within max_context_len // 2 and the rest: the
# smallest --max-context-len a trace can be drawn for (make_trace).
MIN_CONTEXT_LEN = 16


def whole_number(minimum: int, unit: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an int of at least ``minimum`` (``unit``: what it counts, for the message)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number of at least {minimum}{unit}, got {text!r}") \
                from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}{unit}, got {value}")
        return value

    return parse


def arrival_rate(text: str) -> float:
    """``--rate``: mean arrivals per second, a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of arrivals per second above 0, got {text!r}")
    return value


def page_size(text: str) -> int:
    """``--page-size``: bytes with an optional unit (``16KiB``), a multiple of the host
    backend's granularity (the OS page size), which serves the demo's cache."""
    from vattn.backends import host_granularity

    granularity = host_granularity()
    try:
        value = parse_size(text, minimum=1)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value % granularity:
        given = text if text.strip() == str(value) else f"{text} ({value} bytes)"
        example = 4 * granularity
        raise argparse.ArgumentTypeError(
            f"{given} is not a multiple of the host backend's granularity, {granularity} bytes (the OS page size): "
            f"e.g. {f'{example // 1024}KiB' if example % 1024 == 0 else example}")
    return value


def physical_memory(text: str) -> int:
    """``--physical-memory``: bytes with an optional unit, at least 1."""
    try:
        return parse_size(text, minimum=1)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


SIZE_OPTIONS = ("--page-size", "--physical-memory")  # values may start with '-' (join_option_values)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a local transformers checkpoint (default: a random-weight Llama)")
    p.add_argument("--requests", type=whole_number(1), default=None,
                   help="requests in the trace, at least 1 (default 48; 12 with --quick)")
    p.add_argument("--rate", type=arrival_rate, default=6.0, help="mean arrivals per second (Poisson), above 0")
    p.add_argument("--max-batch-size", type=whole_number(1), default=16, help="reqids, at least 1 (default 16)")
    p.add_argument("--max-context-len", type=whole_number(MIN_CONTEXT_LEN, " tokens"), default=1024,
                   help=f"tokens, at least {MIN_CONTEXT_LEN} (default 1024)")
    p.add_argument("--page-size", type=page_size, default=16 * 1024,
                   help="bytes, a multiple of the host's granularity (the OS page size): 16KiB, 64KiB, 65536 ... "
                        "(default 16 KiB: 32 tokens of the default model, as 64 KiB are for Llama-3-8B)")
    p.add_argument("--layout", choices=LAYOUTS, default="per_layer")
    p.add_argument("--eager-tokens", type=whole_number(0, " tokens"), default=256,
                   help="tokens the mapper pre-maps for the next request, at least 0 (default 256)")
    p.add_argument("--physical-memory", type=physical_memory, default=None, metavar="SIZE",
                   help="physical KV pool in bytes, at least one page per buffer: 128MiB, 1GiB, 2e8 ... "
                        "(default: the host backend's)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw memory and batch size over time")
    p.add_argument("--quick", action="store_true", help="a short trace (seconds), as CI runs it")
    p.add_argument("--seed", type=int, default=0)


def build_model(path: str | None, quick: bool) -> tuple[Any, str]:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if path:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return model.eval(), f"{path}"
    torch.manual_seed(0)
    layers, hidden = (4, 256) if quick else (8, 512)
    config = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=4096, eos_token_id=None, bos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    params = sum(p.numel() for p in model.parameters()) / 1e6
    return model, (f"a random-weight Llama-style model ({layers} layers, 8 query heads, 2 KV heads x "
                   f"{hidden // 8}, {params:.0f}M parameters, float32)")


def make_trace(n: int, rate: float, vocab: int, max_context_len: int, quick: bool,
               rng: random.Random) -> list[tuple[float, list[int], int]]:
    """(arrival second, prompt ids, max_new_tokens) per request."""
    max_prompt, max_out = (96, 48) if quick else (512, 256)
    max_prompt = min(max_prompt, max_context_len // 2)
    max_out = min(max_out, max_context_len - max_prompt)
    trace, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(8, max_prompt))]
        trace.append((t, prompt, rng.randint(4, max_out)))
    return trace


class Progress:
    """One line on stderr: redrawn on a terminal, printed every 10% otherwise."""

    def __init__(self, total: int) -> None:
        self.total, self.tty, self.last_decile = total, sys.stderr.isatty(), -1

    def update(self, done: int, text: str) -> None:
        bar = "#" * (30 * done // self.total)
        line = f"[{bar:30s}] {done}/{self.total} requests  {text}"
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif 10 * done // self.total > self.last_decile:
            self.last_decile = 10 * done // self.total
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--model`` / ``--plot`` and how to fix it, checked
    before the trace runs (a missing matplotlib found after a whole run, or a
    transformers traceback about hub repo ids for a mistyped path, helps no one)."""
    if args.model is not None:
        model = Path(args.model)
        holds = ("a model directory holds config.json and the weights (model.safetensors or pytorch_model.bin), "
                 "as transformers' save_pretrained writes them")
        if not model.exists():
            return f"--model {args.model}: no such directory; {holds}"
        if not (model / "config.json").is_file():
            return f"--model {args.model}: no config.json there; {holds}"
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            return (f"--plot {args.plot} needs matplotlib, which does not import ({e}): "
                    f"pip install -e \".[bench]\" (or pip install matplotlib), or leave out --plot")
        folder = Path(args.plot).resolve().parent
        if not folder.is_dir():
            return f"--plot {args.plot}: the folder {folder} does not exist"
    return None


def run(args: argparse.Namespace) -> int:
    problem = argument_problem(args)
    if problem:
        print(f"python -m vattn demo: error: {problem}", file=sys.stderr)
        return 2
    try:
        from vattn.engine import Engine
    except ImportError as e:
        print(f"the demo needs transformers: pip install -e \".[transformers]\" ({e})", file=sys.stderr)
        return 1
    n = args.requests if args.requests is not None else (12 if args.quick else 48)
    model, described = build_model(args.model, args.quick)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    trace = make_trace(n, args.rate, vocab, args.max_context_len, args.quick, random.Random(args.seed))
    options: dict[str, Any] = dict(page_size=args.page_size, layout=args.layout,
                                   policy={"eager_tokens": args.eager_tokens})
    if args.physical_memory is not None:
        options["physical_memory"] = args.physical_memory
    try:
        engine = Engine(model, args.max_batch_size, args.max_context_len, device="cpu", **options)
    except (ValueError, VAttnError) as e:  # options that together give no cache (a pool below one page, ...)
        print(f"python -m vattn demo: error: no KV cache for these options (--page-size is the cache's page_size, "
              f"--physical-memory its physical_memory, and so on): {e}", file=sys.stderr)
        return 2
    try:
        cfg = engine.kv.config
        print(f"vattn demo: continuous batching of {described} on the CPU")
        print(f"KV cache: {cfg.layout}, pages of {engine.kv.page_size // 1024} KiB, physical pool "
              f"{engine.kv.stats()['bytes_total'] / MiB:.1f} MiB, {cfg.max_batch_size} reqids x "
              f"{cfg.max_context_len} tokens")
        prompts = [len(p) for _, p, _ in trace]
        outs = [m for _, _, m in trace]
        print(f"trace: {n} requests arriving over {trace[-1][0]:.1f} s, prompts {min(prompts)}-{max(prompts)} "
              f"tokens, outputs {min(outs)}-{max(outs)} tokens")
        results, t0 = serve(engine, trace)
        failed = [o for o in results.values() if o.finish_reason == "error"]
        if len(failed) == len(results):  # the pool, valid on its own, holds no request of this trace
            print(f"python -m vattn demo: error: no request could be served with these options (--page-size, "
                  f"--physical-memory, --max-context-len): {failed[0].error}", file=sys.stderr)
            return 2
        report(engine, results, trace, t0)
        if args.plot:
            plot(engine, t0, args.plot)
    finally:
        engine.close()
    return 0


def serve(engine: Any, trace: list[tuple[float, list[int], int]]) -> tuple[dict, float]:
    """Feeds requests at their arrival times; returns finished outputs and the start time."""
    progress = Progress(len(trace))
    results: dict[int, Any] = {}
    arrival_of: dict[int, float] = {}
    pending = list(trace)
    t0 = time.perf_counter()
    generated = 0
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            at, prompt, max_new = pending.pop(0)
            arrival_of[engine.add_request(prompt, max_new)] = t0 + at
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0] - now))  # idle until the next arrival
            continue
        for out in engine.step():
            results[out.request_id] = out
            generated += len(out.output)
        mapped = engine.history[-1]["bytes_mapped"] / MiB
        progress.update(len(results), f"batch {len(engine.running):2d}  KV mapped {mapped:6.1f} MiB  "
                                      f"{generated / (time.perf_counter() - t0):5.0f} tok/s")
    progress.close()
    for rid, at in arrival_of.items():  # time to first token counts from the trace's arrival
        results[rid].arrival_time = at
    return results, t0


def report(engine: Any, results: dict, trace: list, t0: float) -> None:
    """Prints the run's figures; those of time and tokens over the requests served (at least one)."""
    outs = [o for o in results.values() if o.finish_reason != "error"]
    failed = [o for o in results.values() if o.finish_reason == "error"]
    elapsed = max(o.finish_time for o in outs) - t0
    generated = sum(len(o.output) for o in outs)
    prompt_tokens = sum(len(o.prompt) for o in outs)
    ttft = sorted(o.first_token_time - o.arrival_time for o in outs if o.first_token_time)
    history = engine.history
    mapped = [h["bytes_mapped"] for h in history]
    peak = max(mapped)
    static = engine.kv.config.static_bytes()
    busy = [h for h in history if h["bytes_needed"]]
    waste = [1 - h["bytes_used"] / h["bytes_needed"] for h in busy]
    s = engine.stats()
    print(f"\nfinished {len(outs)} requests in {elapsed:.1f} s ({s['iterations']} iterations): "
          f"{len(outs) / elapsed:.2f} requests/s, {generated / elapsed:.0f} generated tokens/s "
          f"({(generated + prompt_tokens) / elapsed:.0f} tokens/s with prompts)")
    print(f"time to first token: mean {statistics.fmean(ttft):.2f} s, median {statistics.median(ttft):.2f} s, "
          f"p90 {ttft[int(0.9 * (len(ttft) - 1))]:.2f} s")
    print(f"KV memory: peak mapped {peak / MiB:.1f} MiB, mean {statistics.fmean(mapped) / MiB:.1f} MiB; a static "
          f"max-length reservation needs {static / MiB:.0f} MiB for the same {engine.kv.config.max_batch_size} "
          f"reqids. Running requests' tokens needed at most {max(h['bytes_needed'] for h in history) / MiB:.1f} MiB "
          f"of pages; the rest stayed mapped for reuse (finished requests' pages, the pre-mapped next reqid), "
          f"to be unmapped only when free pages run low")
    print(f"fragmentation: {100 * statistics.fmean(waste):.0f}% of the pages running requests needed held no "
          f"token on average (the partly filled last page of each request)")
    print(f"{s['preemptions']} preemptions (requests recomputed after running out of pages)")
    if failed:
        print(f"{len(failed)} of {len(results)} requests could not be served, e.g. request "
              f"{failed[0].request_id}: {failed[0].error}")
    print(f"In plain words: serving this trace, vattn committed at most {100 * peak / static:.1f}% of the "
          f"memory a static max-length reservation would have held, and attention read the cache as plain "
          f"dense tensors, with no block table.")


def plot(engine: Any, t0: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = engine.history
    t = [x["time"] - t0 for x in h]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax.plot(t, [x["bytes_mapped"] / MiB for x in h], label="vattn: mapped (all)")
    ax.plot(t, [x["bytes_needed"] / MiB for x in h], label="vattn: pages the running requests need")
    ax.plot(t, [x["bytes_used"] / MiB for x in h], label="tokens held")
    ax.axhline(engine.kv.config.static_bytes() / MiB, color="red", ls="--", label="static max-length reservation")
    ax.set_ylabel("KV memory (MiB)")
    ax.set_yscale("log")
    ax.legend()
    bx.plot(t, [x["running"] for x in h], label="running")
    bx.plot(t, [x["waiting"] for x in h], label="waiting")
    bx.set_ylabel("requests")
    bx.set_xlabel("time (s)")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
