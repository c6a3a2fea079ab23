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
test command is checked against CI in tests/tools/test_cli.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(?:<!--\s*skip-test:\s*(?P<skip>.+?)\s*-->\s*\n)?^```python[ \t]*\n(?P<code>.*?)^```[ \t]*$",
                   re.M | re.S)
SKIP_KIND = re.compile(r"needs [^:]+: ")

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
    """(line of the opening fence, code, skip reason or None) per python block."""
    return [(text.count("\n", 0, m.start("code")), m.group("code"), m.group("skip")) for m in BLOCK.finditer(text)]


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
