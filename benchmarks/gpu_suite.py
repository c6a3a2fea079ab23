"""The GPU suite in one call: build, the CUDA tests, every benchmark, one summary,
and one archive that carries all of it back.

    benchmarks/gpu_suite.sh OUTDIR              # on a machine with an NVIDIA GPU (< 10 min on one H100)
    benchmarks/gpu_suite.sh OUTDIR --dry-run    # anywhere: the same scripts on the CPU, tiny grids
    VATTN_GPU_SUITE_DRY_RUN=1 benchmarks/gpu_suite.sh OUTDIR
    benchmarks/gpu_suite.sh OUTDIR --wheels DIR --archive DIR2   # options: see below

Stages, each a subprocess with a time limit, its output in OUTDIR/gpu_suite.log:

  build         python setup.py build_ext --inplace (the extension has no
                device code: it loads libcuda.so.1 at run time, so one build
                serves every GPU; the GPU found is recorded in the summary);
                skipped when the built extension is newer than every source,
                so a machine that built it ahead gives the stages its time
  tests         the CUDA test files: tests/backends/test_cuda_real.py on the
                host backend, the fake driver and the GPU, the driver rules on
                the fake driver, the cuda.h check (with the header the machine
                has), the attention adapters, vLLM's forward planner with torch's
                FlashAttention in a CUDA graph (no vLLM needed); JUnit XML kept,
                counts in the summary
  vmm_latency   per-call driver latency per page size, vattn vs raw calls
  flashinfer_jit  FlashInfer's first-use JIT compile of every kernel
                attention_ab times, with progress, so that no timed stage
                compiles (a no-op where FlashInfer is not importable)
  attention_ab  vattn + FlashAttention-2 / FlashInfer vs their paged kernels
  decode_trace  mapping on the critical path of decode iterations (the
                model forward: per layer the new token's K/V and
                FlashAttention-2 varlen over the cache), mapper on/off, CUDA
                graphs on/off
  prefill       admitting a prompt: synchronous mapping vs the policies
  engine_e2e    Llama-3.2-1B-shaped engine vs transformers' caches (the
                engine's decode iterations replay CUDA graphs, its default):
                32 requests, 3 alternated rounds and an A/A pair (the
                engine twice), so the ratios come with an interval
  engine_e2e_graphs  the same engine with CUDA graphs and without
                (cuda_graphs=False), 3 alternated rounds and an A/A pair
                (the engine with graphs twice): what the graphs gain, against
                the noise between two runs of one engine
  host_kernel   the host attention kernel's tests on this machine's CPU
                (last, if time is left: a GPU server's CPU may have
                AVX-512 or AMX-BF16, which the kernel's development CPU
                lacks); the paths it supports are in the summary
  <stage>_backtrace  only after a test stage died of a signal, and only
                where gdb or cuda-gdb is found: that stage again under the
                debugger, stopping at the first failure, its native stack
                and registers in the log

The stages share a deadline of DEADLINE_S seconds (each gets the smaller of
its own limit and what is left; the attention grid also has a time budget),
so the suite ends within 10 minutes; a stage cut short is reported as such.
The summary (OUTDIR/gpu_suite.json) is written after every stage, so a call
cut off keeps what its finished stages measured, and a second call with the
same OUTDIR resumes: stages that finished ok are kept, the others run
(``--fresh`` runs them all again).
Every benchmark writes JSON + PNG into OUTDIR (file names carry the GPU);
OUTDIR/gpu_suite.json holds the machine (GPU, driver, CUDA and torch
versions), the Python packages the stages saw (transformers, flash-attn,
flashinfer, triton), what the cuda backend learned about the driver (unmap
runs accepted or not, with the driver version), each stage's status and
time, and the test counts. A stage that fails is recorded and the next runs;
the exit status is 1 when any failed.

One archive. Last, everything the run wrote (JSON, PNG, the tests' XML, the
log) is packed into gpu_suite_<gpu>_<date>.tar.gz (``_dryrun`` added for a
rehearsal) in ``--archive DIR`` (default OUTDIR), and its path is the last
line printed: one file carries a run's results back from a machine that
returns few files.

What to carry to a GPU machine without network. The machines we can test on
have torch with CUDA 13, nvcc, Triton, pybind11, pytest and matplotlib, and
no FlashAttention, FlashInfer or vLLM; their transformers is older than the
range pyproject.toml accepts. ``--wheels DIR`` installs every wheel in DIR
(no index, no dependencies) into OUTDIR/site, ahead of the installed
packages, for every stage. The choices and the numbers each gives:

  transformers  carried: transformers-5.23.0-py3-none-any.whl, 13 MB, pure
                Python; its dependencies (huggingface-hub, tokenizers,
                safetensors, regex, typer) are on the image at versions it
                accepts. Gives engine_e2e (and the integration's tests) on
                a release VAttnCache is checked against; without it
                engine_e2e runs on the image's release, outside that range,
                and the summary says so.
  setuptools    carried: setuptools-84.2.1-py3-none-any.whl, 0.9 MB, pure
                Python. The build stage's ``setup.py build_ext`` reads
                pyproject.toml, whose license is an SPDX expression that
                setuptools before 77 refuses; the image's version is not
                known ahead, and the summary records the one the stages
                import.
  FlashAttention-2  not carried: flash-attn has no wheel on PyPI for any
                torch (source only, hours to build). Every FlashAttention-2
                number comes from torch's own kernel instead
                (torch.ops.aten._flash_attention_forward, "fa2-torch"):
                attention_ab's fa2-torch vs fa2-torch-paged-B (where that
                torch's op takes a block table) and decode_trace's forward.
                The adapter flash_attn_attention ("fa2" vs "fa2-paged-B")
                stays unmeasured.
  FlashInfer    not carried: flashinfer-python 0.7.2 is a 62 MB wheel (a
                call carries 64 MiB in all, the repository included) that
                imports packages the image lacks (apache-tvm-ffi,
                nvidia-cutlass-dsl, cuda-tile, nccl4py,
                nvidia-cudnn-frontend) and compiles each kernel with nvcc at
                first use, minutes per shape and dtype, which the 10-minute
                call cannot hold beside the other stages. So attention_ab's
                fi-batched / fi-batched-request / fi-single vs fi-paged-B
                (the FlashInfer adapter's two presentations of the cache and
                its page-table view) stay unmeasured, listed under
                not_measured with the import error.
  vLLM          not carried (gigabytes, and it needs its own torch): the
                vLLM integration's GPU path stays unmeasured.

On such a machine, from the repository root, with the wheels downloaded here
(``pip download --no-deps --only-binary=:all: transformers==5.23.0 setuptools==84.2.1 -d .whl``,
.whl ignored through .git/info/exclude and carried):

    benchmarks/gpu_suite.sh /tmp/suite --wheels .whl --archive "$OUT"

The dry run needs no GPU: the cuda backend's paths run against the fake
driver (tests/backends/fake_cuda, built here with the C compiler), the model
forward of decode_trace runs on the host backend (decode_trace_host_model),
the GPU-only kernels are listed as not measured, and grids are tiny. Its
JSON says "dry_run": true; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from harness import machine_slug  # benchmarks/harness.py: the file names' machine part

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 540  # every stage ends by then: with the wheels, summary and archive the suite stays under 10 minutes
BENCH = ROOT / "benchmarks"
CUDA_TESTS = ["tests/backends/test_cuda_real.py", "tests/backends/test_cuda_driver_rules.py",
              "tests/backends/test_cuda_fake_rules.py", "tests/backends/test_cuda_fake_driver.py",
              "tests/backends/test_cuda_header_abi.py", "tests/kernels/test_attention.py",
              "tests/integrations/test_vllm_planner_gpu.py"]
# packages the stages may use, reported with their versions (None: not importable)
PACKAGES = ["torch", "triton", "transformers", "flash_attn", "flashinfer", "vllm", "setuptools"]
TRANSFORMERS_CHECKED = ((5, 22), (5, 24))  # pyproject.toml's range: >= 5.22, < 5.24
ARCHIVED = (".json", ".png", ".xml", ".log")
# the ISA harness first: it runs in child processes (native AMX under the sanitizers among them), so a crash
# in the tests that call the extension in pytest's own process cannot keep it from running
HOST_KERNEL_TESTS = ["tests/kernels/test_cpu_attn_isas.py", "tests/kernels/test_cpu_attention.py",
                     "tests/kernels/test_cpu_attention_calls.py"]


def stages(dry: bool, have_fake_cuda: bool) -> list[tuple[str, list[str], int]]:
    """(name, command, time limit in seconds) of every stage."""
    py = sys.executable
    build = ("build", [py, "setup.py", "build_ext", "--inplace"], 300)
    # the rehearsal builds beside its results: an in-place build would rewrite the
    # extension under a process (the test suite) that has it loaded
    dry_build = ("build", [py, "setup.py", "build_ext", "--build-lib", "{out}/build/lib",
                           "--build-temp", "{out}/build/temp"], 300)
    if not dry:
        return [
            build,
            ("tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", "{out}/tests.xml",
                       *CUDA_TESTS], 240),
            ("vmm_latency", [py, str(BENCH / "vmm_latency.py"), "--backends", "cuda", "--pages", "256"], 120),
            ("flashinfer_jit", [py, str(BENCH / "attention_ab.py"), "--compile-only"], 240),
            # Stage budgets from the H200 run (attention_ab's 170 s covered 41 points; the engine's default
            # trace takes transformers' caches minutes): 120 s for the grid, and the engine on a quarter of its
            # default trace's tokens in three rounds with an A/A pair, so that every stage fits the deadline; the
            # engine stage 360 s since every cache there first runs the whole trace untimed (engine_e2e.warmup_calls:
            # transformers compiles a StaticCache's decode step per group inside it), a second call resuming it
            # where the first call's deadline leaves it less
            ("attention_ab", [py, str(BENCH / "attention_ab.py"), "--time-budget-s", "120", "--min-seconds", "0.1"],
             300),
            ("decode_trace", [py, str(BENCH / "decode_trace.py"), "--device", "cuda", "--forward", "model", "--graphs",
                              "both", "--batch", "16", "--stagger", "--iterations", "600"], 180),
            ("prefill", [py, str(BENCH / "prefill.py"), "--device", "cuda"], 120),
            ("engine_e2e", [py, str(BENCH / "engine_e2e.py"), "--requests", "32", "--batch", "16", "--new-tokens", "64",
                            "--rounds", "3", "--aa", "vattn"], 360),
            ("engine_e2e_graphs", [py, str(BENCH / "engine_e2e.py"), "--caches", "vattn,vattn-nographs", "--rounds",
                                   "3", "--aa", "vattn", "--requests", "32", "--tag", "graphs"], 150),
            ("host_kernel", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml",
                             "{out}/host_kernel_tests.xml", *HOST_KERNEL_TESTS, "-k", "not qemu and not sve256"], 180),
        ]
    device = "cuda" if have_fake_cuda else "cpu"  # cuda: the fake driver
    return [
        dry_build,
        ("tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", "{out}/tests.xml",
                   "tests/backends/test_cuda_real.py"], 120),
        ("vmm_latency", [py, str(BENCH / "vmm_latency.py"), "--backends", "host,cuda" if have_fake_cuda else "host",
                         "--pages", "4"], 120),
        ("flashinfer_jit", [py, str(BENCH / "attention_ab.py"), "--compile-only", "--quick", "--models",
                            "tiny:4:2:64"], 120),
        ("attention_ab", [py, str(BENCH / "attention_ab.py"), "--quick", "--models", "tiny:4:2:64",
                          "--min-seconds", "0.005", "--layers", "2"], 120),
        ("decode_trace", [py, str(BENCH / "decode_trace.py"), "--device", device, "--forward", "sleep",
                          "--iterations", "40", "--compute-ms", "0.1", "--batch", "2", "--layouts", "all_layers",
                          "--stagger"] + ([] if have_fake_cuda else ["--page-sizes", "65536"]), 120),
        # the model forward of the GPU run (FlashAttention-2's varlen contract on the cache's slots), on the host
        ("decode_trace_host_model", [py, str(BENCH / "decode_trace.py"), "--device", "cpu", "--forward", "model",
                                     "--iterations", "8", "--batch", "2", "--layers", "2", "--hidden", "64",
                                     "--page-sizes", "65536", "--stagger", "--tag", "host_model"], 120),
        ("prefill", [py, str(BENCH / "prefill.py"), "--device", device, "--prompts", "1024", "--reps", "1"], 120),
        ("engine_e2e", [py, str(BENCH / "engine_e2e.py"), "--tiny", "--requests", "4", "--batch", "2",
                        "--prompt-len", "32", "--new-tokens", "4"], 120),
        # on the CPU both caches run eagerly: the stage's rounds and A/A pair, not its graphs
        ("engine_e2e_graphs", [py, str(BENCH / "engine_e2e.py"), "--tiny", "--requests", "4", "--batch", "2",
                               "--prompt-len", "32", "--new-tokens", "4", "--caches", "vattn,vattn-nographs",
                               "--rounds", "2", "--aa", "vattn", "--tag", "graphs"], 120),
        ("host_kernel", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml",
                         "{out}/host_kernel_tests.xml", "tests/kernels/test_cpu_attention.py", "-k", "nan_reaches"],
         120),
    ]


def machine_info(env: dict[str, str]) -> dict:
    """harness.machine() in a child with the stages' environment (the carried
    wheels' packages, the fake driver); its ``driver`` is None until the
    extension is built, since the cuda backend reads it."""
    return json.loads(subprocess.run(
        [sys.executable, "-c", "import json, harness; print(json.dumps(harness.machine()))"], cwd=BENCH, env=env,
        capture_output=True, text=True, check=True).stdout)


def extension_up_to_date() -> bool:
    """Whether the in-place build (vattn/*.so) is newer than every C++ source and setup.py:
    a build rewrites the extensions whose sources changed, so the newest one is
    older than a source edited after the last build."""
    built = list((ROOT / "vattn").glob("*.so"))
    if not built:
        return False
    sources = [ROOT / "setup.py", *(p for p in (ROOT / "csrc").rglob("*") if p.is_file())]
    return max(p.stat().st_mtime for p in built) >= max(p.stat().st_mtime for p in sources)


def finished_stages(out: Path, dry: bool) -> dict[str, dict]:
    """The stages an earlier call with this OUTDIR finished ok (from its
    summary), by name; none when there is no summary or it was of the other
    kind (dry run or GPU)."""
    path = out / "gpu_suite.json"
    if not path.exists():
        return {}
    try:
        earlier = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}
    if earlier.get("dry_run") != dry:
        return {}
    return {r["name"]: r for r in earlier.get("stages", []) if r.get("status") == "ok"}


def build_fake_driver(out: Path, log) -> Path | None:
    """tests/backends/fake_cuda/*.c as a shared library, or None without a C compiler."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        print("dry run: no C compiler, so the cuda backend's paths are skipped", file=log, flush=True)
        return None
    lib = out / "fake_cuda" / "libfakecuda.so"
    lib.parent.mkdir(parents=True, exist_ok=True)
    sources = sorted(str(p) for p in (ROOT / "tests/backends/fake_cuda").glob("*.c"))
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(lib), *sources, "-lpthread"], check=True, stdout=log,
                   stderr=subprocess.STDOUT)
    return lib


def run_stage(name: str, cmd: list[str], limit: int, env: dict[str, str], log) -> dict:
    print(f"\n==== {name}: {' '.join(cmd)}", file=log, flush=True)
    print(f"[gpu_suite] {name} ...", flush=True)
    t = time.perf_counter()
    start = log.tell()
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit).returncode
        status = "ok" if rc == 0 else "failed"
    except subprocess.TimeoutExpired:
        rc, status = None, f"timed out after {limit} s"
    seconds = round(time.perf_counter() - t, 1)
    print(f"[gpu_suite] {name}: {status} ({seconds} s)", flush=True)
    if status != "ok":  # the stage's last lines, so a failure explains itself without the log
        with open(log.name, errors="replace") as f:
            f.seek(start)
            print("\n".join(f.read().splitlines()[-25:]), flush=True)
    return {"name": name, "command": cmd, "seconds": seconds, "returncode": rc, "status": status}


def debugger() -> str | None:
    """gdb, else CUDA's cuda-gdb (it debugs programs without GPU code too;
    GPU images often carry it and no gdb), else None."""
    for name in ("gdb", "cuda-gdb"):
        found = shutil.which(name)
        if found:
            return found
    bundled = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "cuda-gdb"
    return str(bundled) if bundled.is_file() else None


def crashed(result: dict) -> bool:
    """Whether a stage's process died of a signal (a segfault in an
    extension, say) rather than failing: subprocess gives -N, a shell 128+N."""
    rc = result["returncode"]
    return rc is not None and (rc < 0 or rc > 128)


def backtrace_command(debugger_path: str, cmd: list[str]) -> list[str]:
    """``cmd`` (a pytest run) again under the debugger in batch mode, stopping
    at the first failure: at a fatal signal it prints the native stack, the
    instructions at the faulting address and the registers, which Python's
    faulthandler (the Python frames only) cannot."""
    return [debugger_path, "-q", "-batch", "-ex", "set pagination off", "-ex", "run", "-ex", "bt 40",
            "-ex", "x/8i $pc", "-ex", "info registers", "--args", *cmd, "-x", "-p", "no:faulthandler"]


def test_counts(xml: Path) -> dict | None:
    """passed / failed / errors / skipped from pytest's JUnit XML."""
    if not xml.exists():
        return None
    text = xml.read_text()
    m = re.search(r"<testsuite [^>]*>", text)
    if not m:
        return None
    attrs = dict(re.findall(r'(\w+)="([^"]*)"', m.group(0)))
    total, failed, errors, skipped = (int(attrs.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    reasons = sorted(set(re.findall(r'<skipped [^>]*message="([^"]*)"', text)))
    return {"passed": total - failed - errors - skipped, "failed": failed, "errors": errors, "skipped": skipped,
            "skip_reasons": reasons[:20]}


def driver_findings(out: Path) -> list[dict]:
    """What the cuda backend learned about the driver, per page size (vmm_latency)."""
    found = []
    for path in sorted(out.glob("vmm_latency_*.json")):
        data = json.loads(path.read_text())
        for r in data.get("results", []):
            if r.get("backend") == "cuda":
                found.append({"page_size": r["page_size"], **r.get("facts", {}),
                              "driver": (data["machine"].get("driver") or {}).get("api_version")})
    return found


# The host kernel's paths, plus the C++ compiler the build used and the C++ runtime the process loaded: a
# compiler newer than the runtime it runs against is the first suspect of a crash in the extension.
HOST_KERNEL_PROBE = """
import json, os, shlex, subprocess, sysconfig
import vattn.attention as a
info = a.host_attention_info()
cxx = shlex.split(os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++")[0]
try:
    info["compiler"] = (subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()
                        or [None])[0]
except OSError:
    info["compiler"] = None
try:
    with open("/proc/self/maps") as f:
        info["runtime_libraries"] = sorted({line.split()[-1] for line in f
                                            if any(n in line for n in ("libstdc++", "libgcc_s", "libgomp"))})
except OSError:
    info["runtime_libraries"] = None
print(json.dumps(info))
"""


def host_kernel_info(env: dict[str, str]) -> dict:
    """The host attention kernel's paths on this CPU (supported, compiled, the one calls take), the
    compiler that built it and the C++ runtime libraries the process loaded."""
    proc = subprocess.run([sys.executable, "-c", HOST_KERNEL_PROBE], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["unknown"])[-1]}
    return json.loads(proc.stdout)


def install_wheels(wheels: Path, out: Path, env: dict[str, str], log) -> list[str]:
    """Installs every wheel in ``wheels`` into OUTDIR/site (no index, no
    dependencies) and puts it first on the stages' PYTHONPATH; the wheels' names."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        print(f"gpu_suite: no wheels in {wheels}", file=log, flush=True)
        return []
    site = out / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--disable-pip-version-check", "--upgrade", "--target", str(site), *map(str, found)],
                   check=True, stdout=log, stderr=subprocess.STDOUT)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site)] + env["PYTHONPATH"].split(os.pathsep)[1:])
    return [w.name for w in found]


def package_versions(env: dict[str, str]) -> dict:
    """The version of each of PACKAGES as the stages import it (None: not
    importable), and whether transformers is in the range pyproject accepts."""
    code = ("import importlib, json, sys\nout = {}\nfor name in sys.argv[1:]:\n    try:\n"
            "        out[name] = getattr(importlib.import_module(name), '__version__', 'unknown')\n"
            "    except Exception as e:\n        out[name] = None\nprint(json.dumps(out))")
    proc = subprocess.run([sys.executable, "-c", code, *PACKAGES], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["unknown"])[-1]}
    versions = json.loads(proc.stdout)
    tf = versions.get("transformers")
    if tf:
        major_minor = tuple(int(x) for x in re.findall(r"\d+", tf)[:2])
        low, high = TRANSFORMERS_CHECKED
        versions["transformers_in_checked_range"] = low <= major_minor < high
    return versions


def write_summary(out: Path, dry: bool, machine: dict, started: float, results: list[dict], env: dict[str, str],
                  wheels: list[str], complete: bool) -> dict:
    """OUTDIR/gpu_suite.json for the stages so far (``complete``: every stage
    has had its turn); written after each stage, so a call cut off keeps what
    its finished stages measured and the next call resumes from it."""
    summary = {
        "benchmark": "gpu_suite",
        "dry_run": dry,
        "complete": complete,
        "machine": machine,
        "build": "one build for every GPU: the extension has no device code and loads the driver at run time",
        "seconds": round(time.perf_counter() - started, 1),
        "stages": results,
        "tests": test_counts(out / "tests.xml"),
        "host_kernel": host_kernel_info(env) if complete else None,
        "host_kernel_tests": test_counts(out / "host_kernel_tests.xml"),
        "driver_findings": driver_findings(out),
        "packages": package_versions(env) if complete else None,
        "wheels_installed": wheels,
        "files": sorted(p.name for p in out.iterdir() if p.suffix in (".json", ".png")),
    }
    (out / "gpu_suite.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def pack(out: Path, archive_dir: Path, slug: str, dry: bool) -> Path:
    """Every result file of the run (ARCHIVED suffixes, not the build or the
    carried wheels) as one gpu_suite_<slug>_<date>[_dryrun].tar.gz in archive_dir."""
    stem = f"gpu_suite_{slug}_{time.strftime('%Y%m%d-%H%M%S')}{'_dryrun' if dry else ''}"
    archive_dir.mkdir(parents=True, exist_ok=True)
    path = archive_dir / f"{stem}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for f in sorted(out.iterdir()):
            if f.is_file() and f.suffix in ARCHIVED:
                tar.add(f, arcname=f"{stem}/{f.name}")
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir", type=Path)
    p.add_argument("--dry-run", action="store_true", help="CPU rehearsal (also VATTN_GPU_SUITE_DRY_RUN=1)")
    p.add_argument("--wheels", type=Path, default=None,
                   help="a folder of wheels to install for the stages (no network needed), e.g. transformers")
    p.add_argument("--archive", type=Path, default=None, help="where the run's .tar.gz goes (default OUTDIR)")
    p.add_argument("--fresh", action="store_true", help="run every stage, though an earlier call finished some")
    args = p.parse_args()
    dry = args.dry_run or os.environ.get("VATTN_GPU_SUITE_DRY_RUN", "") not in ("", "0")
    out = args.outdir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [x for x in [os.environ.get("PYTHONPATH")] if x]),
               VATTN_RESULTS_DIR=str(out), MPLBACKEND="Agg")
    env.pop("VATTN_GPU_SUITE_DRY_RUN", None)
    # the cuda.h check takes a header the machine has, else downloads a wheel: without network, fail fast
    env.setdefault("PIP_RETRIES", "1")
    env.setdefault("PIP_TIMEOUT", "10")
    started = time.perf_counter()
    with open(out / "gpu_suite.log", "a") as log:
        print(f"==== gpu_suite {'dry run ' if dry else ''}{time.strftime('%Y-%m-%d %H:%M:%S')}", file=log, flush=True)
        fake = None
        if dry:
            env["VATTN_GPU_SUITE_DRY_RUN"] = "1"
            env.setdefault("OMP_NUM_THREADS", "1")  # tiny tensors: thread start-up and spinning would dominate
            fake = build_fake_driver(out, log)
            if fake is not None:
                env["VATTN_CUDA_DRIVER_LIB"] = str(fake)
        else:
            import torch

            if not torch.cuda.is_available():
                print("gpu_suite: torch sees no CUDA GPU; run with --dry-run for the CPU rehearsal", file=sys.stderr)
                return 2
        wheels = install_wheels(args.wheels.resolve(), out, env, log) if args.wheels else []
        machine = machine_info(env)  # before the build: without the driver's details, which need the extension
        earlier = {} if args.fresh else finished_stages(out, dry)
        results: list[dict] = []
        for name, cmd, limit in stages(dry, fake is not None):
            left = int(DEADLINE_S - (time.perf_counter() - started))
            if name in earlier:
                results.append(dict(earlier[name], resumed=True))
                print(f"[gpu_suite] {name}: ok in an earlier call, kept", flush=True)
            elif name == "build" and extension_up_to_date():
                results.append({"name": name, "command": cmd, "seconds": 0, "returncode": 0, "status": "ok",
                                "note": "the extension was built ahead and is newer than every source"})
                print("==== build: up to date, not rebuilt", file=log, flush=True)
                print("[gpu_suite] build: up to date, not rebuilt", flush=True)
            elif left < 5:
                results.append({"name": name, "command": cmd, "seconds": 0, "returncode": None,
                                "status": f"not run: the suite's {DEADLINE_S} s were spent"})
            else:
                command = [c.replace("{out}", str(out)) for c in cmd]
                results.append(run_stage(name, command, min(limit, left), env, log))
                left = int(DEADLINE_S - (time.perf_counter() - started))
                dbg = debugger() if "pytest" in command and crashed(results[-1]) and left >= 30 else None
                if dbg:  # the crash's native stack, while the machine is still ours
                    trace = run_stage(f"{name}_backtrace", backtrace_command(dbg, command), min(180, left), env, log)
                    trace["status"] = "ok" if trace["returncode"] is not None else trace["status"]
                    results.append(trace)
            if name == "build":
                machine = machine_info(env)
            summary = write_summary(out, dry, machine, started, results, env, wheels, complete=False)
    summary = write_summary(out, dry, machine, started, results, env, wheels, complete=True)
    failed = [r["name"] for r in results if r["status"] != "ok"]
    archive = pack(out, (args.archive or out).resolve(), re.sub(r"[^a-z0-9.-]+", "-", machine_slug(machine)), dry)
    print(f"[gpu_suite] {'dry run ' if dry else ''}done in {summary['seconds']} s; "
          f"{'failed: ' + ', '.join(failed) if failed else 'every stage ok'}; summary {out / 'gpu_suite.json'}")
    print(f"[gpu_suite] archive {archive}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
