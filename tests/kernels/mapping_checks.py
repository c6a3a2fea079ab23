"""Counts the mapping checks a forward makes (tests' helper)."""

from __future__ import annotations

import pytest

from vattn.core import mapped_check


def count_mapping_checks(monkeypatch: pytest.MonkeyPatch) -> tuple[list, list]:
    """``(made, lookups)``, filled while the test runs: every check of the
    core's built (:class:`MappedCheck`) and every view looked up by address
    (its ``what``). Counted, not refused: a failure's report must not show
    a cache view, whose unmapped rows cannot be printed."""
    made: list = []
    lookups: list = []
    view_owner = mapped_check.view_owner

    class CountedCheck(mapped_check.MappedCheck):
        def __init__(self, *args, **kwargs) -> None:
            made.append(self)
            super().__init__(*args, **kwargs)

    def counted_owner(view, what):
        lookups.append(what)
        return view_owner(view, what)

    monkeypatch.setattr(mapped_check, "view_owner", counted_owner)
    monkeypatch.setattr(mapped_check, "MappedCheck", CountedCheck)
    return made, lookups
