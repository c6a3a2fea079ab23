"""Attention kernel time on the vattn cache against a paged cache holding the
same K/V (vAttention paper, Figs. 3, 4 and 9b).

    python benchmarks/attention_ab.py            # the grid below, a few minutes on 2 CPU cores
    python benchmarks/attention_ab.py --quick    # a smoke run

One attention layer per model shape (``--models``; Llama-3-8B: 32 query
heads, 8 KV heads, head dim 128; Llama-3-70B per GPU at tensor parallelism
4: 16 query heads, 2 KV heads), dtypes ``--dtypes``, prefill (``ctx`` new
tokens per request, causal: a prefill chunk) and decode (one new token over
``ctx`` cached ones), per_layer and all_layers layouts (all_layers with
``--layers`` layers in the buffer, layer 0 measured, so rows are strided).
Each request's K/V are written once into a vattn cache and copied into a
paged block pool with a shuffled block table, so both sides attend over the
same numbers.

CPU (always):
  vattn      torch SDPA on k_cache[r, :n] views (vattn.attention.sdpa_attention)
  paged-B    the paged way without a paged kernel: gather each request's
             blocks through its block table (B tokens per block), then the
             same SDPA call
GPU (when torch sees one):
  vattn / paged-B       as above on the GPU (paged-B for the first block size only)
  fa2-torch             torch's built-in FlashAttention-2 kernel
                        (torch.ops.aten._flash_attention_forward, varlen) on the
                        vattn cache as vattn runs it (TorchFlashKernel, its
                        input checks included): each request's keys start at
                        reqid * S (S: rows per slot, >= L since slots are whole
                        pages) and seqused_k says how many are valid; no block
                        table. Results before TorchFlashKernel existed
                        (attention_ab_h100-80gb-hbm3.json) called the op alone.
  fa2-torch-paged-B     the same kernel with its block_table on the paged pool
                        (where this torch has it; FlashAttention-2 takes only
                        blocks that are multiples of 256 there)
  fa2 / fa2-paged-B     the flash-attn package, when installed:
                        flash_attn_with_kvcache with cache_batch_idx on the vattn
                        cache vs block_table on the paged pool
  fi-* / fi-paged-B     FlashInfer, when importable: single prefill per request
                        (prefill) and the batched wrapper on the vattn cache
                        (fi-batched: the cache cut into vattn-page-sized pages
                        whose indices are ranges; fi-batched-request: one page
                        per request, where FlashInfer cannot split a request's
                        keys) vs its paged wrappers
A kernel that refuses a shape is listed under "not_measured" with its error.

Every kernel's output is checked against the vattn SDPA output before it is
timed; the kernels of one point are timed in alternation (on a GPU with CUDA
events around enough calls to last about a millisecond). Times are medians
over repetitions, in ms per layer for the whole batch; the ratio
paged / vattn is taken within one run. ``--time-budget-s`` stops the grid
(points left are listed as not measured). Writes
benchmarks/results/attention_ab_<machine>.json and a plot.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch
from harness import machine, machine_slug, pyplot, save_plot, write_json

import vattn
from vattn.attention import AttentionBatch, FlashInferAttention, flash_attn_attention, sdpa_attention, sdpa_dense
from vattn.kernels import KERNELS

# (query heads, KV heads, head dim) of one GPU's share of each model
MODELS = {
    "llama-3-8b": (32, 8, 128),
    "llama-3-70b-tp4": (16, 2, 128),
    # the small models serving runs on a CPU: few KV heads of 64, so a token's K row is 128-256 bytes
    "qwen2-0.5b": (14, 2, 64),
    "tinyllama-1.1b": (32, 4, 64),
    "llama-3.2-1b": (32, 8, 64),
    "small-8q2kv": (8, 2, 64),  # the 4-layer model of the vLLM serving traces' long suite (hidden 512)
    "short-4q2kv": (4, 2, 128),  # the 8-layer model of the vLLM serving traces' short suite (hidden 512)
}
"""(query heads, KV heads, head dim) per model name."""


class Case:
    """One (phase, layout, batch, ctx) point: a vattn cache and a paged copy."""

    def __init__(self, phase: str, layout: str, batch: int, ctx: int, layers: int, device: str,
                 dtype: torch.dtype, block_sizes: list[int], heads: tuple[int, int, int]) -> None:
        self.phase, self.layout, self.batch_size, self.ctx = phase, layout, batch, ctx
        self.heads_q, self.heads_kv, self.head_dim = heads
        self.device = torch.device(device)
        gen = torch.Generator(device="cpu").manual_seed(batch * 100003 + ctx)
        self.kv = vattn.KVCacheManager(num_layers=layers if layout == "all_layers" else 1,
                                       num_kv_heads=self.heads_kv, head_dim=self.head_dim, dtype=dtype,
                                       max_batch_size=batch, max_context_len=ctx, device=device, layout=layout,
                                       policy={"background": False, "eager": False})
        reqids = [self.kv.alloc_reqid() for _ in range(batch)]
        assert self.kv.step([ctx] * batch)
        self.k_cache, self.v_cache = self.kv.layer(0)
        for r in reqids:  # one request at a time keeps the host's peak memory low
            for cache in (self.k_cache, self.v_cache):
                cache[r].copy_(torch.randn(ctx, self.heads_kv, self.head_dim, generator=gen).to(dtype))
        q_len = ctx if phase == "prefill" else 1
        cached = [0 if phase == "prefill" else ctx - 1] * batch
        self.batch = AttentionBatch(reqids, cached, [q_len] * batch, device=device)
        self.q = torch.randn(batch * q_len, self.heads_q, self.head_dim, generator=gen).to(dtype=dtype, device=device)
        self.paged = {b: self._paged_copy(b, gen) for b in block_sizes}

    def _paged_copy(self, block: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_pool, v_pool, block_table): the same K/V in shuffled blocks of ``block`` tokens."""
        per_req = -(-self.ctx // block)
        order = torch.randperm(self.batch_size * per_req, generator=gen)
        table = order.view(self.batch_size, per_req).to(torch.int32)
        pos = torch.arange(self.ctx)
        pools = []
        for cache in (self.k_cache, self.v_cache):
            pool = torch.zeros(self.batch_size * per_req * block, self.heads_kv, self.head_dim, dtype=cache.dtype,
                               device=self.device)
            for i, r in enumerate(self.batch.reqids):
                dest = table[i, pos // block].long() * block + pos % block
                pool[dest.to(self.device)] = cache[r, :self.ctx]
            pools.append(pool.view(-1, block, self.heads_kv, self.head_dim))
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


def sdpa_backend(case: Case) -> str | None:
    """The kernel torch's SDPA picks for the point's first request, called as
    vattn's SDPA kernel calls it (``torch._fused_sdp_choice`` with
    :func:`vattn.kernels.sdpa.sdpa_call`'s arguments): FLASH_ATTENTION,
    EFFICIENT_ATTENTION, CUDNN_ATTENTION, MATH...; None where this torch
    cannot say."""
    from torch.nn.attention import SDPBackend

    from vattn.kernels.sdpa import sdpa_call

    b = case.batch
    s, e = b.query_starts[0], b.query_starts[1]
    seq_len = b.seq_lens[0]
    tensors, options, _ = sdpa_call(case.q[s:e], case.k_cache[b.reqids[0], :seq_len],
                                    case.v_cache[b.reqids[0], :seq_len])
    try:
        return SDPBackend(torch._fused_sdp_choice(*tensors, dropout_p=0.0, **options)).name
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def sdpa_kernels(case: Case, blocks: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    fns = {"vattn": lambda: sdpa_attention(case.q, case.k_cache, case.v_cache, case.batch)}
    # On a GPU the gather baseline is a Python loop per request: one block size says enough.
    for block in blocks[:1] if case.device.type == "cuda" else blocks:
        fns[f"paged-{block}"] = lambda block=block: paged_sdpa(case, block)
    return fns


def fa2_torch_kernels(case: Case, blocks: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    """torch's built-in FlashAttention-2 (varlen) on the vattn cache, as vattn
    runs it (vattn.kernels.TorchFlashKernel), and, where the op has a block
    table, the same op on the paged pool with the same index tensors."""
    kernel = KERNELS["torch_flash"]
    available = kernel.available()
    if not available:
        raise RuntimeError(available.reason)
    b = case.batch
    plan = kernel.plan(b)
    fns = {"fa2-torch": lambda: kernel.run(plan, case.q, case.k_cache, case.v_cache)}
    op = kernel.op()
    if "block_table" in {a.name for a in op.default._schema.arguments}:
        cu_k = torch.tensor([0] + list(itertools.accumulate(b.seq_lens)), dtype=torch.int32, device=case.device)
        for block in blocks:
            k_pool, v_pool, table = case.paged[block]
            fns[f"fa2-torch-paged-{block}"] = lambda k_pool=k_pool, v_pool=v_pool, table=table: op(
                case.q, k_pool, v_pool, plan.cu_seqlens_q, cu_k, plan.max_seqlen_q, plan.max_seqlen_k, 0.0, True,
                False, seqused_k=plan.seqused_k, block_table=table)[0]
    return fns


def fa2_kernels(case: Case, blocks: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    import flash_attn

    b = case.batch
    q_len = b.query_lens[0]
    q = case.q.view(len(b.reqids), q_len, case.heads_q, case.head_dim)
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
    fns = {}
    for name, presentation in (("fi-batched", "pages"), ("fi-batched-request", "request")):
        fi = FlashInferAttention(device=case.device, presentation=presentation)
        try:
            fi.plan(b, case.heads_q, case.heads_kv, case.head_dim, case.ctx, q_dtype=case.q.dtype,
                    k_cache=case.k_cache, page_tokens=case.kv.page_tokens)
        except ValueError as e:  # a shape this presentation refuses: measure() records it
            fns[name] = refused(e)
            continue
        fns[name] = lambda fi=fi: fi.run(case.q, case.k_cache, case.v_cache)
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
            w.plan(*pages, case.heads_q, case.heads_kv, case.head_dim, block, q_data_type=case.q.dtype)
        else:
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            w.plan(b.tensor("query_starts"), *pages, case.heads_q, case.heads_kv, case.head_dim, block,
                   causal=True, q_data_type=case.q.dtype)
        fns[f"fi-paged-{block}"] = lambda w=w, k_pool=k_pool, v_pool=v_pool: w.run(case.q, (k_pool, v_pool))
    return fns


def refused(error: Exception) -> Callable[[], torch.Tensor]:
    """A kernel that refused the shape when it planned: raises ``error`` when called."""

    def call() -> torch.Tensor:
        raise error

    return call


# ---- timing -----------------------------------------------------------------------


def time_interleaved(fns: dict[str, Callable[[], torch.Tensor]], device: torch.device, min_seconds: float,
                     min_reps: int, flush: torch.Tensor | None = None) -> dict[str, float]:
    """Median ms per call of each fn, timed in alternation so that drift of
    the machine (frequency, neighbours) touches every kernel alike. Each
    round runs every kernel for about the same time (a fast kernel gets many
    calls per round, not as few samples as the slowest kernel of the point).
    On a GPU one sample is CUDA events around as many back-to-back calls as
    last about a millisecond (launch gaps of tiny decode kernels are not in
    it); on the CPU every call is a sample. With ``flush`` (CPU only) every
    call runs cold: the tensor is written, untimed, before it (a layer's K/V
    in a real forward come back after every other layer's work)."""
    if not fns:
        return {}
    cuda = device.type == "cuda"
    first = {}
    for name, fn in fns.items():
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        first[name] = max(time.perf_counter() - t, 1e-6)
    # calls per round: GPU, enough for ~1 ms per sample; CPU, enough for half the slowest kernel's call
    share = max(first.values()) / 2
    inner = {name: max(1, min(100, int((1e-3 if cuda else share) / first[name]))) for name in fns}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < 200 and (rounds < min_reps or time.perf_counter() - start < min_seconds * len(fns)):
        rounds += 1
        for name, fn in fns.items():
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(inner[name]):
                    fn()
                end.record()
                end.synchronize()
                samples[name].append(begin.elapsed_time(end) / inner[name])
            else:
                for _ in range(inner[name]):
                    if flush is not None:
                        flush.add_(1.0)
                    t = time.perf_counter()
                    fn()
                    samples[name].append((time.perf_counter() - t) * 1e3)
    return {name: statistics.median(v) for name, v in samples.items()}


def measure(case: Case, families: list[Callable[[Case, list[int]], dict[str, Callable[[], torch.Tensor]]]],
            blocks: list[int], min_seconds: float, label: str, skipped: list[str],
            flush: torch.Tensor | None = None) -> dict[str, float | None]:
    """Median ms of every kernel of every family on one case. Each kernel's
    output must match the vattn SDPA output before it is timed (that call is
    also its warm-up); a family or kernel that refuses the shape or disagrees
    is listed in ``skipped`` (with ``label``) and timed as None. ``flush``:
    see :func:`time_interleaved`."""
    times: dict[str, float | None] = {}
    reference = sdpa_attention(case.q, case.k_cache, case.v_cache, case.batch).float()
    checked = {}
    for fam in families:
        try:
            kernels = fam(case, blocks)
        except Exception as e:  # noqa: BLE001 - a kernel that refuses a shape is recorded, not fatal
            skipped.append(f"{getattr(fam, 'func', fam).__name__} {label}: "  # func: a functools.partial's
                           f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        for name, fn in kernels.items():
            try:
                out = fn().reshape(reference.shape).float()
                torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2)
                checked[name] = fn
            except Exception as e:  # noqa: BLE001
                times[name] = None
                skipped.append(f"{name} {label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    times.update(time_interleaved(checked, case.device, min_seconds, 3, flush))
    return times


def grid(args: argparse.Namespace) -> list[tuple[str, str, str, str, int, int]]:
    """(model, dtype, phase, layout, batch, ctx), in the order a time budget
    cuts least: per dtype and layout, the models' decode and prefill lists
    taken in turn, one point of each per round, the most tokens first. So a
    run cut short has measured prefill and decode of every model at their
    largest sizes before it measures any list's smaller ones."""
    points = []
    for dtype in args.dtypes:
        for layout in args.layouts:
            lists = []
            for model in args.models:
                for phase, ctxs, batches, budget in (("decode", args.decode_ctx, args.decode_batch,
                                                      args.decode_tokens),
                                                     ("prefill", args.prefill_ctx, args.prefill_batch,
                                                      args.prefill_tokens)):
                    sizes = sorted(((batch, ctx) for ctx in ctxs for batch in batches if batch * ctx <= budget),
                                   key=lambda size: (-size[0] * size[1], -size[1]))
                    lists.append([(model, dtype, phase, layout, batch, ctx) for batch, ctx in sizes])
            for round_points in itertools.zip_longest(*lists):
                points.extend(p for p in round_points if p is not None)
    return points


def model_shape(name: str) -> tuple[int, int, int]:
    """A name of MODELS, or "name:heads_q:heads_kv:head_dim"."""
    if name in MODELS:
        return MODELS[name]
    parts = name.split(":")
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"--models: {name!r} is neither one of {sorted(MODELS)} nor "
                                         "name:heads_q:heads_kv:head_dim")
    return int(parts[1]), int(parts[2]), int(parts[3])


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if gpu else "cpu")
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["bfloat16", "float16"] if gpu else ["float32"],
                   help="comma list; float32 on the CPU: torch's CPU SDPA is fastest there")
    p.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS),
                   help=f"comma list of {sorted(MODELS)} or name:heads_q:heads_kv:head_dim")
    p.add_argument("--layouts", type=lambda s: s.split(","), default=["per_layer", "all_layers"])
    p.add_argument("--layers", type=int, default=2, help="layers in the all_layers buffer")
    p.add_argument("--decode-ctx", type=ints, default=[1024, 4096, 16384, 32768])
    p.add_argument("--decode-batch", type=ints, default=[1, 16, 64, 256] if gpu else [1, 8, 64])
    p.add_argument("--decode-tokens", type=int, default=(1 << 21) if gpu else 1 << 18,
                   help="largest batch x ctx measured in decode")
    p.add_argument("--prefill-ctx", type=ints, default=[512, 1024, 2048, 4096, 8192] if gpu else [1024, 2048, 4096],
                   help="prefill chunk lengths (tokens)")
    p.add_argument("--prefill-batch", type=ints, default=[1, 4, 16] if gpu else [1, 4])
    p.add_argument("--prefill-tokens", type=int, default=(1 << 17) if gpu else 1 << 13,
                   help="largest batch x ctx measured in prefill")
    p.add_argument("--blocks", type=ints, default=[16, 32, 256] if gpu else [16],
                   help="block sizes (tokens) of the paged baselines")
    p.add_argument("--min-seconds", type=float, default=0.3)
    p.add_argument("--time-budget-s", type=float, default=None, help="stop the grid after this many seconds")
    p.add_argument("--quick", action="store_true", help="tiny grid, for a smoke run")
    p.add_argument("--compile-only", action="store_true",
                   help="call every FlashInfer kernel of the grid once, with progress, and measure nothing: its "
                        "first-use JIT compile (minutes per shape) then happens here, before a timed run")
    args = p.parse_args()
    if args.quick:
        args.decode_ctx, args.decode_batch, args.prefill_ctx, args.prefill_batch = [1024], [1, 4], [512], [1]
        args.min_seconds = 0.05
    shapes = {m: model_shape(m) for m in args.models}
    device = torch.device(args.device)

    families: list[Callable[[Case, list[int]], dict[str, Callable[[], torch.Tensor]]]] = [sdpa_kernels]
    skipped = []
    if device.type == "cuda":
        families.append(fa2_torch_kernels)
        for name, module, fam in (("FlashAttention-2 (flash-attn package)", "flash_attn", fa2_kernels),
                                  ("FlashInfer", "flashinfer", flashinfer_kernels)):
            try:
                __import__(module)
                families.append(fam)
            except Exception as e:  # noqa: BLE001 - a broken install (a failed JIT build) is a skip too
                skipped.append(f"{name}: python package {module!r} not importable ({type(e).__name__}: {e})")
    else:
        skipped.append("fa2-torch, flash-attn and FlashInfer kernels: CUDA only")

    points = grid(args)
    if args.compile_only:
        compile_kernels(points, args, shapes, flashinfer_kernels in families)
        return
    rows = []
    started = time.perf_counter()
    for n, (model, dtype_name, phase, layout, batch, ctx) in enumerate(points, 1):
        if args.time_budget_s is not None and time.perf_counter() - started > args.time_budget_s:
            skipped.append(f"{len(points) - n + 1} grid points after {args.time_budget_s:.0f} s (--time-budget-s), "
                           f"from {model} {dtype_name} {phase} {layout} B={batch} ctx={ctx} on")
            break
        dtype = getattr(torch, dtype_name)
        case = Case(phase, layout, batch, ctx, args.layers, args.device, dtype, args.blocks, shapes[model])
        try:
            times = measure(case, families, args.blocks, args.min_seconds,
                            f"{model} {dtype_name} {phase} {layout} B={batch} ctx={ctx}", skipped)
            backend = sdpa_backend(case)
        finally:
            case.close()
        # sdpa_backend: which of torch's kernels the "vattn" (SDPA) time is of
        row = dict(model=model, dtype=dtype_name, phase=phase, layout=layout, batch=batch, ctx=ctx, ms=times,
                   sdpa_backend=backend)
        row["paged_over_vattn"] = paged_ratios(times)
        rows.append(row)
        shown = "  ".join(f"{k} {v:.3f}" for k, v in times.items() if v is not None)
        print(f"[{n}/{len(points)}] {model} {dtype_name} {phase:7s} {layout:10s} B={batch:<3d} ctx={ctx:<6d} ms: "
              f"{shown}", flush=True)

    m = machine()
    name = f"attention_ab_{machine_slug(m)}"
    path = write_json(name, {
        "benchmark": "attention_ab",
        "machine": m,
        "models": {m: dict(zip(("heads_q", "heads_kv", "head_dim"), shapes[m])) for m in args.models},
        "dtypes": args.dtypes,
        "all_layers_layers": args.layers,
        "ratios": "paged_over_vattn: each paged kernel's time over the same library's kernel on the vattn "
                  "cache (paged-B / vattn for SDPA, fa2-torch-paged-B / fa2-torch, fa2-paged-B / fa2, "
                  "fi-paged-B / fi-batched); > 1: vattn faster",
        "device": str(device),
        "unit": "ms per layer for the whole batch (median)",
        "results": rows,
        "not_measured": skipped,
    })
    print(f"wrote {path}")
    for line in skipped:
        print("not measured:", line)
    plot(rows, name, args.blocks)


def compile_kernels(points: list[tuple[str, str, str, str, int, int]], args: argparse.Namespace,
                    shapes: dict[str, tuple[int, int, int]], have_flashinfer: bool) -> None:
    """Every FlashInfer kernel the grid would time, called once per shape it
    compiles for (heads, head dim, dtype, phase; batch and context do not
    change the kernel), printing progress; FlashInfer keeps what it compiled
    on disk for the timed run."""
    if not have_flashinfer:
        print("compile-only: FlashInfer is not importable here; nothing to compile")
        return
    todo: dict[tuple, tuple] = {}
    for model, dtype_name, phase, layout, batch, ctx in points:
        todo.setdefault((shapes[model], dtype_name, phase), (model, dtype_name, phase, layout, 1, min(ctx, 512)))
    started = time.perf_counter()
    for n, (model, dtype_name, phase, layout, batch, ctx) in enumerate(todo.values(), 1):
        print(f"[compile {n}/{len(todo)}] FlashInfer for {model} {dtype_name} {phase} ...", flush=True)
        case = Case(phase, layout, batch, ctx, args.layers, args.device, getattr(torch, dtype_name), args.blocks,
                    shapes[model])
        try:
            for name, fn in flashinfer_kernels(case, args.blocks).items():
                try:
                    fn()
                except ValueError as e:  # a shape the kernel refuses: the timed run records it
                    print(f"  {name}: refused ({e})", flush=True)
            torch.cuda.synchronize()
        finally:
            case.close()
        print(f"[compile {n}/{len(todo)}] done, {time.perf_counter() - started:.0f} s so far", flush=True)


def paged_ratios(times: dict[str, float | None]) -> dict[str, float]:
    """Each paged kernel's time over its library's kernel on the vattn cache."""
    out = {}
    for name, t in times.items():
        if "paged-" not in name or not t:
            continue
        family = name.rsplit("-paged-", 1)[0] if "-paged-" in name else None
        base = times.get({None: "vattn", "fi": "fi-batched"}.get(family, family))
        if base:
            out[name] = round(t / base, 3)
    return out


def plot(rows: list[dict], name: str, blocks: list[int]) -> None:
    if not rows:
        print("nothing measured: no plot")
        return
    plt = pyplot()
    phases = [ph for ph in ("decode", "prefill") if any(r["phase"] == ph for r in rows)]
    fig, axes = plt.subplots(1, len(phases), figsize=(6.5 * len(phases), 4.2), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        first = (rows[0]["model"], rows[0]["dtype"])  # the plot shows the first model and dtype
        for layout, style in (("per_layer", "-"), ("all_layers", "--")):
            for batch in sorted({r["batch"] for r in rows if r["phase"] == phase}):
                sel = [r for r in rows if (r["phase"], r["layout"], r["batch"]) == (phase, layout, batch)
                       and (r["model"], r["dtype"]) == first]
                key = f"paged-{blocks[0]}"
                pts = [(r["ctx"], r["paged_over_vattn"][key]) for r in sel if key in r["paged_over_vattn"]]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, style, marker="o", label=f"{layout} B={batch}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(f"paged (block {blocks[0]}) time / vattn time")
        ax.set_title(f"{phase}, {first[0]} {first[1]}: SDPA, gather-then-attend vs contiguous", fontsize=9)
        ax.legend(fontsize=7)
    save_plot(fig, name)


if __name__ == "__main__":
    main()
