"""Exceptions raised by vattn.

Bad arguments raise plain :class:`ValueError` (or :class:`TypeError` for a wrong
type); everything else raised by vattn subclasses :class:`VAttnError`, itself a
:class:`RuntimeError`.
"""

from __future__ import annotations

from .deprecation import module_aliases


class VAttnError(RuntimeError):
    """Base class of vattn's own errors."""


class DriverError(VAttnError):
    """A driver or OS call failed (``cuMemMap``, ``mmap``, ...).

    Attributes:
        call: name of the failing call.
        detail: the CUresult name or errno text.
    """

    def __init__(self, message: str, call: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.call = call
        self.detail = detail


class BackendUnavailable(VAttnError):
    """The requested backend cannot run on this machine (no CUDA driver or device)."""


class OutOfReqids(VAttnError):
    """``alloc_reqid`` found all ``max_batch_size`` reqids in use."""


class ClosedError(VAttnError):
    """The manager was cleaned up (or never initialised) and cannot be used."""


class OutOfPages(VAttnError, MemoryError):
    """The physical page pool cannot hold the lengths asked for, or no page
    can be created now (a memory budget refuses it, the device or host is out
    of memory).

    ``step`` itself returns False in that case, so an engine can preempt; this
    is raised by ``fork``, ``map_pages``, a manager created with
    ``preallocate=True``, and integrations that have no one to preempt (a
    transformers cache). Nothing changed when it is raised.
    """


class ForkedError(ClosedError):
    """A manager inherited through ``fork()``: it belongs to the parent process.

    In the child every call raises this and the cache's address range is
    inaccessible (touching a view faults), so the child can never change the
    parent's pages. Create a new manager in the child instead.
    """


class BudgetError(VAttnError):
    """A memory budget (:class:`vattn.Budget`) cannot be used as asked.

    Raised when a budget name does not exist (or already exists, on create),
    when its shared-memory segment is corrupt or of another format version,
    when its member table is full, or when a member was dropped from it. The
    message names the budget, what is wrong and what to do (often
    ``python -m vattn budget rm NAME`` and creating it again).
    """


class BudgetLockTimeout(BudgetError):
    """The budget's lock was held longer than ``lock_timeout_s`` by another process
    (stopped or stuck; the message names its pid).

    The budget itself is sound and the call did nothing: it can be made again
    once that process goes on or ends. vattn's own members take it for a
    refusal, never for a reason to leave the budget: a cache's step answers
    False as at the limit, and releases are given back once the lock is free.
    """


# OutOfSlots: the name before the glossary's (docs/design.md); reading it warns.
__getattr__ = module_aliases(__name__, {"OutOfSlots": "OutOfReqids"}, lambda new: globals()[new])
