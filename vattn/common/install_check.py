"""What ``import vattn`` needs that ``pip install`` does not guarantee: torch,
and the compiled extension ``vattn._C``.

torch is deliberately not a dependency (pip must not swap a CUDA build of torch
for a CPU one), and a source checkout has no ``vattn._C`` until it is built.
Without this check either case surfaces as a message that points elsewhere
("No module named 'torch'" from deep inside the package, or a "circular
import" of ``_C``); these say what is missing and what to run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

TORCH_MISSING = (
    "vattn needs torch, and does not install it itself (so that pip never replaces a CUDA build of torch "
    "with another one): install torch first (see README), e.g. `pip install torch`, then `import vattn` again"
)


def extension_missing(package_dir: Path) -> str:
    """The message for a source tree whose ``vattn._C`` was never built."""
    return (
        f"vattn's C++ extension vattn._C is not built: there is no _C*.so in {package_dir}. Build it from the "
        "repository root: `pip install -e .` (after installing torch, see README), or in place with "
        "`python setup.py build_ext --inplace` (needs a C++17 compiler and pybind11)"
    )


def check_torch() -> None:
    """Raises ModuleNotFoundError saying "install torch first" when torch is absent.

    Looks for torch without importing it (seconds): ``import vattn`` leaves
    torch to the modules that use it, so the budget commands start without it.
    A torch that is there but fails to import raises its own error there."""
    try:
        found = importlib.util.find_spec("torch") is not None
    except ModuleNotFoundError as e:  # an import hook that refuses torch
        if e.name != "torch":
            raise
        found = False
    if not found:
        raise ModuleNotFoundError(TORCH_MISSING, name="torch")


def check_extension() -> None:
    """Raises ImportError saying how to build ``vattn._C`` when it is absent."""
    if importlib.util.find_spec("vattn._C") is None:
        raise ImportError(extension_missing(Path(__file__).resolve().parents[1]), name="vattn._C")  # vattn/
