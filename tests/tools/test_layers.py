"""docs/design.md section 1 draws the layers; the tree must match it: every
folder of csrc/ and of vattn/ is a row, includes and imports only go down the
stack (to the same row or rows above it), and no Python modules form an
import cycle at run time."""

from __future__ import annotations

import ast
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
