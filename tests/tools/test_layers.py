"""docs/design.md section 1 draws the layers; the tree must match it: every
folder of csrc/ and every module of vattn/ has a row, and includes and
imports only go down the stack (to the same row or rows above it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
COMPILED = {"_C", "_cpu_attn", "_testing"}  # the extension modules: below every Python row
ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]+)\|")


def layer_tables() -> tuple[dict[str, int], dict[str, int]]:
    """(C++ folder -> level, Python module or 'package/' -> level) from docs/design.md."""
    text = DESIGN.read_text()
    cpp_part, py_part = text.split("Python (`vattn/`", 1)
    py_part = py_part.split("\n## ", 1)[0]

    def rows(part: str) -> dict[str, int]:
        table = {}
        for line in part.splitlines():
            m = ROW.match(line)
            if m:
                for name in re.findall(r"`([^`]+)`", m.group(2)):
                    table[name] = int(m.group(1))
        return table

    return rows(cpp_part.split("## 1. Layers", 1)[1]), rows(py_part)


def python_unit(module: str) -> str:
    """'vattn.kernels.flashinfer' -> 'kernels/'; 'vattn.manager' -> 'manager'; 'vattn' -> '__init__'."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__"
    if (ROOT / "vattn" / parts[0]).is_dir():
        return parts[0] + "/"
    return parts[0]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def vattn_imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) for every import of a vattn module in ``path``
    (its text, or ``source`` as if it were there), at any depth: inside
    functions and TYPE_CHECKING blocks too."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
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
            if node.module is None or target == "vattn":  # from . import x: x may be a module
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    found.append((node.lineno, sub if python_unit(sub) in SUBMODULES else target))
            else:
                found.append((node.lineno, target))
    return found


CPP_LEVELS, PY_LEVELS = layer_tables()
SUBMODULES = {python_unit(module_name(p)) for p in (ROOT / "vattn").rglob("*.py")} | COMPILED


def test_the_tables_are_read():
    assert {"common", "backends", "core", "python"} <= CPP_LEVELS.keys()
    assert {"errors", "manager", "kernels/", "integrations/", "engine/"} <= PY_LEVELS.keys()
    assert CPP_LEVELS["common"] < CPP_LEVELS["backends"] < CPP_LEVELS["core"] < CPP_LEVELS["python"]
    assert PY_LEVELS["manager"] < PY_LEVELS["kernels/"] < PY_LEVELS["integrations/"] < PY_LEVELS["engine/"]


def test_every_folder_and_module_has_a_row():
    folders = {p.name for p in (ROOT / "csrc").iterdir() if p.is_dir()}
    assert folders - CPP_LEVELS.keys() == set(), "csrc folders missing from docs/design.md section 1"
    assert CPP_LEVELS.keys() - folders == set(), "docs/design.md names csrc folders that do not exist"
    units = SUBMODULES - COMPILED
    assert units - PY_LEVELS.keys() == set(), "vattn modules missing from docs/design.md section 1"
    assert PY_LEVELS.keys() - units == set(), "docs/design.md names vattn modules that do not exist"


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
    for path in sorted((ROOT / "vattn").rglob("*.py")):
        unit = python_unit(module_name(path))
        for line, target in vattn_imports(path):
            seen += 1
            to = python_unit(target)
            if to in COMPILED or to == unit or unit not in PY_LEVELS or to not in PY_LEVELS:
                continue  # a module without a row is reported by test_every_folder_and_module_has_a_row
            if PY_LEVELS[to] > PY_LEVELS[unit]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({unit}, level {PY_LEVELS[unit]}) imports "
                             f"{target} ({to}, level {PY_LEVELS[to]})")
    assert seen > 50  # the scan sees the package's imports
    assert not wrong, "imports must go down the layers of docs/design.md:\n" + "\n".join(wrong)


def test_the_check_catches_an_upward_import():
    """The scan resolves relative imports: kernels importing the engine is caught."""
    batch = ROOT / "vattn" / "kernels" / "batch.py"
    assert any(python_unit(t) == "spans" for _, t in vattn_imports(batch))  # from ..spans import ...
    probe = "from ..engine import Engine\nfrom .. import _C\nimport vattn.attention\n"
    targets = [t for _, t in vattn_imports(batch, probe)]
    assert targets == ["vattn.engine", "vattn._C", "vattn.attention"]
    assert all(PY_LEVELS[python_unit(t)] > PY_LEVELS["kernels/"] for t in ("vattn.engine", "vattn.attention"))
