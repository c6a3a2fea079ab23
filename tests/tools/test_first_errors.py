"""The first errors a newcomer meets say what is wrong and what to do.

Each case runs in a child process, the way a user meets it: a source tree
whose extension was never built, an environment without torch (or without
matplotlib), a mistyped ``--model`` path, an install without torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from conftest import load_setup

ROOT = Path(__file__).resolve().parents[2]

# Makes `import NAME` fail in the child as it does where NAME is not installed.
BLOCK_IMPORT = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == {name!r} or name.startswith({name!r} + "."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Block())
"""


def run_python(code: str, pythonpath: Path = ROOT, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=cwd)


def test_import_from_an_unbuilt_source_tree_says_how_to_build(tmp_path):
    tree = tmp_path / "src"
    for source in (ROOT / "vattn").rglob("*.py"):  # the package as a fresh clone has it: no .so
        target = tree / source.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    # an editable install of vattn (the test command's) would hand the copy its vattn._C: set it aside
    no_editable = ("import sys\nsys.meta_path[:] = [f for f in sys.meta_path "
                   "if not getattr(f, '__module__', '').startswith('__editable__')]\n")
    proc = run_python(no_editable + "import vattn", pythonpath=tree, cwd=tree)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "circular import" not in last
    assert "vattn._C is not built" in last and str(tree / "vattn") in last
    assert "pip install -e ." in last and "python setup.py build_ext --inplace" in last


def test_import_without_torch_says_install_torch_first():
    proc = run_python(BLOCK_IMPORT.format(name="torch") + "import vattn")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: vattn needs torch")
    assert "install torch first (see README)" in last


def demo(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = prelude + f"import sys\nfrom vattn.cli.main import main\nsys.exit(main({['demo', *args]!r}))"
    return run_python(code)


def test_demo_with_a_missing_model_path_says_what_a_model_directory_holds(tmp_path):
    proc = demo("--quick", "--model", str(tmp_path / "nonexistent"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"--model {tmp_path / 'nonexistent'}: no such directory" in proc.stderr
    assert "config.json" in proc.stderr and "weights" in proc.stderr
    assert proc.stdout == ""  # nothing served
    proc = demo("--quick", "--model", str(tmp_path))  # a folder, but no model in it
    assert proc.returncode == 2 and "no config.json there" in proc.stderr


def test_demo_plot_without_matplotlib_says_so_before_the_run(tmp_path):
    proc = demo("--quick", "--plot", str(tmp_path / "demo.png"), prelude=BLOCK_IMPORT.format(name="matplotlib"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "needs matplotlib" in proc.stderr and 'pip install -e ".[bench]"' in proc.stderr
    assert "finished" not in proc.stdout  # checked before the trace, not after it
    proc = demo("--quick", "--plot", str(tmp_path / "no-such-folder" / "demo.png"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "finished" not in proc.stdout


def test_install_without_torch_warns_to_install_torch_first(tmp_path):
    setup = load_setup()
    assert setup.torch_missing_warning(sys.executable, dict(os.environ)) is None  # this one has torch
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)  # no site-packages of ours: no torch
    # pip's build isolation puts its overlay on PYTHONPATH; the probe must look past it
    environ = dict(os.environ, PYTHONPATH=str(tmp_path / "pip-build-env-x" / "site"), PYTHONNOUSERSITE="1")
    warning = setup.torch_missing_warning(str(bare / "bin" / "python"), environ)
    assert warning and "torch is not installed" in warning and "install torch first (see README)" in warning


def test_running_from_the_directory_holding_the_checkout_says_why(tmp_path):
    # a clone is a folder named vattn; Python started next to it finds that folder before the editable
    # install's finder (the current directory comes first on sys.path) and imports it as an empty namespace
    # package: `import vattn` succeeds and `vattn.KVCacheManager` is an AttributeError far from the cause,
    # and `python -m vattn` runs the checkout's top __main__.py, which says why
    (tmp_path / "vattn").symlink_to(ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def python(*args: str, cwd: Path = tmp_path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd)

    shadowed = python("-c", "import vattn; print(vattn.__file__, list(vattn.__path__))")
    assert shadowed.returncode == 0 and shadowed.stdout.split()[0] == "None"  # what README's Quick start warns of
    proc = python("-m", "vattn", "demo", "--quick")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m vattn: Python found") and "the root of a vattn checkout" in last
    assert str(tmp_path) in last and str(ROOT / "vattn") in last and "another directory" in last
    elsewhere = tmp_path / "elsewhere"  # one directory away, the installed package imports as usual
    elsewhere.mkdir()
    ok = python("-m", "vattn", "--version", cwd=elsewhere)
    assert ok.returncode == 0 and ok.stdout.startswith("vattn "), ok.stderr
