"""``benchmarks/multi_model.py --serve``: one OpenAI-compatible API server
per model (``python -m vllm.entrypoints.openai.api_server``, vLLM's default
process layout: API server, engine-core process, a worker process per rank),
the trace sent over HTTP as streamed completions of the prompts' token ids.
Time to first token is measured at the client, preemptions come from the
servers' ``/metrics``, memory is each server's process group's resident
memory and, under a budget, what each engine core holds."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from harness import ROOT
from multi_model_runs import BLOCK, MAX_MODEL_LEN, SAMPLE_S, read_rss, run_outcome


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_rss(pgid: int) -> dict[str, int]:
    """VmRSS and RssShmem added up over the processes of process group ``pgid`` (a server and the engine and
    worker processes it started)."""
    total = {"VmRSS": 0, "RssShmem": 0}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
        except (OSError, IndexError, ValueError):
            continue
        for key, value in read_rss(int(entry)).items():
            if key in total:
                total[key] += value
    return total


class ServeSampler(threading.Thread):
    """Every SAMPLE_S: each server's process group's resident memory and, for a budget, what each engine core
    (a member labelled ``vllm NAME ...``) holds."""

    def __init__(self, pgids: list[int], names: list[str], budget_name: str | None) -> None:
        super().__init__(daemon=True)
        self.pgids, self.names, self.budget, self.stop = pgids, names, None, threading.Event()
        if budget_name:
            import vattn

            self.budget = vattn.Budget.attach(budget_name)
        self.samples: list[dict] = []

    def run(self) -> None:
        while not self.stop.is_set():
            sample = {"unix": time.time(), "rss": [group_rss(g) for g in self.pgids]}
            if self.budget is not None:
                members = self.budget.usage().members
                sample["budget_held"] = [sum(m.held_bytes for m in members if m.label.split(" ")[1:2] == [n])
                                         for n in self.names]
            self.samples.append(sample)
            time.sleep(SAMPLE_S)


def metric(port: int, name: str) -> float:
    """A counter of the server's Prometheus ``/metrics`` (its samples added up)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    names = (name, f"{name}_total")  # prometheus_client names a counter's samples ..._total
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{", 1)[0].split(" ", 1)[0] in names)


def stream_request(port: int, model: str, request: dict, t0: float, out: dict) -> None:
    """Sends ``request`` at its arrival (``t0`` + arrival_s, monotonic) as a streamed completion; records the
    time to its first streamed token and to its last, from its arrival."""
    arrival = t0 + request["arrival_s"]
    time.sleep(max(0.0, arrival - time.monotonic()))
    body = dict(model=model, prompt=request["prompt"], max_tokens=request["max_tokens"], temperature=0,
                ignore_eos=True, stream=True, stream_options=dict(include_usage=True))
    http = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})
    first, generated = None, 0
    with urllib.request.urlopen(http, timeout=1800) as answer:
        for line in answer:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.monotonic()
            if chunk.get("usage"):
                generated = chunk["usage"]["completion_tokens"]
    done = time.monotonic()
    out.update(arrival_s=request["arrival_s"], ttft_s=first - arrival, finish_s=done - arrival,
               generated_tokens=generated)


def run_config_serve(config: str, args: argparse.Namespace, models: list[tuple], trace: list[list[dict]],
                     budget_bytes: int, tmp: Path, label: str) -> dict:
    """Starts one API server per model, all at once, replays the trace over HTTP, and returns their results."""
    import vattn

    print(f"[{time.strftime('%H:%M:%S')}] {label}: {len(models)} API servers ...", flush=True)
    k = len(models)
    budget = None
    environ = {n: v for n, v in os.environ.items() if not n.startswith(("VATTN_VLLM", "VATTN_BUDGET"))
               and n not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    common = ["--dtype", args.dtype, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs",
              str(args.burst_requests), "--block-size", str(BLOCK), "--enable-prefix-caching", "--enforce-eager"]
    if config == "vattn elastic":
        budget = vattn.Budget.create(f"multi-model-{os.getpid()}", budget_bytes)
        environ.update(VATTN_BUDGET=budget.name, VATTN_VLLM_IDLE_RELEASE_S=str(args.idle_release_s),
                       VLLM_CPU_KVCACHE_SPACE="1")
    else:
        common += ["--kv-cache-memory-bytes", str(budget_bytes // k)]
    if config.startswith("vattn"):
        environ["VATTN_VLLM"] = "1"
    cpus = sorted(os.sched_getaffinity(0))
    procs, ports, logs = [], [], []
    try:
        for i, (name, *_) in enumerate(models):
            ports.append(free_port())
            argv = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp / name),
                    "--served-model-name", name, "--host", "127.0.0.1", "--port", str(ports[-1]), *common]
            env = dict(environ)
            if args.tp2 and i == 0:
                argv += ["--tensor-parallel-size", "2"]
                env["VLLM_CPU_OMP_THREADS_BIND"] = f"{cpus[0]}|{cpus[1 % len(cpus)]}"
            logs.append(open(tmp / f"{label}-{name}.log".replace(" ", "-"), "w"))
            procs.append(subprocess.Popen(argv, stdout=logs[-1], stderr=subprocess.STDOUT, env=env, cwd=tmp,
                                          start_new_session=True))
        deadline = time.monotonic() + 900
        for p, port, log in zip(procs, ports, logs):
            while True:
                if p.poll() is not None:
                    sys.exit(f"{label}: a server exited at start-up:\n{Path(log.name).read_text()[-4000:]}")
                if time.monotonic() > deadline:
                    sys.exit(f"{label}: a server did not start in 900 s:\n{Path(log.name).read_text()[-4000:]}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                        break
                except OSError:
                    time.sleep(1)
        for (name, *_), port in zip(models, ports):  # warm-up, as the in-process engines
            for prompt in ([7] * 256, [9] * 300):
                stream_request(port, name, dict(arrival_s=0.0, prompt=prompt, max_tokens=4), time.monotonic(), {})
        preempted = [metric(port, "vllm:num_preemptions") for port in ports]
        sampler = ServeSampler([p.pid for p in procs], [name for name, *_ in models], budget.name if budget else None)
        sampler.start()
        t0 = time.monotonic() + 1.0
        start_unix = time.time() + 1.0
        results = [[{} for _ in requests] for requests in trace]
        threads = [threading.Thread(target=stream_request, args=(port, name, request, t0, out))
                   for (name, *_), port, requests, outs in zip(models, ports, trace, results)
                   for request, out in zip(requests, outs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sampler.stop.set()
        sampler.join()
        preempted = [metric(port, "vllm:num_preemptions") - before for port, before in zip(ports, preempted)]
        if any(not out for outs in results for out in outs):
            sys.exit(f"{label}: requests failed")
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
        if budget is not None:
            budget.remove(force=True)
    engines = []
    for outs, requests, n in zip(results, trace, preempted):
        for served, asked in zip(outs, requests):
            served["burst"] = asked["burst"]
        engines.append(dict(requests=outs, preemptions=int(n), start_unix=start_unix))
    return run_outcome(models, engines, sampler.samples, start_unix, budget is not None, budget_bytes, args.period_s)
