"""`python -m vattn demo`: a synthetic serving workload on the host backend.

Requests with different prompt and output lengths arrive over time; each
iteration admits what fits, calls `step` with every running request's length,
writes the new tokens' K/V and runs torch SDPA (GQA) straight on the cache
rows `k[reqid, :n]`. It reports throughput and how much KV memory vattn mapped
against what it reserved virtually and what a static max-length reservation
(one full `max_context_len` slice per request) would have committed.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from collections import deque

import torch
import torch.nn.functional as F

from .config import LAYOUTS
from .manager import KVCacheManager

MiB = 1024 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=None, help="requests in the trace (default 64; 16 with --quick)")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-context-len", type=int, default=4096, help="tokens")
    p.add_argument("--page-size", type=int, default=64 * 1024, help="bytes (default 64 KiB)")
    p.add_argument("--layout", choices=LAYOUTS, default="per_layer")
    p.add_argument("--physical-memory-mb", type=int, default=None, help="physical KV budget in MiB")
    p.add_argument("--quick", action="store_true", help="a short trace (a few seconds)")
    p.add_argument("--seed", type=int, default=0)


@dataclasses.dataclass
class Request:
    rid: int
    arrival: int  # iteration at which it arrives
    prompt_len: int  # tokens
    output_len: int  # tokens to generate
    generated: int = 0
    reqid: int = -1  # vattn slot while running
    cached: int = 0  # tokens whose K/V are in the cache

    @property
    def length(self) -> int:
        return self.prompt_len + self.generated


# A small GQA attention stack: shapes only matter for the cache and kernels.
LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 8, 16, 4, 64


def make_trace(n: int, max_context_len: int, rng: random.Random, quick: bool) -> list[Request]:
    max_prompt, max_out = (256, 64) if quick else (1024, 256)
    reqs, t = [], 0
    for rid in range(n):
        t += rng.choice((0, 0, 1, 2, 4))
        prompt = rng.randint(32, min(max_prompt, max_context_len // 2))
        out = rng.randint(8, min(max_out, max_context_len - prompt))
        reqs.append(Request(rid, t, prompt, out))
    return reqs


def attend(kv: KVCacheManager, req: Request, start: int, stop: int) -> None:
    """Writes K/V of tokens [start, stop) and attends their queries to [0, stop)."""
    r = req.reqid
    new = stop - start
    for layer in range(LAYERS):
        k, v = kv.layer(layer)
        k[r, start:stop] = torch.randn(new, KV_HEADS, HEAD_DIM)
        v[r, start:stop] = torch.randn(new, KV_HEADS, HEAD_DIM)
        q = torch.randn(1, Q_HEADS, new, HEAD_DIM)
        # [n, H, D] -> [1, H, n, D]: a view of the mapped rows only
        F.scaled_dot_product_attention(q, k[r, :stop].transpose(0, 1)[None], v[r, :stop].transpose(0, 1)[None],
                                       is_causal=start == 0, enable_gqa=True)
    req.cached = stop


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    n_requests = args.requests or (16 if args.quick else 64)
    trace = make_trace(n_requests, args.max_context_len, rng, args.quick)
    physical = None if args.physical_memory_mb is None else args.physical_memory_mb * MiB
    kv = KVCacheManager(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                        max_batch_size=args.max_batch_size, max_context_len=args.max_context_len,
                        page_size=args.page_size, layout=args.layout, physical_memory=physical)
    B = args.max_batch_size
    print(f"vattn demo: {len(trace)} requests, {LAYERS} layers, {KV_HEADS} KV heads x {HEAD_DIM} (GQA {Q_HEADS}q), "
          f"fp32, max_batch_size {B}, max_context_len {args.max_context_len}, page {args.page_size // 1024} KiB, "
          f"layout {args.layout}")
    pending = deque(trace)
    waiting: deque[Request] = deque()
    running: list[Request] = []
    done = 0
    it = 0
    tokens_out = prefill_tokens = preemptions = 0
    mapped_samples, used_samples = [], []
    memory_full = False
    t0 = time.perf_counter()
    with kv:
        while done < len(trace):
            while pending and pending[0].arrival <= it:
                waiting.append(pending.popleft())
            # After a preemption, admit nothing until a request finishes: memory is full.
            while waiting and len(running) < B and not memory_full:
                req = waiting.popleft()
                req.reqid = kv.alloc_reqid(prompt_len=req.length)
                req.cached = 0
                running.append(req)
            lens = [0] * B
            for req in running:
                lens[req.reqid] = req.length if req.cached == 0 else req.length + 1
            while not kv.step(lens):
                victim = running.pop()  # most recently admitted: recompute later
                if not running:
                    raise SystemExit("a single request does not fit in physical memory; raise --physical-memory-mb")
                kv.free_reqid(victim.reqid)
                lens[victim.reqid] = 0
                waiting.appendleft(victim)
                preemptions += 1
                memory_full = True
            for req in running:
                if req.cached == 0:
                    attend(kv, req, 0, req.length)  # prefill (or recompute after preemption)
                    prefill_tokens += req.length
                else:
                    attend(kv, req, req.length, req.length + 1)
                    req.generated += 1
                    tokens_out += 1
            s = kv.stats()
            mapped_samples.append(s["bytes_mapped"])
            used_samples.append(s["bytes_used"])
            for req in [r for r in running if r.generated >= r.output_len]:
                running.remove(req)
                kv.free_reqid(req.reqid)
                done += 1
                memory_full = False
            it += 1
            if it % 50 == 0:
                print(f"  iteration {it}: {done}/{len(trace)} done, batch {len(running)}, "
                      f"KV mapped {s['bytes_mapped'] / MiB:.1f} MiB", flush=True)
        elapsed = time.perf_counter() - t0
        s = kv.stats()
    peak = max(mapped_samples)
    mean_mapped = sum(mapped_samples) / len(mapped_samples)
    mean_used = sum(used_samples) / len(used_samples)
    print(f"\nfinished {done} requests in {it} iterations, {elapsed:.1f} s")
    print(f"  throughput: {tokens_out / elapsed:.0f} generated tokens/s, {prefill_tokens / elapsed:.0f} prefill tokens/s, "
          f"{done / elapsed:.2f} requests/s; {preemptions} preemptions")
    print(f"  KV memory: peak mapped {peak / MiB:.1f} MiB, mean mapped {mean_mapped / MiB:.1f} MiB "
          f"(mean in use {mean_used / MiB:.1f} MiB)")
    print(f"             reserved virtually {s['bytes_reserved'] / MiB:.0f} MiB; "
          f"a static max-length reservation needs {s['bytes_static'] / MiB:.0f} MiB")
    print(f"  In plain words: vattn committed at most {100 * peak / s['bytes_static']:.1f}% of the memory a "
          f"static reservation would hold for the same batch, and on average "
          f"{100 * (1 - mean_used / mean_mapped) if mean_mapped else 0:.1f}% of what it mapped was unused "
          f"(partly filled last pages, and freed requests' pages kept for reuse).")
    return 0
