"""Old public names kept as aliases that warn (docs/design.md, "Glossary").

A name the glossary retired stays usable for a release: reading it returns
the new object and raises a ``DeprecationWarning`` that names the new one.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # vattn/


def warn_deprecated(message: str) -> None:
    """A ``DeprecationWarning`` attributed to the first caller outside vattn:
    a user reaching a deprecated name through a wrapper (``vattn.init``, the
    engine, ``VAttnCache``) sees the line that used it, and Python's default
    filters, which show such warnings for ``__main__`` only, show it there."""
    frame, level = sys._getframe(1), 1  # level 1: the line that called this function
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE + os.sep):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level + 1)  # + 1: this function's own frame


def warn_renamed(old: str, new: str) -> None:
    """Warns that ``old`` is a deprecated name of ``new`` (see :func:`warn_deprecated`)."""
    warn_deprecated(f"{old} is deprecated; use {new} (the same thing under the glossary's word)")


def module_aliases(module: str, renamed: Mapping[str, str], lookup: Callable[[str], Any]) -> Callable[[str], Any]:
    """A PEP 562 ``__getattr__`` for ``module`` that answers each old name of
    ``renamed`` (old -> new) with ``lookup(new)`` and a warning, and raises
    ``AttributeError`` for anything else."""

    def __getattr__(name: str) -> Any:
        if name in renamed:
            warn_renamed(f"{module}.{name}", f"{module}.{renamed[name]}")
            return lookup(renamed[name])
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


class RenamedKeys(dict):
    """A dict whose retired keys still read, with a warning: ``d[old]`` is
    ``d[new]``. Iteration, ``in`` and ``get`` see the new keys only."""

    renamed: Mapping[str, str] = {}

    def __missing__(self, key: Any) -> Any:
        new = self.renamed.get(key)
        if new is None or new not in self:
            raise KeyError(key)
        warn_renamed(f"stats()[{key!r}]", f"stats()[{new!r}]")
        return self[new]


class Stats(RenamedKeys):
    """``KVCacheManager.stats()``: the counters under the glossary's words."""

    renamed = {"slots_allocated": "reqids_allocated", "page_slots_mapped": "page_mappings",
               "mapper_batches": "mapper_rounds"}
