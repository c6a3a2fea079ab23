"""Starting ``vllm_scenario.py run`` in a fresh process of the vLLM
environment's interpreter, stock or with vattn: the one way the benchmarks
run an engine on a spec (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "workloads" / "vllm_scenario.py"
CLIENTS = ROOT / "workloads" / "vllm_clients.py"
KV_CACHE_SPACE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: the pool stock vLLM-CPU allocates at start-up


class EngineFailed(RuntimeError):
    """The scenario runner exited with an error; ``log`` is all it printed (stdout and stderr)."""

    def __init__(self, returncode: int, log: str) -> None:
        super().__init__(f"vllm_scenario.py exited with status {returncode}")
        self.returncode, self.log = returncode, log


def engine_environment(vattn: bool, budget: str | None = None, checkout: Path = ROOT,
                       kv_cache_space_gib: int = KV_CACHE_SPACE_GIB) -> dict[str, str]:
    """This process's environment for one engine: vattn's switches only as asked (``vattn``:
    VATTN_VLLM=1; ``budget``: the machine-wide budget's name, VATTN_BUDGET), vLLM-CPU's pool
    ``kv_cache_space_gib`` (GiB, KV_CACHE_SPACE_GIB by default), and ``checkout``'s vattn (this one by
    default) first on PYTHONPATH (the vLLM environment's editable install may come from another checkout)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("VATTN_VLLM", "VATTN_BUDGET"))}
    environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_space_gib)
    environ["PYTHONPATH"] = os.pathsep.join([str(checkout), *(p for p in environ.get("PYTHONPATH", "").split(os.pathsep)
                                                              if p and p not in (str(ROOT), str(checkout)))])
    if vattn:
        environ["VATTN_VLLM"] = "1"
    if budget:
        environ["VATTN_BUDGET"] = budget
    return environ


def scenario_runner(checkout: Path) -> Path:
    """``checkout``'s scenario runner: workloads/vllm_scenario.py, or where an older checkout kept it, the
    one file of that name git tracks there."""
    if (checkout / "workloads" / "vllm_scenario.py").exists():
        return checkout / "workloads" / "vllm_scenario.py"
    tracked = subprocess.run(["git", "ls-files", "*vllm_scenario.py"], cwd=checkout, capture_output=True,
                             text=True).stdout.split()
    if len(tracked) != 1:
        raise FileNotFoundError(f"no single vllm_scenario.py in {checkout} (git tracks {tracked or 'none'})")
    return checkout / tracked[0]


def run_engine(python: str, model: Path, spec_path: Path, out: Path, vattn: bool, budget: str | None = None,
               timeout_s: float | None = None, checkout: Path = ROOT,
               kv_cache_space_gib: int = KV_CACHE_SPACE_GIB, cpus: list[int] | None = None) -> dict:
    """Runs the scenario ``spec_path`` on the checkpoint ``model`` in a fresh process of ``python`` (the
    vLLM environment's interpreter), in ``out``'s folder, and returns its result (``out``, JSON). What the
    process prints goes to ``out`` with the suffix .log. ``checkout``: the vattn checkout (its extension
    built in place) whose vattn and scenario runner the engine uses; this one by default. Raises
    :class:`EngineFailed` (with that log) when it fails, ``subprocess.TimeoutExpired`` when it runs past
    ``timeout_s`` seconds (None: no limit). ``kv_cache_space_gib``: vLLM-CPU's pool, in GiB. ``cpus``: the
    logical CPUs the engine runs on (``taskset``, inherited by every process and thread it starts; vLLM-CPU's
    OpenMP threads bound to them and vattn's kernel threads one per CPU); None: wherever the OS puts it."""
    log = out.with_suffix(".log")
    command = [python, str(scenario_runner(checkout)), "run", str(model), str(spec_path), str(out)]
    environ = engine_environment(vattn, budget, checkout, kv_cache_space_gib)
    if cpus is not None:
        listed = ",".join(map(str, cpus))
        command = ["taskset", "-c", listed, *command]
        environ |= {"VLLM_CPU_OMP_THREADS_BIND": listed, "VATTN_CPU_ATTN_THREADS": str(len(cpus))}
    with open(log, "w") as f:
        proc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=environ, cwd=out.parent,
                              timeout=timeout_s)
    if proc.returncode:
        raise EngineFailed(proc.returncode, log.read_text())
    return json.loads(out.read_text())
