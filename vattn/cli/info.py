"""`python -m vattn info`: what this machine and build can do."""

from __future__ import annotations

import platform
from typing import Any

import torch

from vattn import _C
from vattn.common.version import VERSION as __version__
from vattn.backends import cuda_driver_path, registered_backends


def collect() -> dict[str, Any]:
    """Backends (every registered one: granularity, page sizes, memory), the
    host attention kernel and build facts as a dict."""
    backends: dict[str, dict[str, Any]] = {}
    for entry in registered_backends():  # each sees those before it (cuda_uvm reads cuda's)
        facts = entry.info(backends) if entry.info else {}
        backends[entry.name] = {**facts, "description": entry.description}
    from vattn.kernels.functions import host_attention_info

    return {
        "vattn": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.cuda.is_available(),
        "build": {**_C.build_info, "cuda_driver": f"dlopen at run time ({cuda_driver_path()})"},
        "backends": backends,
        "host_attention": host_attention_info(),
    }


def render(info: dict[str, Any]) -> str:
    build = info["build"]
    lines = [
        f"vattn {info['vattn']}  (python {info['python']}, torch {info['torch']}, "
        f"torch CUDA {'yes' if info['torch_cuda'] else 'no'})",
        # the compiler's __VERSION__: bare digits from GCC, "Clang ..." from clang
        f"extension: compiler {'GCC ' if build['compiler'][:1].isdigit() else ''}{build['compiler']}, "
        f"C++ {build['cplusplus']}, pybind11 {build['pybind11']}, "
        f"DLPack {build['dlpack_capsule']}; CUDA driver {build['cuda_driver']}",
    ]
    entries = {entry.name: entry for entry in registered_backends()}
    for name, facts in info["backends"].items():
        entry = entries.get(name)
        if entry is not None and entry.render is not None:
            lines.extend(entry.render(facts))
        else:
            lines.append(f"backend {name}: {facts['description']}")
    attn = info["host_attention"]
    lines.append(f"host attention kernel: {attn['isa']} path, {attn['threads']} threads, pool {attn['pool']} "
                 f"(CPU supports {', '.join(attn['supported'])}; built with {', '.join(attn['compiled'])})"
                 + (f"; {attn['note']}" if attn["note"] else ""))
    return "\n".join(lines)
