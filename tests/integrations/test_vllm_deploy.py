"""vattn under vLLM's deployments past one engine core: data parallel (``--data-parallel-size 2``, an
engine core per DP rank behind the API servers) with and without a budget, and vLLM's Ray executor
(docs/vllm.md "Deployment: data parallel and Ray").

Data parallel: the texts of concurrent ``openai`` clients equal a stock DP server's; under a budget each DP
engine core is a member, labelled with its DP rank, and the limit halved and restored mid-load fails no
request an API server received and is never passed (vLLM 0.32's DP front end, two API server processes on one
port, drops a few connections under load before any API server reads them, stock or not: 3 of 768 requests in
a run of this load, up to 17 on a busy machine; the clients send those again and every request is answered
exactly once, ``finished`` of test_vllm_serve.py). Ray: a two-node Ray cluster on loopback addresses
(127.0.0.3 and 127.0.0.2); vLLM's CPU build refuses its Ray executor with and without vattn alike, and vattn
refuses a budget under Ray at configuration, before Ray is asked for anything."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import vattn
from test_vllm import needs_vllm, run_scenario, two_cpus_bind, vllm_python
from test_vllm_serve import BLOCK_BYTES, LONG, PROMPTS, Sampler, clients, finished, server, set_limit, wait_until
from test_vllm_serve import model  # noqa: F401 - the fp32 served model, a module fixture

DATA_PARALLEL = ("--data-parallel-size", "2")
WORKER_LINE = "vattn: KV cache on vattn"
RAY_REFUSAL = "current platform cpu does not support ray."  # vLLM 0.32's ray_utils, CPU platform
RAY_START_S = 120  # seconds a Ray node gets to join the cluster


def test_member_label_names_the_data_parallel_rank(monkeypatch) -> None:
    from vattn.integrations.vllm.engine_member import data_parallel_rank, member_label

    assert member_label("tiny-llama", 1, 1, 1) == "vllm tiny-llama dp1 rank 0"
    assert member_label("m", 2, 1, 0) == "vllm m dp0 ranks 0-1 tp2"
    assert member_label("m", 1, 1) == "vllm m rank 0"  # one engine core: no DP rank
    long = member_label("x" * 100, 2, 2, 12)
    assert len(long) == 40 and long.endswith("~ dp12 ranks 0-3 tp2 pp2")

    def parallel(size: int, local: int | None, index: int) -> SimpleNamespace:
        return SimpleNamespace(data_parallel_size=size, data_parallel_rank_local=local, data_parallel_index=index)

    assert data_parallel_rank(parallel(1, None, 0)) is None  # no data parallel
    assert data_parallel_rank(parallel(1, 0, 0)) is None  # a lone engine core: vLLM's default local rank is 0
    # a dense model's DP engine core: vLLM sets its size to 1 and keeps the rank as data_parallel_index
    assert data_parallel_rank(parallel(1, 1, 1)) == 1
    monkeypatch.setattr(multiprocessing.current_process(), "name", "EngineCore_DP0")  # vLLM names its process so
    assert data_parallel_rank(parallel(1, 0, 0)) == 0
    assert data_parallel_rank(parallel(4, None, 3)) == 3  # an MoE model's DP engine core keeps its size


def test_a_budget_under_rays_executor_is_refused_with_the_reason(monkeypatch) -> None:
    from vattn.integrations.vllm.engine_budget import check_config

    def config(backend: str) -> SimpleNamespace:
        return SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend, world_size=2),
                               scheduler_config=SimpleNamespace(async_scheduling=False))

    monkeypatch.delenv("VATTN_BUDGET", raising=False)
    check_config(config("ray"))  # without a budget vattn serves under Ray's executor: vLLM decides
    monkeypatch.setenv("VATTN_BUDGET", "deploy-test")
    with pytest.raises(ValueError) as refused:
        check_config(config("ray"))
    message = str(refused.value)
    assert "VATTN_BUDGET" in message and "'ray'" in message and "one machine" in message, message
    assert "unset VATTN_BUDGET" in message, message
    with pytest.raises(ValueError, match="its own executors"):
        check_config(config("external_launcher"))


# ---- data parallel: one API server command, two engine cores --------------------------------------------------


def equals_stock(texts: dict, stock: dict) -> int:
    """Asserts every answer equals the stock server's to the same prompt (where stock answered it); returns how
    many were compared."""
    compared = 0
    for kind, answers in texts.items():
        for key, text in answers.items():
            expected = stock[kind].get(f"0:{key.split(':')[1]}")
            if expected is not None:
                assert text == expected, (kind, key)
                compared += 1
    return compared


def engine_cores_on_vattn(log: Path) -> int:
    """How many workers logged that they hold their KV cache on vattn."""
    return log.read_text().count(WORKER_LINE)


@pytest.fixture(scope="module")
def dp_stock_texts(model, tmp_path_factory) -> dict:  # noqa: F811 - model is the imported fixture
    """A stock DP server's answers (no vattn) to the clients' prompts."""
    tmp = tmp_path_factory.mktemp("dp-stock")
    with server(model, "tiny-llama", tmp / "stock.log", False, command="serve", args=DATA_PARALLEL,
                VLLM_CPU_OMP_THREADS_BIND=two_cpus_bind()) as url:
        run = clients(url, "tiny-llama", tmp, "stock", connection_retries=2)
        texts = finished(run, tmp, "stock", tmp / "stock.log")["texts"]
    assert sum(len(answers) for answers in texts.values()) >= 3 * len(PROMPTS) - 1
    return texts


@needs_vllm
@LONG
def test_data_parallel_server_on_vattn_answers_stocks_texts(model, dp_stock_texts, tmp_path):  # noqa: F811
    """``python -m vattn vllm serve --data-parallel-size 2`` without a budget: both engine cores' workers hold
    their cache on vattn, and the greedy texts of every kind of request equal the stock DP server's."""
    with server(model, "tiny-llama", tmp_path / "vattn.log", True, command="serve", args=DATA_PARALLEL,
                VLLM_CPU_OMP_THREADS_BIND=two_cpus_bind()) as url:
        run = clients(url, "tiny-llama", tmp_path, "vattn", rounds=2, connection_retries=2)
        texts = finished(run, tmp_path, "vattn", tmp_path / "vattn.log")["texts"]
    assert engine_cores_on_vattn(tmp_path / "vattn.log") == 2
    assert all(t[0] for t in texts["plain"].values())
    assert equals_stock(texts, dp_stock_texts) >= 2 * 3 * len(PROMPTS) - 4


@needs_vllm
@LONG
def test_data_parallel_engine_cores_are_members_through_a_halved_limit(model, dp_stock_texts, tmp_path):  # noqa: F811
    """Under one budget each DP engine core joins as a member labelled with its DP rank; concurrent clients
    run while the limit is halved and restored with ``python -m vattn budget set``: no request an API server
    received fails, the texts
    are stock's, the members go below the halved limit while it holds and never above the limit, and idle
    memory goes back."""
    limit = 32 * BLOCK_BYTES  # below the two engine cores' peaks together (8 requests x 2 sequences x 3-4 blocks)
    half = limit // 2
    budget = vattn.Budget.create(f"deploy-dp-{os.getpid()}", limit)
    try:
        with server(model, "tiny-llama", tmp_path / "vattn.log", True, command="serve", args=DATA_PARALLEL,
                    VLLM_CPU_OMP_THREADS_BIND=two_cpus_bind(), VATTN_BUDGET=budget.name,
                    VATTN_VLLM_IDLE_RELEASE_S="1") as url:
            labels = sorted(m.label for m in budget.usage().members)
            assert labels == ["vllm tiny-llama dp0 rank 0", "vllm tiny-llama dp1 rank 0"]
            sampler = Sampler(budget)
            run = clients(url, "tiny-llama", tmp_path, "load", rounds=32, concurrency=16,
                          connection_retries=2)
            wait_until(lambda: budget.held_bytes > half, 120, "the engine cores never held half the limit")
            under_load = {m.label: m.held_bytes for m in budget.usage().members}
            assert all(held > 0 for held in under_load.values()), under_load  # the load reached both DP ranks
            lowering = set_limit(budget.name, half)
            lowered = time.monotonic()
            wait_until(lambda: budget.held_bytes <= half, 60, f"held {budget.held_bytes} above {half}")
            print(f"halved in {lowering:.1f} s, held {budget.held_bytes} <= {half} after "
                  f"{time.monotonic() - lowered:.1f} s")
            assert run.poll() is None  # the load was still on
            print(f"restored in {set_limit(budget.name, limit):.1f} s")
            assert run.poll() is None  # still on: the engine cores grow again
            wait_until(lambda: budget.held_bytes > half, 60, "the engine cores did not grow again")
            result = finished(run, tmp_path, "load", tmp_path / "vattn.log")  # none failed that reached a server
            samples = sampler.stop()
            assert equals_stock(result["texts"], dp_stock_texts) >= 0.95 * 32 * 3 * len(PROMPTS)
            assert max(held for held, _ in samples) <= limit
            print(f"held per member under load, before the limit was halved: {under_load}")
            wait_until(lambda: budget.held_bytes <= 2 * BLOCK_BYTES, 30, f"held {budget.held_bytes} after idling")
        assert engine_cores_on_vattn(tmp_path / "vattn.log") == 2
    finally:
        budget.remove(force=True)  # teardown: a server still exiting must not keep the budget


# ---- Ray: a two-node cluster on loopback addresses -----------------------------------------------------------


def ray_command() -> str:
    return str(Path(vllm_python()).parent / "ray")


def ray_environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VATTN_VLLM", "VATTN_BUDGET", "RAY_"))}
    env.update(RAY_USAGE_STATS_ENABLED="0", **extra)
    return env


def ray_nodes(address: str) -> list[tuple[str, float]]:
    """The live nodes of the cluster at ``address``: (address, CPUs) each."""
    probe = subprocess.run(
        [vllm_python(), "-c", "import json, ray; ray.init(address=%r, logging_level='ERROR'); "
                              "print(json.dumps([(n['NodeManagerAddress'], n['Resources'].get('CPU', 0)) "
                              "for n in ray.nodes() if n['Alive']]))" % address],
        capture_output=True, text=True, timeout=120, env=ray_environment())
    return [tuple(n) for n in json.loads(probe.stdout.strip().splitlines()[-1])] if probe.returncode == 0 else []


@contextlib.contextmanager
def ray_node(tmp: Path, name: str, args: list[str]):
    """``ray start --block`` with ``args``, in a process group of its own, stopped (the group) at the end."""
    with open(tmp / f"{name}.log", "w") as out:
        proc = subprocess.Popen([ray_command(), "start", "--block", "--disable-usage-stats", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=ray_environment(), start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(30)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A head node on 127.0.0.3 and a second node on 127.0.0.2 (two CPUs and one); yields the head's address.
    Not 127.0.0.1: ``ray start`` replaces that address with the machine's own (resolve_ip_for_localhost)."""
    if vllm_python() is None or not Path(ray_command()).exists():
        pytest.skip("needs Ray in the vLLM environment: pip install -e \".[ray]\" there (docs/vllm.md)")
    tmp = tmp_path_factory.mktemp("ray")
    from test_vllm_serve import free_port

    address = f"127.0.0.3:{free_port()}"
    head_args = ["--head", "--node-ip-address=127.0.0.3", f"--port={address.split(':')[1]}", "--num-cpus=2",
                 f"--ray-client-server-port={free_port()}", "--include-dashboard=false", f"--temp-dir={tmp / 'ray'}"]
    with ray_node(tmp, "head", head_args) as head:
        wait_until(lambda: head.poll() is not None or ray_nodes(address), RAY_START_S,
                   f"the Ray head did not start: {(tmp / 'head.log').read_text()[-3000:]}")
        assert head.poll() is None, (tmp / "head.log").read_text()[-3000:]
        with ray_node(tmp, "node2", [f"--address={address}", "--node-ip-address=127.0.0.2", "--num-cpus=1"]):
            def both_nodes() -> list | None:
                found = ray_nodes(address)
                return found if len(found) == 2 else None

            nodes = wait_until(both_nodes, RAY_START_S,
                               f"the second node did not join: {(tmp / 'node2.log').read_text()[-3000:]}")
            assert sorted(nodes) == [("127.0.0.2", 1.0), ("127.0.0.3", 2.0)]
            yield address


@needs_vllm
@LONG
def test_vllms_cpu_build_refuses_the_ray_executor_with_and_without_vattn(ray_cluster, model, tmp_path):  # noqa: F811
    """``LLM(distributed_executor_backend="ray", tensor_parallel_size=2)`` against the loopback cluster: vLLM
    0.32's CPU platform has no Ray device key and stops at the executor's start with the same error, stock and
    on vattn without a budget (vattn adds no refusal of its own); under a budget vattn refuses at
    configuration, with its reason."""
    spec = tmp_path / "ray.spec.json"
    engine = dict(dtype="float32", max_model_len=256, max_num_seqs=4, block_size=32, skip_tokenizer_init=True,
                  distributed_executor_backend="ray", tensor_parallel_size=2)
    spec.write_text(json.dumps(dict(engine=engine, phases=[dict(name="one", prompts=[[5, 6, 7]], max_tokens=[4])])))
    env = dict(RAY_ADDRESS=ray_cluster, VLLM_CPU_KVCACHE_SPACE="1")
    logs = {}
    for name, on, extra in (("stock", False, {}), ("vattn", True, {}),
                            ("budget", True, {"VATTN_BUDGET": f"deploy-ray-{os.getpid()}"})):
        proc = run_scenario(model, spec, tmp_path / f"{name}.json", tmp_path, on, **env, **extra)
        assert proc.returncode != 0 and not (tmp_path / f"{name}.json").exists(), name
        logs[name] = proc.stdout + proc.stderr
    assert RAY_REFUSAL in logs["stock"] and RAY_REFUSAL in logs["vattn"]
    assert "vattn: VATTN_BUDGET" not in logs["vattn"]
    assert "vattn: VATTN_BUDGET" in logs["budget"] and "one machine" in logs["budget"]
    assert RAY_REFUSAL not in logs["budget"]  # refused before vLLM asked Ray for anything
