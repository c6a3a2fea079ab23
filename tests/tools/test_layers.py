"""docs/design.md section 1 draws the layers; the tree must match it: every
folder of csrc/ and of vattn/ is a row, includes and imports only go down the
stack (to the same row or rows above it), and no Python modules form an
import cycle at run time. Outside the package: no benchmark takes anything
from tests/, workloads/ (what both run) takes nothing from either, and no
Python source file is over 700 lines."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
PACKAGE = ROOT / "vattn"
COMPILED = {"vattn._C", "vattn._cpu_attn", "vattn._testing"}  # the extension modules: below every Python row
ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]+)\|(.*)$")  # level, folder, what it holds
ROOT_ROW = "vattn/"  # the package's root: the modules directly in vattn/


def layer_tables() -> tuple[dict[str, int], dict[str, int], list[str]]:
    """(C++ folder -> level, Python folder -> level, the root row's modules) from docs/design.md."""
    text = DESIGN.read_text()
    cpp_part, py_part = text.split("Python (`vattn/`", 1)
    py_part = py_part.split("\n## ", 1)[0]

    def rows(part: str) -> list[tuple[int, list[str], list[str]]]:
        return [(int(m.group(1)), re.findall(r"`([^`]+)`", m.group(2)), re.findall(r"`([^`]+)`", m.group(3)))
                for m in map(ROW.match, part.splitlines()) if m]

    cpp = {name: level for level, names, _ in rows(cpp_part.split("## 1. Layers", 1)[1]) for name in names}
    python, root_modules = {}, []
    for level, (folder,), holds in rows(py_part):  # a Python row names one folder
        python[folder] = level
        if folder == ROOT_ROW:
            root_modules = [n for n in holds if re.fullmatch(r"[a-z_]+", n)]
    return cpp, python, root_modules


CPP_LEVELS, PY_LEVELS, ROOT_MODULES = layer_tables()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p) for p in PACKAGE.rglob("*.py")}


def folder_of(module: str) -> str:
    """'vattn.kernels.host' -> 'kernels/'; 'vattn.integrations.vllm.budget' -> 'integrations/';
    'vattn.attention' and 'vattn' -> 'vattn/' (the root row)."""
    parts = module.split(".")[1:]
    if parts and (PACKAGE / parts[0]).is_dir():
        return parts[0] + "/"
    return ROOT_ROW


def runtime_imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) for every import of a vattn module that runs when ``path``
    (its text, or ``source`` as if it were there) runs: at any depth, inside
    functions too, but not under ``if TYPE_CHECKING:``. ``from package import
    name`` is an import of ``package.name`` when that is a module."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for child in node.body for n in ast.walk(child)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "vattn"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "vattn":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub if sub in MODULES or sub in COMPILED else target))
    return sorted(found)


def import_graph() -> dict[str, set[str]]:
    """vattn module -> the vattn modules it imports at run time (compiled modules left out)."""
    return {module_name(p): {t for _, t in runtime_imports(p) if t not in COMPILED and t != module_name(p)}
            for p in PACKAGE.rglob("*.py")}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_tables_are_read():
    assert {"common", "backends", "core", "python"} <= CPP_LEVELS.keys()
    assert {"common/", "core/", "kernels/", "integrations/", "engine/", "cli/", ROOT_ROW} <= PY_LEVELS.keys()
    assert CPP_LEVELS["common"] < CPP_LEVELS["backends"] < CPP_LEVELS["core"] < CPP_LEVELS["python"]
    assert PY_LEVELS["common/"] < PY_LEVELS["core/"] < PY_LEVELS["kernels/"] < PY_LEVELS["integrations/"] \
        < PY_LEVELS["engine/"] < PY_LEVELS["cli/"] < PY_LEVELS[ROOT_ROW]
    assert {"__init__", "attention"} <= set(ROOT_MODULES)


def test_every_folder_is_a_row():
    folders = {p.name for p in (ROOT / "csrc").iterdir() if p.is_dir()}
    assert folders - CPP_LEVELS.keys() == set(), "csrc folders missing from docs/design.md section 1"
    assert CPP_LEVELS.keys() - folders == set(), "docs/design.md names csrc folders that do not exist"
    packages = {p.name + "/" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages - PY_LEVELS.keys() == set(), "vattn folders missing from docs/design.md section 1"
    assert PY_LEVELS.keys() - packages == {ROOT_ROW}, "docs/design.md names vattn folders that do not exist"
    at_root = {p.stem for p in PACKAGE.glob("*.py")}
    assert at_root == set(ROOT_MODULES), ("the package's root holds only the modules its row names "
                                          "(docs/design.md section 1); put others in a folder")


def test_cpp_includes_go_down():
    wrong = []
    include = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/', re.M)
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix not in {".h", ".cpp", ".c"}:
            continue
        folder = path.relative_to(ROOT / "csrc").parts[0]
        for target in include.findall(path.read_text()):
            if target != folder and CPP_LEVELS.get(target, 99) >= CPP_LEVELS[folder]:
                wrong.append(f"{path.relative_to(ROOT)} (level {CPP_LEVELS[folder]}) includes {target}/ "
                             f"(level {CPP_LEVELS.get(target)})")
    assert not wrong, "includes must go down the layers of docs/design.md:\n" + "\n".join(wrong)


def test_python_imports_go_down():
    wrong, seen = [], 0
    for path in sorted(PACKAGE.rglob("*.py")):
        folder = folder_of(module_name(path))
        for line, target in runtime_imports(path):
            seen += 1
            to = folder_of(target)
            if target in COMPILED or to == folder:
                continue
            if PY_LEVELS[to] > PY_LEVELS[folder]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({folder}, level {PY_LEVELS[folder]}) imports "
                             f"{target} ({to}, level {PY_LEVELS[to]})")
    assert seen > 50  # the scan sees the package's imports
    assert not wrong, "imports must go down the layers of docs/design.md:\n" + "\n".join(wrong)


def test_no_import_cycle_at_run_time():
    found = cycles(import_graph())
    assert not found, "modules that import each other at run time (through the others listed):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_checks_catch_an_upward_import_and_a_cycle():
    """The scan resolves relative imports and skips TYPE_CHECKING blocks; a
    function-level import back into a module that imports this one is a cycle."""
    batch = PACKAGE / "kernels" / "batch.py"
    probe = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..engine import Scheduler\n"
             "def f():\n    from ..engine import Engine\nfrom .. import _C\nimport vattn.attention\n")
    targets = [t for _, t in runtime_imports(batch, probe)]
    assert targets == ["vattn.engine", "vattn._C", "vattn.attention"]
    assert all(PY_LEVELS[folder_of(t)] > PY_LEVELS["kernels/"] for t in ("vattn.engine", "vattn.attention"))
    graph = import_graph()
    graph["vattn.kernels.batch"] = graph["vattn.kernels.batch"] | {"vattn.kernels.functions"}
    assert any({"vattn.kernels.batch", "vattn.kernels.functions"} <= set(c) for c in cycles(graph))


# ---- outside the package: benchmarks/, tests/ and what they share (workloads/) --------------------------------

SOURCE_FOLDERS = ("vattn", "tests", "benchmarks", "workloads")  # every folder of Python source
MAX_LINES = 700  # a source file past this is more than one concept: split it
PATH_CALLS = ("sys.path", "PYTHONPATH", "site.addsitedir")  # a statement naming one of these changes where imports look


def stems(folder: Path) -> set[str]:
    """The names ``import <name>`` finds the folder's modules by (a script's own folder is on its path)."""
    return {p.stem for p in folder.rglob("*.py")}


def spelled_paths(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """(node, path) for every path the code spells: a string constant (bare strings, docstrings among them,
    are prose and left out) or a ``/`` chain of them, ``ROOT / "tests" / "x.py"`` -> ``tests/x.py``."""
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    inner = set()  # the parts of a chain: reported as the whole chain only

    def parts(node: ast.AST) -> list[str]:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            inner.update((id(node.left), id(node.right)))
            return parts(node.left) + parts(node.right)
        return [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else []

    found = []
    for node in ast.walk(tree):
        if id(node) in inner or id(node) in prose:
            continue
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) or \
                isinstance(node, ast.Constant) and isinstance(node.value, str):
            path = "/".join(parts(node))
            if path:
                found.append((node, path))
    return found


def reaches_into(path: Path, others: dict[str, set[str]], source: str | None = None) -> list[str]:
    """What the file at ``path`` (its text, or ``source``) takes from the folders named in ``others``
    (folder -> its modules' names): an import of ``folder.x`` or of a module of its by bare name (unless the
    file's own folder holds that name: a script's folder comes first on sys.path); a statement that puts
    such a folder on sys.path or PYTHONPATH; a path to a Python file there that is not a test file (a
    helper run as a script)."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    own = stems(path.parent)
    wrong = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
        for name in names:
            top = name.split(".")[0]
            if top in others or top not in own and any(top in modules for modules in others.values()):
                wrong.append(f"{path.name}:{node.lineno} imports {name}")
    for node, spelled in spelled_paths(tree):
        segments = spelled.split("/")
        folder = next((s for s in segments if s in others), None)
        if folder and segments[-1].endswith(".py") and not segments[-1].startswith("test_"):
            wrong.append(f"{path.name}:{node.lineno} names {spelled}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign)) and \
                any(call in ast.unparse(node) for call in PATH_CALLS):
            for _, spelled in spelled_paths(node):
                if any(s in others for s in spelled.split("/")):
                    wrong.append(f"{path.name}:{node.lineno} puts {spelled} on the import path")
    return wrong


def test_no_benchmark_takes_from_tests():
    """Tests may load a benchmark to test it; a benchmark needs nothing of tests/ (what both run is in
    workloads/)."""
    tests = {"tests": stems(ROOT / "tests")}
    wrong = [w for p in sorted((ROOT / "benchmarks").glob("*.py")) for w in reaches_into(p, tests)]
    assert not wrong, "benchmarks/ takes from tests/ (move what both use to workloads/):\n" + "\n".join(wrong)


def test_workloads_take_nothing_from_tests_or_benchmarks():
    others = {"tests": stems(ROOT / "tests"), "benchmarks": stems(ROOT / "benchmarks")}
    paths = sorted((ROOT / "workloads").glob("*.py"))
    assert {"vllm_scenario.py", "vllm_launch.py"} <= {p.name for p in paths}
    wrong = [w for p in paths for w in reaches_into(p, others)]
    assert not wrong, "workloads/ must stand alone below tests/ and benchmarks/:\n" + "\n".join(wrong)


def long_files(folders: list[Path]) -> list[str]:
    """'path: N lines' for every Python file under ``folders`` of more than MAX_LINES lines."""
    counts = ((p, len(p.read_text().splitlines())) for f in folders for p in sorted(f.rglob("*.py")))
    return [f"{os.path.relpath(p, ROOT)}: {n} lines" for p, n in counts if n > MAX_LINES]


def test_no_source_file_is_over_700_lines():
    long = long_files([ROOT / f for f in SOURCE_FOLDERS])
    assert not long, f"split these by concept (at most {MAX_LINES} lines a file):\n" + "\n".join(long)


def test_the_checks_catch_a_test_helper_in_a_benchmark_and_a_long_file(tmp_path):
    """What benchmarks/ did before workloads/ existed is caught, each way; a file one line too long is."""
    bench = ROOT / "benchmarks" / "probe.py"  # read as if it were there: its folder's modules are its own
    tests = {"tests": stems(ROOT / "tests")}
    assert reaches_into(bench, tests, 'SCENARIO = ROOT / "tests" / "integrations" / "vllm_scenario.py"\n')
    assert reaches_into(bench, tests, 'import sys\nsys.path.insert(0, str(ROOT / "tests" / "integrations"))\n')
    assert reaches_into(bench, tests, "from conftest import load_benchmark\n")
    assert reaches_into(bench, tests, "import tests.kernels.kernel_references\n")
    assert not reaches_into(bench, tests, '"""Runs tests/integrations/helper.py."""\nimport harness\n'
                                          'CUDA_TESTS = ["tests/backends/test_cuda_real.py"]\n')
    work = ROOT / "workloads" / "probe.py"
    others = {"tests": stems(ROOT / "tests"), "benchmarks": stems(ROOT / "benchmarks")}
    assert reaches_into(work, others, "from harness import machine\n")
    assert reaches_into(work, others, 'import os\nos.environ["PYTHONPATH"] = str(ROOT / "benchmarks")\n')
    assert not reaches_into(work, others, "import vllm_models\nfrom workloads.vllm_launch import SCENARIO\n")
    (tmp_path / "fits.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert [os.path.basename(line.split(":")[0]) for line in long_files([tmp_path])] == ["long.py"]


# ---- the vLLM integration: no state shared through module globals; typed values below its adapter ------------

VLLM_PACKAGE = PACKAGE / "integrations" / "vllm"
VLLM_PREFIX = "vattn.integrations.vllm"
# the modules that take vLLM's forward as the adapter's typed value (forward_inputs.ForwardInputs), never as vLLM's
# objects: they import nothing of vLLM and annotate nothing ``Any``
BELOW_ADAPTER = (VLLM_PACKAGE / "worker_cache.py", VLLM_PACKAGE / "worker_budget.py",
                 PACKAGE / "integrations" / "block_placer.py")
MUTABLE_CALLS = {"list", "dict", "set", "deque", "defaultdict", "OrderedDict", "Counter"}


def module_state(tree: ast.Module) -> tuple[set[str], list[str]]:
    """A module's mutable globals (names a function declares ``global``, names bound at module level to a
    list, dict or set display or constructor), and what is wrong within it: a ``global`` name that more than
    one function or method touches (state one function sets for another to read, which other modules then
    reach through them). A name only the function that declares it touches is its own memo (a once-flag)."""
    declared = {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}
    state = set(declared)
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        call = value.func if isinstance(value, ast.Call) else None
        called = call.id if isinstance(call, ast.Name) else call.attr if isinstance(call, ast.Attribute) else None
        if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)) or \
                called in MUTABLE_CALLS:
            state |= {t.id for t in targets if isinstance(t, ast.Name)}
    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    functions += [m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body
                  if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
    wrong = []
    for name in sorted(declared):
        users = [f.name for f in functions if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(f))]
        if len(users) > 1:
            wrong.append(f"global {name} is shared by {', '.join(users)}")
    return state, wrong


def package_module(node: ast.ImportFrom | ast.Import, alias: ast.alias, package: str) -> str | None:
    """The module of ``package`` an import binds (``from . import x``, ``from package import x``,
    ``import package.x as y``); None for anything else."""
    if isinstance(node, ast.Import):
        return alias.name.rpartition(".")[2] if alias.name.startswith(package + ".") and alias.asname else None
    if (node.level == 1 and node.module is None) or (not node.level and node.module == package):
        return alias.name
    return None


def shared_globals(sources: dict[str, str], package: str = VLLM_PREFIX) -> list[str]:
    """What the package's modules (name -> text) share through module globals: a function-set global read by
    another function (:func:`module_state`); ``from .m import name`` of a mutable global of ``m``; reading
    ``m.name`` of one; assigning any ``m.name`` of another module of the package."""
    trees = {name: ast.parse(text, name) for name, text in sources.items()}
    state = {}
    wrong = []
    for name, tree in trees.items():
        state[name], own = module_state(tree)
        wrong += [f"{name}: {w}" for w in own]
    for name, tree in trees.items():
        aliases = {}  # local name -> module of the package
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for alias in node.names:
                module = package_module(node, alias, package)
                if module in trees:
                    aliases[alias.asname or alias.name] = module
                    continue
                source = node.module if isinstance(node, ast.ImportFrom) and node.level == 1 else \
                    node.module.rpartition(".")[2] if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith(package + ".") else None
                if source in trees and alias.name in state[source]:
                    wrong.append(f"{name}:{node.lineno} imports the mutable global {source}.{alias.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                module = aliases[node.value.id]
                if isinstance(node.ctx, ast.Store):
                    wrong.append(f"{name}:{node.lineno} sets {module}.{node.attr}")
                elif node.attr in state[module]:
                    wrong.append(f"{name}:{node.lineno} reads the mutable global {module}.{node.attr}")
    return wrong


def vllm_sources() -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(VLLM_PACKAGE.glob("*.py"))}


def test_the_vllm_modules_share_no_module_global():
    wrong = shared_globals(vllm_sources())
    assert not wrong, ("vattn/integrations/vllm/ shares state through module globals; hand it over explicitly "
                       "(an argument, an object both sides hold):\n" + "\n".join(wrong))


def typed_violations(path: Path, source: str | None = None) -> list[str]:
    """Where a module below the adapter takes vLLM's objects: any annotation naming ``Any``, any import of
    ``Any`` or of vLLM (at any depth)."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    wrong = []
    annotations = [a.annotation for n in ast.walk(tree) if isinstance(n, ast.arguments)
                   for a in n.posonlyargs + n.args + n.kwonlyargs + [n.vararg, n.kwarg] if a is not None]
    annotations += [n.returns for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    annotations += [n.annotation for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)]
    for annotation in filter(None, annotations):
        text = ast.unparse(annotation)
        if re.search(r"\bAny\b", text):
            wrong.append(f"{path.name}:{annotation.lineno} annotates {text}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            wrong += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names
                      if a.name.split(".")[0] == "vllm"]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] == "vllm" or any(a.name == "Any" for a in node.names):
                wrong.append(f"{path.name}:{node.lineno} imports from {node.module}")
    return wrong


def test_no_vllm_object_below_the_forward_adapter():
    wrong = [w for path in BELOW_ADAPTER for w in typed_violations(path)]
    assert not wrong, ("below vattn/integrations/vllm/forward_inputs.py the forward is a typed value, never a "
                       "vLLM object:\n" + "\n".join(wrong))


def test_the_vllm_checks_catch_a_shared_global_and_an_untyped_vllm_object():
    """A worker handing its cache to the engine core through a global (the setter and the reader are two
    functions), a module importing or setting another's global, a runner annotated ``Any``, a vLLM import
    inside a function: each is caught; a once-flag only its own function touches is not."""
    offered = "_offered = None\ndef offer(c):\n    global _offered\n    _offered = c\ndef attach():\n    return _offered\n"
    assert shared_globals({"budget": offered}) == ["budget: global _offered is shared by offer, attach"]
    once = "_done = False\ndef install():\n    global _done\n    if _done:\n        return\n    _done = True\n"
    registry = "POOLS: dict = {}\n"
    assert shared_globals({"hooks": once, "pools": registry}) == []
    reader = "from .pools import POOLS\nfrom . import pools as p\nfrom . import hooks\nx = p.POOLS\nhooks.flag = 1\n"
    assert shared_globals({"hooks": once, "pools": registry, "reader": reader}) == [
        "reader:1 imports the mutable global pools.POOLS", "reader:4 reads the mutable global pools.POOLS",
        "reader:5 sets hooks.flag"]
    cache = VLLM_PACKAGE / "worker_cache.py"
    assert typed_violations(cache, "from typing import Any\nclass C:\n    runner: Any\n") == [
        "worker_cache.py:3 annotates Any", "worker_cache.py:1 imports from typing"]
    assert typed_violations(cache, "def f(m: 'dict[str, Any]') -> None:\n    from vllm.v1 import x\n") == [
        "worker_cache.py:1 annotates 'dict[str, Any]'", "worker_cache.py:2 imports from vllm.v1"]
    assert typed_violations(cache, "import numpy as np\ndef f(a: np.ndarray) -> int:\n    return 1\n") == []
