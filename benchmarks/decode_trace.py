"""Per-iteration `step` latency in a decode loop, background mapper on vs off
(vAttention paper, Fig. 10), and on a GPU the mapping time left on the
critical path of real decode iterations, with and without CUDA graphs.

    python benchmarks/decode_trace.py [--iterations N] [--compute-ms MS]          # host backend
    python benchmarks/decode_trace.py --device cuda --forward model [--graphs both]  # a GPU

Requests with Llama-3-8B KV shapes (32 layers, 8 KV heads x 128, fp16) start
from 1000-token prompts (``--stagger``: request r from 1000 + r * P / B, so
page crossings spread over the iterations, P = tokens per page) and decode
one token per iteration. Each iteration is ``step`` (timed: the critical
path), then the forward:

  --forward sleep  the loop sleeps ``--compute-ms`` (on a GPU the CPU is free
                   while the model runs, and so is it here); any backend
  --forward model  per layer, the new token's K/V written at row len-1 of
                   each request and varlen attention over rows [0, len) of
                   the vattn cache (CUDA: torch's FlashAttention-2 kernel with
                   seqused_k; CPU: the same contract computed request by
                   request), then two matmuls standing for the MLP (hidden
                   ``--hidden``, x4); then a synchronize, as sampling does.
                   ``--graphs on`` replays the whole forward as one CUDA
                   graph, captured inside ``graph_capture()`` after the first
                   step (lengths come from a device tensor, so the graph is
                   fixed). The kernels read the cache as rows of every slot:
                   a slot is whole pages, so it holds at least
                   max_context_len rows and request r starts at row r * S,
                   S = slot bytes / row stride (``vattn.kernels.cache_rows``).

Mapping modes: ``sync`` (no background mapper: every page on the critical
path), ``mapper`` (the background mapper maps one token ahead while the
forward runs) and, with a model forward, ``premapped`` (every page mapped
before the loop: the iteration time with no mapping at all, the baseline
the other two are compared with). Per run: step latency (median, on
page-crossing iterations and others), iteration wall time, pages mapped per
step and on which thread (sync_page_maps on the critical path,
background_page_maps overlapped with the forward), and the time steps
waited for the mapper. Targets (host): with the mapper on,
``sync_page_maps`` stays 0 after the prefill, and page-crossing iterations
cost at most 1.2x the others. Writes
benchmarks/results/decode_trace_<machine>.json and a plot.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from harness import machine, machine_slug, pyplot, save_plot, write_json

import vattn
from vattn.kernels import cache_rows

KiB, MiB = 1024, 1024 * 1024
LAYERS, KV_HEADS, HEAD_DIM, PROMPT = 32, 8, 128, 1000
Q_HEADS, HIDDEN = 32, 4096


def varlen_reference(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, cu_q: torch.Tensor,
                     starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """FlashAttention-2's varlen contract with ``seqused_k``, request by
    request: request i's queries ``q[cu_q[i]:cu_q[i+1]]`` attend causally to
    keys ``k_rows[starts[i] : starts[i] + lens[i]]``. q ``[T, Hq, D]``,
    k/v rows ``[rows, Hkv, D]``; returns ``[T, Hq, D]``."""
    out = torch.empty_like(q)
    for i in range(len(lens)):
        s, e, k0, n = int(cu_q[i]), int(cu_q[i + 1]), int(starts[i]), int(lens[i])
        qi = q[s:e].transpose(0, 1)[None].float()
        ki, vi = (rows[k0:k0 + n].transpose(0, 1)[None].float() for rows in (k_rows, v_rows))
        mask = torch.ones(e - s, n, dtype=torch.bool).tril(n - (e - s))  # queries at the last positions
        out[s:e] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    return out


class ModelForward:
    """One decode iteration of a Llama-3-8B-shaped model on the vattn cache.

    Shapes are fixed (batch B, every reqid 0..B-1 active); the lengths live
    in the tensor ``lens`` ([B] int32, on the cache's device), so on a GPU
    the forward can be captured once and replayed. Per layer: K/V of the new
    token written at row ``lens[r] - 1``, varlen attention over rows
    ``[0, lens[r])`` of each request (FlashAttention-2 on CUDA, its contract
    computed request by request on the CPU), and a
    ``[B, hidden] x [hidden, 4 hidden] x [4 hidden, hidden]`` MLP stand-in.
    ``attention`` keeps the last layer's attention output ``[B, 32, 128]``.
    """

    def __init__(self, kv: vattn.KVCacheManager, batch: int, dtype: torch.dtype, hidden: int = HIDDEN) -> None:
        self.kv, self.batch = kv, batch
        dev = kv.device
        self.cuda = dev.type == "cuda"
        if self.cuda:
            self.op = torch.ops.aten._flash_attention_forward
            if "seqused_k" not in {a.name for a in self.op.default._schema.arguments}:
                raise RuntimeError("torch's _flash_attention_forward has no seqused_k in this version")
        gen = torch.Generator(device=dev).manual_seed(0)
        self.max_k = kv.config.max_context_len
        _, rows_per_slot = cache_rows(kv.layer(0)[0])  # slots are whole pages: >= max_context_len rows
        self.lens = torch.ones(batch, dtype=torch.int32, device=dev)
        self.rows = torch.arange(batch, device=dev)
        self.cu_q = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        self.starts = torch.arange(batch + 1, dtype=torch.int32, device=dev) * rows_per_slot
        self.q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=dev, dtype=dtype, generator=gen)
        self.new_kv = torch.randn(batch, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype, generator=gen)
        self.x = torch.randn(batch, hidden, device=dev, dtype=dtype, generator=gen)
        self.w_up = torch.randn(hidden, 4 * hidden, device=dev, dtype=dtype, generator=gen) * hidden**-0.5
        self.w_down = torch.randn(4 * hidden, hidden, device=dev, dtype=dtype, generator=gen) * (4 * hidden) ** -0.5
        self.out = torch.empty(batch, hidden, device=dev, dtype=dtype)
        self.attention = torch.empty_like(self.q)

    def __call__(self) -> None:
        pos = (self.lens - 1).long()
        h = self.x
        for i in range(self.kv.config.num_layers):
            k, v = self.kv.layer(i)
            k[self.rows, pos] = self.new_kv
            v[self.rows, pos] = self.new_kv
            (k_rows, _), (v_rows, _) = cache_rows(k), cache_rows(v)
            if self.cuda:
                out = self.op(self.q, k_rows, v_rows, self.cu_q, self.starts, 1, self.max_k, 0.0, True, False,
                              seqused_k=self.lens)[0]
            else:
                out = varlen_reference(self.q, k_rows, v_rows, self.cu_q, self.starts, self.lens)
            self.attention.copy_(out)
            h = (h @ self.w_up) @ self.w_down
        self.out.copy_(h)


def run(device: str, forward: str, page_size: int | None, layout: str, mode: str, graphs: bool, batch: int,
        iterations: int, compute_s: float, stagger: bool, layers: int = LAYERS, hidden: int = HIDDEN) -> dict:
    cuda = device.startswith("cuda") and forward == "model"  # torch's CUDA tensors on the cache
    kv = vattn.KVCacheManager(num_layers=layers, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float16,
                              max_batch_size=batch, max_context_len=PROMPT + iterations + 1024, page_size=page_size,
                              layout=layout, device=device, policy={"background": mode == "mapper", "eager": False},
                              sync_streams=torch.cuda.current_stream() if cuda else None)
    with kv:
        for _ in range(batch):
            kv.alloc_reqid()
        tokens_per_page = kv.page_size // kv.config.token_bytes_per_buffer
        lens = [PROMPT + (r * tokens_per_page // batch if stagger else 0) for r in range(batch)]
        if mode == "premapped":
            assert kv.step([n + iterations for n in lens])
        assert kv.step(lens)  # prefill
        fwd = ModelForward(kv, batch, torch.float16, hidden) if forward == "model" else None
        graph = None
        if fwd is not None:
            fwd.lens.copy_(torch.tensor(lens, dtype=torch.int32))
            for _ in range(3 if cuda else 1):  # warm-up: kernels chosen, workspaces allocated
                fwd()
            synchronize(cuda)
            if graphs:
                graph = torch.cuda.CUDAGraph()
                with kv.graph_capture(), torch.cuda.graph(graph):
                    fwd()
                torch.cuda.synchronize()
        kv.wait_idle()
        s0 = kv.stats()
        latencies, iteration_us, crossing, pages = [], [], [], []  # pages: what each step needed mapped
        for i in range(iterations):
            t_iter = time.perf_counter()
            if fwd is None:
                time.sleep(compute_s)
            new = [n + 1 for n in lens]
            t = time.perf_counter()
            assert kv.step(new)
            latencies.append(round((time.perf_counter() - t) * 1e6, 2))
            crossed = sum((n - 1) // tokens_per_page != (m - 1) // tokens_per_page for n, m in zip(lens, new))
            pages.append(crossed * kv.config.num_buffers)
            if crossed:
                crossing.append(i)  # some request needs a new page
            lens = new
            if fwd is not None:
                fwd.lens.copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
                if graph is not None:
                    graph.replay()
                else:
                    fwd()
                synchronize(cuda)  # sampling reads the logits
            iteration_us.append(round((time.perf_counter() - t_iter) * 1e6, 2))
        s = kv.stats()
    marked = set(crossing)
    cross = [x for i, x in enumerate(latencies) if i in marked]
    other = [x for i, x in enumerate(latencies) if i not in marked]
    summary = {
        "device": device, "forward": forward, "graphs": graphs, "page_size": kv.page_size, "layout": layout,
        "mode": mode, "background": mode == "mapper", "batch": batch, "tokens_per_page": tokens_per_page,
        "sync_page_maps": s["sync_page_maps"] - s0["sync_page_maps"],
        "background_page_maps": s["background_page_maps"] - s0["background_page_maps"],
        "step_wait_us": s["step_wait_us"] - s0["step_wait_us"],
        "median_us": statistics.median(latencies),
        "crossing_median_us": statistics.median(cross) if cross else None,
        "other_median_us": statistics.median(other) if other else None,
        "crossing_iterations": len(cross),
        "iteration_median_us": statistics.median(iteration_us),
        "iteration_mean_us": statistics.fmean(iteration_us),
        "pages_needed_total": sum(pages),
        "pages_needed_per_crossing_step_max": max(pages, default=0),
        "latencies_us": latencies,
        "crossing_iteration_indices": crossing,
    }
    total_maps = summary["sync_page_maps"] + summary["background_page_maps"]
    summary["maps_overlapped_fraction"] = summary["background_page_maps"] / total_maps if total_maps else None
    if cross and other:
        summary["crossing_over_other"] = summary["crossing_median_us"] / summary["other_median_us"]
    return summary


def synchronize(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def main() -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (host backend) or cuda")
    p.add_argument("--forward", choices=("sleep", "model"), default=None,
                   help="default: model with --device cuda when torch sees a GPU, else sleep")
    p.add_argument("--graphs", choices=("off", "on", "both"), default="off", help="CUDA graphs (model forward, CUDA)")
    p.add_argument("--layers", type=int, default=LAYERS, help="layers of the cache (and the model forward)")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="model forward: hidden size of the MLP stand-in")
    p.add_argument("--tag", default="", help="results file decode_trace_<tag>_<machine>.json")
    p.add_argument("--iterations", type=int, default=1100)
    p.add_argument("--compute-ms", type=float, default=1.0, help="sleep forward: ms per iteration")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--page-sizes", default=None,
                   help="comma list of bytes; default 64 KiB, 256 KiB, 2 MiB on the host, the granularity on cuda")
    p.add_argument("--layouts", default="per_layer,all_layers")
    p.add_argument("--stagger", action="store_true", help="spread the requests' page crossings")
    args = p.parse_args()
    forward = args.forward or ("model" if args.device.startswith("cuda") and gpu else "sleep")
    if forward == "model" and args.device.startswith("cuda") and not gpu:
        p.error("--forward model on --device cuda needs a CUDA GPU (torch tensors on the cache)")
    if args.page_sizes:
        sizes: list[int | None] = [int(x) for x in args.page_sizes.split(",")]
    else:
        sizes = [64 * KiB, 256 * KiB, 2 * MiB] if args.device == "cpu" else [None]
    modes = ["sync", "mapper"] + (["premapped"] if forward == "model" else [])
    on_gpu = forward == "model" and args.device.startswith("cuda")
    graph_modes = {"off": [False], "on": [True], "both": [False, True]}[args.graphs] if on_gpu else [False]
    cases = [(ps, layout, mode, g) for ps in sizes for layout in args.layouts.split(",") for g in graph_modes
             for mode in modes]
    results = []
    for i, (ps, layout, mode, g) in enumerate(cases, 1):
        r = run(args.device, forward, ps, layout, mode, g, args.batch, args.iterations, args.compute_ms / 1e3,
                args.stagger, args.layers, args.hidden)
        results.append(r)
        ratio = r.get("crossing_over_other")
        print(f"[{i}/{len(cases)}] {r['page_size'] // KiB:5d} KiB {layout:10s} {mode:9s} graphs {'on ' if g else 'off'}:"
              f" step median {r['median_us']:.1f} us, crossing {r['crossing_median_us'] or 0:.1f} us "
              f"({r['crossing_iterations']} its), others {r['other_median_us'] or 0:.1f} us"
              + (f", ratio {ratio:.2f}" if ratio else "")
              + f"; iteration {r['iteration_median_us']:.0f} us; maps sync {r['sync_page_maps']}"
              f" / background {r['background_page_maps']}", flush=True)
    m = machine()
    name = f"decode_trace_{args.tag + '_' if args.tag else ''}{machine_slug(m)}"
    path = write_json(name, {"benchmark": "decode_trace", "machine": m, "forward": forward,
                             "compute_ms": args.compute_ms if forward == "sleep" else None,
                             "hidden": args.hidden if forward == "model" else None,
                             "prompt": PROMPT, "layers": args.layers, "stagger": args.stagger, "results": results})
    print(f"wrote {path}")
    plt = pyplot()
    shown = sorted({(r["page_size"], r["layout"], r["graphs"]) for r in results})
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, 2.4 * len(shown)), sharex=True, squeeze=False)
    for ax, (ps, layout, g) in zip(axes[:, 0], shown):
        for r in results:
            if (r["page_size"], r["layout"], r["graphs"]) == (ps, layout, g):
                ax.plot(r["latencies_us"], lw=0.7, label=r["mode"])
        ax.set_yscale("log")
        ax.set_ylabel("step µs")
        ax.set_title(f"{ps // KiB} KiB pages, {layout}" + (", CUDA graphs" if g else ""), fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("decode iteration")
    fig.suptitle(f"step latency per decode iteration ({args.device}, {forward} forward), {args.layers} layers — "
                 f"{m['gpu'] or m['cpu']}", fontsize=9)
    save_plot(fig, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
