"""Every skip reason in the suite names its kind first.

``pytest -rs`` then groups what a machine lacks at a glance, and the README
counts skips by the same kinds: "needs a CUDA GPU: ...", "long test: set
VATTN_LONG_TESTS=1 ...", "needs an AArch64 cross toolchain: ...", "needs the
vLLM environment: ...", "needs FlashAttention-2: ...", and so on: ``needs
<what>: <why or how>`` or ``long test: <how to run it>``.

Reasons are found in the sources: the argument of ``pytest.skip``, every
``reason=`` keyword (``skipif``, ``importorskip``; not ``xfail``'s), and the
strings returned by functions named ``*reason*`` (reasons computed once per
module); an ``importorskip`` without a reason gets pytest's, which names no kind.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
KIND = re.compile(r"(needs [^:]+|long test): ")


def leading_text(node: ast.AST) -> str | None:
    """A string literal or f-string ({} for each placeholder), or the start of a
    concatenation; None for anything computed."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):  # f"needs {what}: ..." reads as "needs {}: ..."
        return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # "a" "b" is one Constant; "a" + x is not
        return leading_text(node.left)
    return None


def reasons(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, ast.AST]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "xfail":  # an expected failure, not a skip
                continue
            if isinstance(func, ast.Attribute) and func.attr == "skip" and node.args:
                found.append((node.lineno, node.args[0]))
            found += [(kw.value.lineno, kw.value) for kw in node.keywords if kw.arg == "reason"]
            if isinstance(func, ast.Attribute) and func.attr == "importorskip" and \
                    not any(kw.arg == "reason" for kw in node.keywords):  # pytest's own reason names no kind
                found.append((node.lineno, ast.Constant("could not import ...")))
        elif isinstance(node, ast.FunctionDef) and "reason" in node.name:
            found += [(r.lineno, r.value) for r in ast.walk(node) if isinstance(r, ast.Return) and r.value]
    out = []
    for line, value in found:
        text = leading_text(value)
        if text is not None:
            out.append((line, text))
    return out


def test_every_skip_reason_names_its_kind():
    checked, wrong = 0, []
    for path in sorted(TESTS.rglob("*.py")):
        for line, text in reasons(ast.parse(path.read_text(), str(path))):
            checked += 1
            if not KIND.match(text):
                wrong.append(f"{path.relative_to(TESTS)}:{line}: {text!r}")
    assert checked >= 20  # the scan sees the suite's skips (about 30 today)
    assert not wrong, "skip reasons must start with 'needs <what>: ' or 'long test: ':\n" + "\n".join(wrong)


def test_the_check_tells_a_kind_from_a_bare_reason():
    tree = ast.parse('import pytest\npytest.skip("no compiler")\npytest.skip(f"needs a C compiler: {x}")\n'
                     'def gpu_reason():\n    return "long test: set VATTN_LONG_TESTS=1"\n'
                     'pytest.importorskip("x", reason=f"{x} is missing")\n'
                     '@pytest.mark.xfail(reason="a known defect")\ndef test_x(): pass\n'
                     'pytest.importorskip("y")\n')
    assert [bool(KIND.match(t)) for _, t in sorted(reasons(tree))] == [False, True, True, False, False]
