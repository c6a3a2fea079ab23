"""The kernels vattn knows and the one rule that picks one for a case.

:func:`select_kernel` is what :func:`vattn.attention.attention` (and so the
engine) and the vLLM integration call: for each device a preference order,
and the first kernel in it that serves the case wins. A caller states what
it needs (``batched``: no loop over requests in Python; ``installed``: the
kernel must load in this process) instead of naming a kernel.
"""

from __future__ import annotations

import functools

from .flash_attn import FlashAttentionKernel
from .flashinfer import FlashInferKernel, FlashInferSinglePrefillKernel
from .host import HostKernel
from .protocol import AttentionCase, Kernel
from .sdpa import SdpaKernel
from .torch_flash import TorchFlashKernel

HOST = HostKernel()
SDPA = SdpaKernel()
FLASH_ATTN = FlashAttentionKernel()
TORCH_FLASH = TorchFlashKernel()
FLASHINFER = FlashInferKernel()
FLASHINFER_REQUEST = FlashInferKernel(presentation="request")
FLASHINFER_SINGLE = FlashInferSinglePrefillKernel()

KERNELS: dict[str, Kernel] = {k.key: k for k in (HOST, SDPA, FLASH_ATTN, TORCH_FLASH, FLASHINFER, FLASHINFER_REQUEST,
                                                 FLASHINFER_SINGLE)}
"""Every kernel, by key."""

PREFERENCE: dict[str, tuple[Kernel, ...]] = {
    "cpu": (HOST, SDPA),
    "cuda": (FLASH_ATTN, TORCH_FLASH, SDPA),
}
"""Per device type, the kernels :func:`select_kernel` considers, best first.
On CUDA the flash-attn package first (paged: vLLM swaps in its own build of
the same call), then torch's own FlashAttention-2, which every CUDA build of
torch carries: one call per layer either way, where SDPA loops over requests
(on an H100, Llama-3-8B decode ran 1.2-50x slower that way, most at short
contexts and large batches: benchmarks/results/attention_ab_h100-80gb-hbm3.json).
FlashInfer is chosen by name only (``prefer="flashinfer"``): its batched
kernel has not been measured against FlashAttention on the vattn cache."""


class NoKernel(ValueError):
    """No kernel serves the case; ``reasons`` holds each candidate's reason
    (also the message, joined by "; ")."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons


def select_kernel(case: AttentionCase, *, batched: bool = False, installed: bool = True,
                  prefer: str | None = None) -> Kernel:
    """The kernel for ``case``: the first of ``PREFERENCE[case.device_type]``
    (or the kernel keyed ``prefer`` alone) that serves it.

    Args:
        case: the device, shapes, dtypes and options (unknown fields None).
        batched: consider only kernels that serve a whole batch without a
            loop over requests in Python (what a serving framework needs).
        installed: skip kernels that cannot be loaded in this process. False
            for a start-up check in a process that does not run the kernel
            (the caller loads it where it runs, :meth:`Kernel.available`).
        prefer: a key of :data:`KERNELS`: that kernel, if it serves the case.

    Raises :class:`NoKernel` (a ``ValueError``) with every candidate's reason.
    Decisions are cached per arguments.
    """
    return _select(case, batched, installed, prefer)


@functools.lru_cache(maxsize=256)
def _select(case: AttentionCase, batched: bool, installed: bool, prefer: str | None) -> Kernel:
    if prefer is not None:
        if prefer not in KERNELS:
            raise ValueError(f"prefer must be one of {sorted(KERNELS)}, got {prefer!r}")
        candidates: tuple[Kernel, ...] = (KERNELS[prefer],)
    else:
        candidates = PREFERENCE.get(case.device_type, ())
    if batched:
        candidates = tuple(k for k in candidates if k.batched)
    if not candidates:
        raise NoKernel([f"no{' batched' if batched else ''} attention kernel runs on "
                        f"{case.device_type.upper()} tensors" + (f" among {prefer!r}" if prefer else "")])
    reasons = []
    for kernel in candidates:
        ok, reason = kernel.supports(case)
        if ok and installed:
            ok, reason = kernel.available()
        if ok:
            return kernel
        reasons.append(reason)
    raise NoKernel(reasons)
