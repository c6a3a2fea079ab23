"""vattn's host attention kernel (csrc/cpu_attn) against what a CPU user
would pick instead, on the same K/V: vLLM-CPU's own attention kernel on its
paged cache, per-request SDPA on the vattn cache and SDPA on a padded dense
batch. The cases, the paged gather baseline and the timing are
benchmarks/attention_ab.py's (the GPU-first A/B of the vattn cache against
paged kernels); this script adds the CPU kernels.

    python benchmarks/attention_host.py            # the grid below, ~15 minutes on 2 CPU cores
    # only the host kernel against vLLM's (the SDPA baselines' copies outgrow 24 GiB in fp32)
    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/attention_host.py --kernels host,vllm
    python benchmarks/attention_host.py --quick    # a smoke run
    # with vLLM's kernel: run it with vLLM's interpreter on this checkout
    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/attention_host.py
    python benchmarks/attention_host.py --replot   # redraw the plot from the JSON
    # cold: 4 MiB written before every timed call, as a layer's K/V come back in a forward
    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/attention_host.py --flush-mb 4

One layer of ``--model`` (default Llama-3-8B: 32 query heads, 8 KV heads,
head dim 128), prefill (``ctx`` new tokens per request, causal) and decode
(one new token over ``ctx`` cached ones), bf16 and fp32 caches, per_layer
(and with ``--layouts`` all_layers: ``--layers`` layers in the buffer, layer
0 measured, so rows are strided). Each request's K/V are written once into a
vattn cache and copied into the other kernels' caches, so every kernel
attends over the same numbers.

  host       vattn's host kernel (vattn.attention.host_attention): one call
             for the whole batch on the cache, in place
  vattn      torch SDPA on k_cache[r, :n] views, one call per request, bf16
             rows converted to fp32 per call (vattn.attention.sdpa_attention,
             the adapter before the host kernel)
  padded     torch SDPA on one dense [B, H, ctx, D] batch (the cache a
             framework without vattn would pad to the longest request), in
             the cache's dtype
  paged-B    the paged way without a paged kernel: gather each request's
             blocks through its block table (B tokens per block), then the
             same SDPA call as vattn
  vllm       (when vllm is installed) vLLM-CPU's kernel
             (cpu_attention_with_kv_cache) on its paged cache of
             ``--vllm-block`` tokens per block (128, vLLM-CPU's default),
             filled with cpu_attn_reshape_and_cache and called with
             get_scheduler_metadata as vLLM's CPU attention backend calls them

Every kernel's output is checked against the vattn SDPA output before it is
timed; the kernels of one point are timed in alternation. Times are medians
over repetitions, in ms per layer for the whole batch, with tokens/s (new
tokens of the batch per second); the ratios paged / vattn and vllm / kernel
(time of vLLM's kernel over the kernel's: above 1, the kernel is faster) are
taken within one run. Warm by default: every call finds the K/V where the
call before left them (in cache, up to a few MiB). ``--flush-mb N`` writes N
MiB before every timed call instead, untimed, so that the K/V come from
memory as they do in a forward, where every other layer runs in between.
Writes benchmarks/results/attention_host_<machine>.json (cold:
attention_host_cold_<machine>.json; another ``--model`` than Llama-3-8B:
attention_host_[cold_]<model>_<machine>.json) and a plot (matplotlib; without it,
--replot draws it later).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from collections.abc import Callable

import torch
from attention_ab import MODELS, Case, grid, ints, measure, model_shape, paged_ratios, sdpa_kernels
from harness import RESULTS, draw, machine, machine_slug, pyplot, save_plot, write_json

from vattn.attention import host_attention, host_attention_info

# ---- kernels: each returns {name: callable} for one case --------------------------


def host_kernels(case: Case, blocks: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    # into a preallocated output, as vLLM's kernel is called below (and as vattn's vLLM backend calls it)
    out = torch.empty_like(case.q)
    return {"host": lambda: host_attention(case.q, case.k_cache, case.v_cache, case.batch, out=out)}


def padded_kernels(case: Case, blocks: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    """torch SDPA on one dense, padded [B, H, ctx, D] batch in the cache's dtype."""
    b = case.batch
    n, q_len = len(b.reqids), b.query_lens[0]
    k = torch.stack([case.k_cache[r, :case.ctx] for r in b.reqids]).transpose(1, 2)  # a copy: the dense cache
    v = torch.stack([case.v_cache[r, :case.ctx] for r in b.reqids]).transpose(1, 2)
    q = case.q.view(n, q_len, case.heads_q, case.head_dim).transpose(1, 2)

    def run() -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, enable_gqa=True)
        return out.transpose(1, 2).reshape(n * q_len, case.heads_q, case.head_dim)

    return {"padded": run}


FAMILIES = {"vattn": sdpa_kernels, "host": host_kernels, "padded": padded_kernels}  # vllm's: when installed


def vllm_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, reqids: list[int], length: int, block: int,
                     gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
    """(k_pool, v_pool, block_table, isa): the first ``length`` tokens of
    ``reqids``' slices copied into vLLM-CPU's paged cache of ``block`` tokens
    per block, the blocks shuffled (block_table row i: reqids[i]'s blocks), as
    vLLM's CPU attention backend lays it out and fills it."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    heads_kv, head_dim, dtype = k_cache.shape[2], k_cache.shape[3], k_cache.dtype
    n, per_req = len(reqids), -(-length // block)
    isa = _get_attn_isa(dtype, block, head_dim)
    # vLLM's KV tensor: [num_blocks, kv_heads, block, 2 * head_dim], K and V as halves of dim 2
    kv = torch.zeros(n * per_req, heads_kv, block, 2 * head_dim, dtype=dtype)
    k_pool, v_pool = kv.view(n * per_req, heads_kv, 2 * block, head_dim).chunk(2, dim=2)
    table = torch.randperm(n * per_req, generator=gen).view(n, per_req).to(torch.int32)
    pos = torch.arange(length)
    for i, r in enumerate(reqids):
        slots = table[i, pos // block].long() * block + pos % block
        ops.cpu_attn_reshape_and_cache(k_cache[r, :length], v_cache[r, :length], k_pool, v_pool, slots, isa)
    return k_pool, v_pool, table, isa


def vllm_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, isa: object,
                   query_start: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor) -> Callable[[], torch.Tensor]:
    """vLLM-CPU's kernel over a batch (``table``'s first rows are its requests),
    called as its CPU attention backend calls it: the scheduler metadata made
    once, then one ``cpu_attention_with_kv_cache`` per call, into ``out``."""
    from vllm import _custom_ops as ops

    n, heads_q, head_dim = len(seq_lens), q.shape[1], q.shape[2]
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=n, num_heads=heads_q, num_kv_heads=k_pool.shape[1], head_dim=head_dim, seq_lens=seq_lens,
        dtype=q.dtype, query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=True)
    table = table[:n].contiguous()
    scale = 1 / math.sqrt(head_dim)

    def run() -> torch.Tensor:
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=k_pool, value_cache=v_pool, output=out, query_start_loc=query_start,
            seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
            softcap=0.0, scheduler_metadata=metadata, s_aux=None)
        return out

    return run


def vllm_kernels(case: Case, blocks: list[int], block: int = 128) -> dict[str, Callable[[], torch.Tensor]]:
    """vLLM-CPU's attention kernel, called as its CPU attention backend calls
    it, on a paged cache of ``block`` tokens per block."""
    b = case.batch
    gen = torch.Generator().manual_seed(len(b.reqids) * 7919 + case.ctx)
    k_pool, v_pool, table, isa = vllm_paged_cache(case.k_cache, case.v_cache, b.reqids, case.ctx, block, gen)
    run = vllm_attention(case.q, k_pool, v_pool, table, isa, b.tensor("query_starts"), b.tensor("seq_lens"),
                         torch.empty_like(case.q))
    return {"vllm": run}


def vllm_available() -> str | None:
    """None when vLLM's CPU kernels can be called, else why not."""
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return "vLLM is installed but not its CPU build"
        current_platform.import_kernels()
        return None
    except ImportError as e:
        return f"vllm is not installed ({e})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3-8b",
                   help=f"one of {sorted(MODELS)} or name:heads_q:heads_kv:head_dim")
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["bfloat16", "float32"])
    p.add_argument("--layouts", type=lambda s: s.split(","), default=["per_layer"])
    p.add_argument("--layers", type=int, default=2, help="layers in the all_layers buffer")
    p.add_argument("--decode-ctx", type=ints, default=[128, 512, 2048, 8192])
    p.add_argument("--decode-batch", type=ints, default=[1, 4, 16, 64])
    p.add_argument("--decode-tokens", type=int, default=1 << 19, help="largest batch x ctx measured in decode")
    p.add_argument("--prefill-ctx", type=ints, default=[128, 512, 2048],
                   help="new tokens per request (a first prefill chunk)")
    p.add_argument("--prefill-batch", type=ints, default=[1, 4])
    p.add_argument("--prefill-tokens", type=int, default=1 << 11, help="largest batch x ctx measured in prefill")
    p.add_argument("--blocks", type=ints, default=[16], help="block sizes (tokens) of the paged baselines (0: none)")
    p.add_argument("--vllm-block", type=int, default=128, help="tokens per block of vLLM's paged cache")
    p.add_argument("--kernels", type=lambda s: s.split(","), default=list(FAMILIES) + ["vllm"],
                   help="kernels to time, comma-separated, of " + ", ".join([*FAMILIES, "vllm"]) +
                        " (the SDPA baselines hold dense or fp32 copies: a Llama-3-8B fp32 grid needs more "
                        "than 24 GiB with them)")
    p.add_argument("--min-seconds", type=float, default=0.3)
    p.add_argument("--flush-mb", type=int, default=0,
                   help="MiB written before every timed call (0: warm, back-to-back calls); results go to "
                        "attention_host_cold_<machine>.json")
    p.add_argument("--quick", action="store_true", help="tiny grid, for a smoke run")
    p.add_argument("--replot", action="store_true", help="only redraw the plot from this machine's JSON")
    args = p.parse_args()
    model = "" if args.model == "llama-3-8b" else f"{args.model.split(':')[0]}_"
    name = f"attention_host_{'cold_' if args.flush_mb > 0 else ''}{model}{machine_slug(machine())}"
    if args.replot:
        plot(json.loads((RESULTS / f"{name}.json").read_text())["results"], name)
        return
    if args.quick:
        args.decode_ctx, args.decode_batch, args.prefill_ctx, args.prefill_batch = [1024], [1, 4], [512], [1]
        args.min_seconds = 0.05
    args.blocks = [b for b in args.blocks if b > 0]
    args.models = [args.model]  # attention_ab's grid walks models
    shape = model_shape(args.model)

    unknown = sorted(set(args.kernels) - {*FAMILIES, "vllm"})
    if unknown:
        p.error(f"--kernels: {', '.join(unknown)} unknown (choose from {', '.join([*FAMILIES, 'vllm'])})")
    families: list[Callable[[Case, list[int]], dict[str, Callable[[], torch.Tensor]]]] = [
        FAMILIES[k] for k in FAMILIES if k in args.kernels]
    skipped = []
    why_not = vllm_available() if "vllm" in args.kernels else None
    if why_not:
        skipped.append(f"vllm: {why_not}")
    elif "vllm" in args.kernels:
        families.append(functools.partial(vllm_kernels, block=args.vllm_block))

    flush = torch.zeros(args.flush_mb << 18) if args.flush_mb > 0 else None
    points = grid(args)
    rows = []
    started = time.perf_counter()
    for n, (_, dtype_name, phase, layout, batch, ctx) in enumerate(points, 1):
        dtype = getattr(torch, dtype_name)
        case = Case(phase, layout, batch, ctx, args.layers, "cpu", dtype, args.blocks, shape)
        try:
            times = measure(case, families, args.blocks, args.min_seconds,
                            f"{dtype_name} {phase} {layout} B={batch} ctx={ctx}", skipped, flush)
        finally:
            case.close()
        tokens = batch * (ctx if phase == "prefill" else 1)
        row = dict(dtype=dtype_name, phase=phase, layout=layout, batch=batch, ctx=ctx, ms=times,
                   tokens_per_s={k: round(tokens / v * 1e3, 1) for k, v in times.items() if v})
        row["paged_over_vattn"] = paged_ratios(times)
        if times.get("vllm"):
            row["vllm_over"] = {k: round(times["vllm"] / v, 3) for k, v in times.items() if v and k != "vllm"}
        rows.append(row)
        shown = "  ".join(f"{k} {v:.3f}" for k, v in times.items() if v is not None)
        ratio = f"  host vs vllm {row['vllm_over']['host']:.2f}x" if "host" in row.get("vllm_over", {}) else ""
        print(f"[{n}/{len(points)} {time.perf_counter() - started:5.0f}s] {dtype_name:8s} {phase:7s} {layout:10s} "
              f"B={batch:<3d} ctx={ctx:<6d} ms: {shown}{ratio}", flush=True)

    m = machine()
    path = write_json(name, {
        "benchmark": "attention_host",
        "machine": m,
        "model": args.model,
        "shape": {"heads_q": shape[0], "heads_kv": shape[1], "head_dim": shape[2], "dtypes": args.dtypes,
                  "all_layers_layers": args.layers, "vllm_block": args.vllm_block},
        "device": "cpu",
        "host_kernel": host_attention_info(),
        "unit": "ms per layer for the whole batch (median); tokens/s = new tokens of the batch per second",
        "flush_mb": args.flush_mb,
        "results": rows,
        "not_measured": skipped,
    })
    print(f"wrote {path}")
    for line in skipped:
        print("not measured:", line)
    draw(plot, rows, name, "attention_host.py")


def plot(rows: list[dict], name: str) -> None:
    """Row 1: vLLM's kernel time / host kernel time (above 1: the host kernel
    is faster). Row 2: per-request SDPA and padded SDPA time / host kernel
    time. Row 3: paged gather time / vattn SDPA time (the paper's figure)."""
    plt = pyplot()
    phases = [ph for ph in ("decode", "prefill") if any(r["phase"] == ph for r in rows)]
    panels = []
    if any("host" in r["ms"] for r in rows):
        if any("vllm_over" in r for r in rows):
            panels.append(("vLLM kernel time / host kernel time", lambda r: r.get("vllm_over", {}).get("host"), None))
        if any(k in r["ms"] for r in rows for k in ("vattn", "padded")):
            panels.append(("SDPA time / host kernel time", None, ("vattn", "padded")))
    if any(r.get("paged_over_vattn") for r in rows):
        panels.append(("paged gather time / vattn SDPA time", None, None))
    fig, axes = plt.subplots(len(panels), len(phases), figsize=(6.5 * len(phases), 3.8 * len(panels)),
                             squeeze=False)
    styles = {"bfloat16": "-", "float32": "--", "float16": ":"}
    for row_axes, (title, ratio, over) in zip(axes, panels):
        for ax, phase in zip(row_axes, phases):
            for (dtype, layout, batch) in sorted({(r["dtype"], r["layout"], r["batch"]) for r in rows
                                                  if r["phase"] == phase}):
                sel = [r for r in rows if (r["phase"], r["dtype"], r["layout"], r["batch"]) ==
                       (phase, dtype, layout, batch)]
                series = []
                if ratio:
                    series = [("host", [(r["ctx"], ratio(r)) for r in sel])]
                elif over:
                    series = [(k, [(r["ctx"], r["ms"][k] / r["ms"]["host"]) for r in sel
                                   if r["ms"].get(k) and r["ms"].get("host")]) for k in over]
                else:
                    series = [(k, [(r["ctx"], r["paged_over_vattn"].get(k)) for r in sel])
                              for k in sorted({k for r in sel for k in r["paged_over_vattn"]})]
                for kname, pts in series:
                    pts = [(x, y) for x, y in pts if y]
                    if pts:
                        xs, ys = zip(*pts)
                        label = f"{dtype} {layout} B={batch}" + (f" {kname}" if over or not ratio else "")
                        ax.plot(xs, ys, styles.get(dtype, "-"), marker="o" if kname != "padded" else "x",
                                label=label)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_xlabel("context length (tokens)" if phase == "decode" else "prefill chunk (tokens)")
            ax.set_ylabel("ratio")
            ax.set_title(f"{phase}: {title}", fontsize=10)
            ax.legend(fontsize=6, ncol=2)
    save_plot(fig, name)


if __name__ == "__main__":
    main()
