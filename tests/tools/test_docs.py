"""Every ```python block of README.md and docs/**/*.md runs as written.

Each block runs on its own: in a fresh namespace (``__name__ == "__main__"``,
nothing defined by the block before it) and a fresh working directory, on the
CPU, with this checkout's vattn importable. The blocks of one page share one
child interpreter, so that torch is imported once per page rather than once
per block; vattn's default manager is cleaned up between blocks. A block that
cannot run here says so in the markdown, right before it:

    <!-- skip-test: needs a CUDA GPU -->

and is skipped with that reason (which, like every skip reason of the suite,
names its kind first: "needs ...: "). Bash blocks are not run (the README's
test command is checked against CI in tests/tools/test_cli.py), except in a
walkthrough.

A walkthrough is the blocks of a page marked

    <!-- vllm-walkthrough -->                      (the block runs)
    <!-- vllm-walkthrough: saved as offline.py -->  (a python block a later block runs)

docs/vllm.md's, from an environment to a served completion. They run as a
user following the page runs them: in order, in one working directory, in
vLLM's environment (its bin/ first on PATH, as ``source .venv-vllm/bin/activate``
leaves it; this checkout's vattn importable), bash blocks with ``bash -e``,
python blocks as scripts (``python block.py``), until one fails. Two strings
are rewritten so that two runs on one machine do not collide: the port 8000
becomes a free port, the budget name my-llms one of this run's own. Every
process a block leaves behind (the servers it starts with ``&``) is killed
at the end. Long (several vLLM start-ups): VATTN_LONG_TESTS=1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(?:<!--\s*skip-test:\s*(?P<skip>.+?)\s*-->\s*\n)?^```python[ \t]*\n(?P<code>.*?)^```[ \t]*$",
                   re.M | re.S)
SKIP_KIND = re.compile(r"needs [^:]+: ")
WALKTHROUGH = re.compile(r"<!--\s*vllm-walkthrough(?::\s*saved as (?P<file>[\w.-]+))?\s*-->\s*\n"
                         r"^```(?P<lang>bash|python)[ \t]*\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)
LONG = os.environ.get("VATTN_LONG_TESTS") == "1"

# Runs in the child: argv[1] is a JSON list of [name, code] to run, argv[2] where to write the outcomes
# ({name: null when it ran, else the traceback}), rewritten after every block so a crash keeps the ones before.
RUNNER = r"""
import gc, json, os, sys, tempfile, traceback
blocks, out_path = json.load(open(sys.argv[1])), sys.argv[2]
outcomes = {}
for name, code in blocks:
    with tempfile.TemporaryDirectory() as cwd:
        os.chdir(cwd)
        try:
            exec(compile(code, name, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            outcomes[name] = None
        except SystemExit as e:
            outcomes[name] = None if e.code in (0, None) else f"SystemExit({e.code!r})"
        except BaseException:
            outcomes[name] = traceback.format_exc()
        os.chdir("/")
    if "vattn" in sys.modules:  # a block may leave the default manager open; the next may init its own
        try:
            sys.modules["vattn"].cleanup()
        except Exception:
            pass
    gc.collect()
    with open(out_path, "w") as f:
        json.dump(outcomes, f)
"""


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line of the opening fence, code, skip reason or None) per python block, but a walkthrough's."""
    walked = {m.start("code") for m in WALKTHROUGH.finditer(text)}
    return [(text.count("\n", 0, m.start("code")), m.group("code"), m.group("skip")) for m in BLOCK.finditer(text)
            if m.start("code") not in walked]


def walkthrough(text: str) -> list[tuple[int, str, str, str | None]]:
    """(line of the opening fence, language, code, file it is saved as or None) per walkthrough block."""
    return [(text.count("\n", 0, m.start("code")), m.group("lang"), m.group("code"), m.group("file"))
            for m in WALKTHROUGH.finditer(text)]


def block_name(page: Path, line: int) -> str:
    return f"{page.relative_to(ROOT)}:{line}"


CASES = [pytest.param(page, line, code, skip, id=block_name(page, line))
         for page in pages() for line, code, skip in blocks(page.read_text())]


def run_page(page: Path, tmp: Path) -> tuple[dict[str, str | None], str]:
    """Runs the page's runnable blocks in one child; (outcome per block name, the child's output)."""
    runnable = [(block_name(page, line), code) for line, code, skip in blocks(page.read_text()) if not skip]
    spec, out = tmp / "blocks.json", tmp / "outcomes.json"
    spec.write_text(json.dumps(runnable))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("VATTN_VLLM", None)
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(spec), str(out)], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=600)
    outcomes = json.loads(out.read_text()) if out.exists() else {}
    return outcomes, f"exit status {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def page_outcomes(tmp_path_factory):
    """Runs each page's blocks once, when its first block's test asks."""
    done: dict[Path, tuple[dict[str, str | None], str]] = {}

    def outcome(page: Path) -> tuple[dict[str, str | None], str]:
        if page not in done:
            done[page] = run_page(page, tmp_path_factory.mktemp("docs"))
        return done[page]

    return outcome


def test_the_docs_have_python_blocks_to_run():
    # README's quick start and one per docs page at least: a broken pattern would find none
    assert len(CASES) >= 10
    assert any(case.id.startswith("README.md:") for case in CASES)


def test_blocks_are_found_with_their_skip_reasons():
    text = ("```python\nprint(1)\n```\n\n<!-- skip-test: needs a CUDA GPU: cuda tensors -->\n```python\nx = 1\n"
            "```\n```bash\necho not python\n```\n")
    assert blocks(text) == [(1, "print(1)\n", None), (6, "x = 1\n", "needs a CUDA GPU: cuda tensors")]


LINK = re.compile(r"\]\((?!https?://|#)([^)\s#]+)(?:#[^)\s]*)?\)")


def test_relative_links_point_at_files_that_exist():
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in pages() for target in LINK.findall(page.read_text())
              if not (page.parent / target).exists()]
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_the_readme_is_a_front_page_that_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) < 200, f"the README is a front page ({len(lines)} lines); move detail into docs/"
    first_screen = "\n".join(lines[:60])
    # what vattn is, the two commands and the quick start, before any scrolling
    assert "python -m vattn demo" in first_screen and "<!-- test-command -->" in first_screen
    quick_start = first_screen.split("## Quick start", 1)[-1]
    assert "```python" in quick_start and quick_start.count("```") >= 2, "the quick start ends on the first screen"
    linked = {(ROOT / target).resolve() for target in LINK.findall(readme)}
    unlinked = [str(p.relative_to(ROOT)) for p in pages()[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


@pytest.mark.parametrize("page,line,code,skip", CASES)
def test_python_block_runs_as_written(page, line, code, skip, page_outcomes):
    if skip:
        assert SKIP_KIND.match(skip), f"a skip reason names its kind first ('needs a CUDA GPU: ...'), got {skip!r}"
        pytest.skip(skip)
    if "transformers" in code and importlib.util.find_spec("transformers") is None:
        pytest.skip('needs transformers: pip install -e ".[transformers]"')
    outcomes, output = page_outcomes(page)
    name = block_name(page, line)
    assert name in outcomes, f"the page's child stopped before this block ran:\n{output}"
    assert outcomes[name] is None, f"the block failed:\n{code}\n--- traceback ---\n{outcomes[name]}"


VLLM_PAGE = ROOT / "docs" / "vllm.md"
WALK_CASES = [pytest.param(line, lang, code, file, id=block_name(page, line))
              for page in [VLLM_PAGE] for line, lang, code, file in walkthrough(page.read_text())]


def vllm_python() -> Path | None:
    """The interpreter of vLLM's environment (VATTN_VLLM_PYTHON, else .venv-vllm), as tests/integrations use."""
    candidate = Path(os.environ.get("VATTN_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
    return candidate if candidate.exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rewrite(code: str, port: int, budget: str) -> str:
    """The two strings that would collide between runs on one machine (see the module docstring)."""
    return re.sub(r"\bmy-llms\b", budget, re.sub(r"\b8000\b", str(port), code))


def log_tails(cwd: Path, chars: int = 3000) -> str:
    """The end of every log the walkthrough wrote (a server's, a block's), for a failure's message."""
    return "\n".join(f"--- {log.name} ---\n{log.read_text(errors='replace')[-chars:]}"
                     for log in sorted(cwd.glob("*.log")))


def run_walkthrough(cwd: Path) -> dict[int, str | None]:
    """Runs docs/vllm.md's walkthrough in ``cwd``; {line: None when the block ran, else why not}."""
    python = vllm_python()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VATTN_VLLM", "VATTN_BUDGET", "VLLM_")) and k != "PYTHONHOME"}
    env.update(PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(python.parent.parent),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    port, budget = free_port(), f"my-llms-{os.getpid()}"
    outcomes: dict[int, str | None] = {}
    groups: list[int] = []  # process groups of the blocks: whatever they started in the background
    failed = None
    try:
        for i, (line, lang, code, file) in enumerate(walkthrough(VLLM_PAGE.read_text())):
            if failed is not None:
                outcomes[line] = f"not run: the block at line {failed} failed"
                continue
            code = rewrite(code, port, budget)
            if file:
                (cwd / file).write_text(code)
                outcomes[line] = None
                continue
            if lang == "python":
                script = cwd / f"walkthrough_{i}.py"
                script.write_text(code)
                argv = [str(python), script.name]
            else:
                argv = ["bash", "-e", "-c", code]
            out = cwd / f"block_{i}.log"
            with open(out, "w") as f:  # a file, not a pipe: a server started with & must not hold it open
                proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                        start_new_session=True)
                groups.append(proc.pid)
                try:
                    rc = proc.wait(timeout=900)
                except subprocess.TimeoutExpired:
                    rc = "timed out after 900 s"
            if rc != 0:
                failed = line
                outcomes[line] = f"exit status {rc}\n{log_tails(cwd)}"
            else:
                outcomes[line] = None
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for group in groups:
                try:
                    os.killpg(group, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(2)
        subprocess.run([sys.executable, "-m", "vattn", "budget", "rm", budget], capture_output=True)
    return outcomes


@pytest.fixture(scope="module")
def walkthrough_outcomes(tmp_path_factory):
    """Runs the walkthrough once, when its first block's test asks."""
    done: list[dict[int, str | None]] = []

    def outcomes() -> dict[int, str | None]:
        if not done:
            done.append(run_walkthrough(tmp_path_factory.mktemp("vllm-walkthrough")))
        return done[0]

    return outcomes


def test_the_vllm_walkthrough_is_found_in_order():
    steps = walkthrough(VLLM_PAGE.read_text())
    commands = "\n".join(code for _, _, code, _ in steps)
    # make a model, run LLM offline, start the API server, ask it with curl and openai, stop it
    for needle in ("python -m vattn make-model tiny-llama", "python offline.py", "openai.api_server",
                   "curl -sf localhost:8000/v1/completions", "from openai import OpenAI", "kill $(cat server.pid)"):
        assert needle in commands, needle
    assert [file for _, _, _, file in steps].count("offline.py") == 1
    text = "```python\nx = 1\n```\n<!-- vllm-walkthrough: saved as a.py -->\n```python\ny = 2\n```\n" \
           "<!-- vllm-walkthrough -->\n```bash\necho hi\n```\n"
    assert walkthrough(text) == [(5, "python", "y = 2\n", "a.py"), (9, "bash", "echo hi\n", None)]
    assert [code for _, code, _ in blocks(text)] == ["x = 1\n"]  # not run as a plain python block too
    assert rewrite("curl localhost:8000/x; --port 8000; 80000; my-llms", 1234, "b") == \
        "curl localhost:1234/x; --port 1234; 80000; b"


RAN_BY = re.compile(r"<!-- ran by ([^>]+?) -->\s*\n```bash\n(.*?)^```", re.M | re.S)


def test_every_block_of_the_vllm_page_runs_or_is_the_readmes():
    """The walkthrough runs its blocks, the plain python blocks run above, a block marked ``<!-- ran by
    FILE ... -->`` is what those long tests run (every option it shows is theirs); the one block left,
    vLLM's environment, is the README's test command (run by CI) and the activation the walkthrough runs in."""
    text = VLLM_PAGE.read_text()
    fences = [m for m in re.finditer(r"^```(\w+)[ \t]*\n(.*?)^```[ \t]*$", text, re.M | re.S)]
    walked = {m.start("code") for m in WALKTHROUGH.finditer(text)}
    plain = {m.start("code") for m in BLOCK.finditer(text)}
    ran_by = {m.start(2) for m in RAN_BY.finditer(text)}
    for m in RAN_BY.finditer(text):
        tests = "".join((ROOT / name).read_text() for name in m.group(1).split())
        for option in re.findall(r"(--[a-z][a-z-]+)", m.group(2)):
            assert option in tests, f"{option} is shown as run by {m.group(1)}, which never pass it"
    rest = [m for m in fences if m.start(2) not in walked | plain | ran_by]
    assert len(rest) == 1 and rest[0].group(1) == "bash", [m.group(0)[:80] for m in rest]
    lines = rest[0].group(2).replace("\\\n", " ").splitlines()
    assert lines[-1].split("#")[0].strip() == "source .venv-vllm/bin/activate"
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"<!-- test-command -->\s*```bash\n(.+?)\n```", readme, re.S).group(1)
    for step in " ".join(line.split("#")[0] for line in lines[:-1]).split("&&"):
        assert " ".join(step.split()) in command, f"{step.strip()!r} is not in the README's test command"


@pytest.mark.parametrize("line,lang,code,file", WALK_CASES)
def test_vllm_walkthrough_block_runs_as_written(line, lang, code, file, walkthrough_outcomes):
    if not LONG:
        pytest.skip("long test: set VATTN_LONG_TESTS=1 (docs/vllm.md's walkthrough: five vLLM start-ups)")
    if vllm_python() is None:
        pytest.skip("needs the vLLM environment: no .venv-vllm (see docs/vllm.md) and no VATTN_VLLM_PYTHON")
    outcome = walkthrough_outcomes()[line]
    assert outcome is None, f"the block failed:\n{code}\n--- why ---\n{outcome}"


def test_the_quick_starts_two_figures_are_the_readmes():
    """README's Quick start prints 512 KiB or 4 MiB behind its 100-token request, by thread timing; both
    figures, and why, as the README says them."""
    import torch

    import vattn

    readme = (ROOT / "README.md").read_text()
    shape = dict(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, max_batch_size=8,
                 max_context_len=4096, page_size=64 * 1024, device="cpu")
    assert "vattn.KVCacheManager(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32," in readme
    assert "It prints 524288 or 4194304 bytes behind the request" in readme
    figures = {}
    for eager in (False, True):
        kv = vattn.KVCacheManager(**shape, policy={"eager": eager})
        try:
            if eager:  # the mapper maps the next slot for eager_tokens: wait for it, as a slow first call would
                deadline = time.monotonic() + 30
                while kv.stats()["background_page_maps"] < 64 and time.monotonic() < deadline:
                    time.sleep(0.01)
            r = kv.alloc_reqid()
            lens = [0] * 8
            lens[r] = 100
            assert kv.step(lens)
            figures[eager] = kv.mapped_bytes(r)
        finally:
            kv.cleanup()
    assert figures == {False: 8 * 64 * 1024, True: 8 * 1024 * 512}  # 8 buffers x (1 page | 1024 tokens x 512 B)
    assert figures[False] == 524288 and figures[True] == 4194304
