"""Machine-wide memory budgets: one limit shared by KV cache managers in many processes.

A budget is a named limit in bytes for one device (host memory, or one GPU by
UUID), kept in POSIX shared memory (``/dev/shm/vattn-budget-NAME``) so that
every process on the machine sees the same account. Each member (one KV cache
manager) holds a share: ``try_grant`` before it creates physical pages,
``release`` after it releases them, ``report`` the split of what it holds.
The sum of the live members' shares never exceeds the limit; a process that
dies (SIGKILL included) gives its share back at the next operation of any
process that needs it. See docs/elastic.md.

    >>> import vattn
    >>> budget = vattn.Budget.create("llm", 4 << 30)            # 4 GiB of host memory
    >>> member = budget.join("engine-a")
    >>> member.try_grant(256 << 20)                            # 256 MiB
    True
    >>> budget.usage().processes[0].held_bytes
    268435456
    >>> member.leave(); budget.remove()

A :class:`vattn.KVCacheManager` joins with ``budget=`` (a budget or its
name) or the ``VATTN_BUDGET`` environment variable, and then does all of
this itself (vattn/budget/membership.py, csrc/core/page_budget.h). This module
is the budget, the member API, and what the command line
(``python -m vattn budget``, ``python -m vattn top``) uses.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

from vattn import _C
from vattn.common.errors import BackendUnavailable, BudgetError, DriverError

__all__ = [
    "Budget",
    "BudgetMember",
    "BudgetUsage",
    "MemberUsage",
    "ProcessUsage",
    "BudgetError",
    "names",
    "remove",
    "remove_leftovers",
    "resolve_device",
]

DEFAULT_MAX_MEMBERS = 64  # members (managers) a budget has room for
MAX_MEMBERS_CAP = 4096
MAX_BYTES = 2**64 - 1
DEFAULT_LOCK_TIMEOUT_S = 10.0  # seconds an operation waits for the budget's lock before raising


@dataclasses.dataclass(frozen=True)
class MemberUsage:
    """One member (one KV cache manager) of a budget. Bytes throughout."""

    id: int  # unique within the budget's lifetime
    pid: int
    label: str  # what the member is, as it joined ("vllm:llama-8b", ...)
    held_bytes: int  # granted and not released
    in_use_bytes: int  # of held: under requests (as last reported)
    free_held_bytes: int  # of held: free pages kept for reuse (as last reported)
    waiting_bytes: int  # a refused grant it is waiting for; 0 if none
    waiting_seconds: float  # how long it has waited; 0.0 if not waiting
    joined_unix_seconds: float


@dataclasses.dataclass(frozen=True)
class ProcessUsage:
    """The members of one process, added up. Bytes throughout."""

    pid: int
    managers: tuple[str, ...]  # the labels of its members
    held_bytes: int
    in_use_bytes: int
    free_held_bytes: int
    waiting_bytes: int


@dataclasses.dataclass(frozen=True)
class BudgetUsage:
    """A consistent snapshot of a budget (taken under its lock). Bytes throughout."""

    name: str
    device: str  # "cpu" or a GPU UUID ("GPU-...")
    limit_bytes: int
    held_bytes: int  # sum over members; at most limit_bytes unless the limit was lowered below it
    in_use_bytes: int
    free_held_bytes: int
    waiting_bytes: int  # sum of the members' waits
    max_members: int
    created_unix_seconds: float
    members: tuple[MemberUsage, ...]  # by pid, then id

    @property
    def available_bytes(self) -> int:
        """Bytes a grant could get now (0 when the total sits above a lowered limit)."""
        return max(0, self.limit_bytes - self.held_bytes)

    @property
    def processes(self) -> tuple[ProcessUsage, ...]:
        """The members grouped by process, by pid."""
        by_pid: dict[int, list[MemberUsage]] = {}
        for m in self.members:
            by_pid.setdefault(m.pid, []).append(m)
        return tuple(
            ProcessUsage(
                pid=pid,
                managers=tuple(m.label for m in ms),
                held_bytes=sum(m.held_bytes for m in ms),
                in_use_bytes=sum(m.in_use_bytes for m in ms),
                free_held_bytes=sum(m.free_held_bytes for m in ms),
                waiting_bytes=sum(m.waiting_bytes for m in ms),
            )
            for pid, ms in sorted(by_pid.items())
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON: every field, ``available_bytes`` and ``processes``."""
        d = dataclasses.asdict(self)
        d["members"] = [dataclasses.asdict(m) for m in self.members]
        d["available_bytes"] = self.available_bytes
        d["processes"] = [dataclasses.asdict(p) | {"managers": list(p.managers)} for p in self.processes]
        return d


def _check_bytes(value: Any, what: str, minimum: int = 0, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int of bytes, got {type(value).__name__}")
    if not minimum <= value <= MAX_BYTES:
        raise ValueError(f"{what} must be in [{minimum}, 2**64 - 1] bytes, got {value}{why}")
    return value


def _check_timeout(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"lock_timeout_s must be a number of seconds, got {type(value).__name__}")
    if not 0 < value <= 3600:
        raise ValueError(f"lock_timeout_s must be in (0, 3600] seconds, got {value}")
    return float(value)


def _check_str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    return value


def _cuda_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"),
    asked of the driver library vattn uses (VATTN_CUDA_DRIVER_LIB or libcuda.so.1)."""
    path = _C.backend_probe("cuda", "driver_path")["driver_path"]
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise BackendUnavailable(
            f"device 'cuda:{index}': cannot load the CUDA driver {path} ({e}); name the GPU by its UUID "
            f"instead (nvidia-smi -L), e.g. device='GPU-...'") from None

    def check(call: str, rc: int) -> None:
        if rc != 0:
            raise DriverError(f"device 'cuda:{index}': {call} failed: CUresult {rc}", call, f"CUresult {rc}")

    check("cuInit", lib.cuInit(0))
    count = ctypes.c_int(0)
    check("cuDeviceGetCount", lib.cuDeviceGetCount(ctypes.byref(count)))
    if not 0 <= index < count.value:
        raise ValueError(f"device 'cuda:{index}': this machine has {count.value} CUDA device(s)")
    dev = ctypes.c_int(0)
    check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), index))
    raw = (ctypes.c_ubyte * 16)()
    get_uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid  # v2: a MIG instance's own UUID
    check("cuDeviceGetUuid", get_uuid(raw, dev))
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def resolve_device(device: Any) -> str:
    """The device string a budget records: ``"cpu"``, or a GPU's UUID for
    ``"cuda"`` / ``"cuda:N"`` / a ``torch.device`` (so that processes that
    number GPUs differently, through CUDA_VISIBLE_DEVICES, agree). A UUID
    (``"GPU-..."``, ``"MIG-..."``) passes through.

    Raises ValueError for another string, BackendUnavailable when no CUDA
    driver can name the GPU.
    """
    text = str(device)  # a torch.device prints as "cpu" / "cuda:0"
    if text == "cpu":
        return "cpu"
    if text.startswith(("GPU-", "MIG-")):
        return text
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        return _cuda_uuid(int(text[5:]) if text != "cuda" else 0)
    raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or a GPU UUID ('GPU-...'), got {device!r}")


class BudgetMember:
    """One KV cache manager's share of a budget (from :meth:`Budget.join`).

    The protocol: :meth:`try_grant` before creating physical pages,
    :meth:`release` after releasing them, :meth:`report` the split after each
    change, :meth:`pressure` polled to learn how much free memory to give
    back. Every method is thread-safe. A member leaves when closed, when
    garbage-collected, or when its process exits.
    """

    def __init__(self, member: Any):
        self._member = member

    @property
    def label(self) -> str:
        return self._member.label

    @property
    def id(self) -> int:
        """Unique within the budget's lifetime."""
        return self._member.id

    @property
    def held_bytes(self) -> int:
        """Bytes granted to this member and not released (0 once it left)."""
        return self._member.held_bytes

    def try_grant(self, nbytes: int, record_wait: bool = True) -> bool:
        """Grants ``nbytes`` (bytes) if the budget's total stays within its limit.

        On refusal returns False and records that this member waits for
        ``nbytes``: other members see it as :meth:`pressure` until this member
        is granted, calls :meth:`clear_wait`, or stops asking for a second.
        ``record_wait=False``: an ask ahead of need (a manager's mapper), whose
        refusal makes nobody give memory back.
        """
        if not isinstance(record_wait, bool):
            raise TypeError(f"record_wait must be a bool, got {type(record_wait).__name__}")
        return self._member.try_grant(_check_bytes(nbytes, "nbytes"), record_wait)

    def release(self, nbytes: int) -> None:
        """Gives back ``nbytes`` (bytes) of what this member holds (ValueError above it)."""
        self._member.release(_check_bytes(nbytes, "nbytes"))

    def report(self, in_use_bytes: int, free_held_bytes: int) -> None:
        """Records the split of what this member holds: bytes under requests and
        free bytes kept for reuse (ValueError if they add up to more than
        :attr:`held_bytes`). Shown by ``python -m vattn top``."""
        self._member.report(_check_bytes(in_use_bytes, "in_use_bytes"), _check_bytes(free_held_bytes, "free_held_bytes"))

    def pressure(self) -> int:
        """Bytes a member holding free pages should give back now: what other
        members wait for plus how far the total is above a lowered limit,
        beyond what is still free within the limit. A lock-free read when 0."""
        return self._member.pressure()

    def clear_wait(self) -> None:
        """This member no longer waits (its caller gave up on the refused grant)."""
        self._member.clear_wait()

    def wait_for_memory(self, timeout_s: float) -> bool:
        """After a refused :meth:`try_grant`: blocks until memory may have come
        free in the budget (a member released or left, the limit changed) or
        ``timeout_s`` seconds (0-3600) pass; True when something changed. Costs
        no CPU while it waits (a futex in the segment). Ask again within a
        second for the wait to keep counting as pressure on the others."""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise TypeError(f"timeout_s must be a number of seconds, got {type(timeout_s).__name__}")
        if not 0 <= timeout_s <= 3600:
            raise ValueError(f"timeout_s must be in [0, 3600] seconds, got {timeout_s}")
        return self._member.wait_for_memory(float(timeout_s))

    def leave(self) -> None:
        """Leaves the budget, giving back everything it holds. Idempotent."""
        self._member.leave()

    close = leave

    def __enter__(self) -> BudgetMember:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.leave()

    def __repr__(self) -> str:
        return f"BudgetMember(label={self.label!r}, held_bytes={self.held_bytes})"


class Budget:
    """A named, machine-wide memory budget for one device, in shared memory.

    Create one with :meth:`create` (or ``python -m vattn budget create``),
    open it in any process with :meth:`attach`. A budget outlives the
    processes that use it until :meth:`remove`; one whose members all died is
    reusable as is.
    """

    def __init__(self, handle: Any):
        self._b = handle

    @classmethod
    def create(cls, name: str, limit_bytes: int, device: Any = "cpu", max_members: int = DEFAULT_MAX_MEMBERS,
               lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> Budget:
        """Creates budget ``name`` with a limit of ``limit_bytes`` bytes for
        ``device`` (``"cpu"``, ``"cuda:N"`` or a GPU UUID, see
        :func:`resolve_device`), with room for ``max_members`` members.

        ``name``: 1-64 characters of A-Z a-z 0-9 . _ - (ValueError otherwise).
        ``limit_bytes``: at least 1 (a budget of 0 bytes grants nothing; a
        live budget's limit may be set to 0 with :meth:`set_limit`).
        ``lock_timeout_s``: see :meth:`attach`.
        Raises BudgetError if a budget of that name exists. Removes what
        creators killed half-way left behind (:func:`remove_leftovers`).
        """
        _check_str(name, "name")
        _check_bytes(limit_bytes, "limit_bytes", 1, ": a budget of 0 bytes grants nothing")
        if isinstance(max_members, bool) or not isinstance(max_members, int):
            raise TypeError(f"max_members must be an int, got {type(max_members).__name__}")
        if not 1 <= max_members <= MAX_MEMBERS_CAP:
            raise ValueError(f"max_members must be in [1, {MAX_MEMBERS_CAP}], got {max_members}")
        return cls(_C.Budget.create(name, limit_bytes, resolve_device(device), max_members,
                                    _check_timeout(lock_timeout_s)))

    @classmethod
    def attach(cls, name: str, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> Budget:
        """Opens the existing budget ``name``. Raises BudgetError when there is
        none, or it is corrupt or of another format version, or its segment is
        owned by another user or open to other users (mode wider than 0600:
        whoever can write it can take every member's memory away).

        Operations hold the budget's lock for microseconds; one that waits
        more than ``lock_timeout_s`` seconds for it raises BudgetLockTimeout (a
        BudgetError) naming the holder's pid (a stopped or stuck process)
        instead of hanging; it did nothing and may be made again.
        """
        return cls(_C.Budget.attach(_check_str(name, "name"), _check_timeout(lock_timeout_s)))

    @property
    def name(self) -> str:
        return self._b.name

    @property
    def device(self) -> str:
        """``"cpu"`` or the GPU's UUID."""
        return self._b.device

    @property
    def limit(self) -> int:
        """The limit in bytes (read without the lock). BudgetError once the
        segment was truncated or overwritten under this process."""
        return self._b.limit_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes the members hold together (read without the lock)."""
        return self._b.held_bytes

    @property
    def available_bytes(self) -> int:
        """Bytes a grant could get now, 0 above a lowered limit (read without the lock)."""
        return self._b.available_bytes

    @property
    def max_members(self) -> int:
        return self._b.max_members

    def set_limit(self, limit_bytes: int) -> None:
        """Sets the limit to ``limit_bytes`` bytes, live. Below what members hold,
        grants are refused and members' :meth:`BudgetMember.pressure` is
        positive until they have released enough; nothing is taken from them."""
        self._b.set_limit(_check_bytes(limit_bytes, "limit_bytes"))

    def usage(self) -> BudgetUsage:
        """A snapshot: the limit, the totals, every member and (``.processes``) every process."""
        d = self._b.usage()
        members = tuple(MemberUsage(**m) for m in d.pop("members"))
        return BudgetUsage(members=members, **d)

    def join(self, label: str) -> BudgetMember:
        """Adds a member labelled ``label`` (1-47 printable ASCII characters,
        shown by ``top``). Raises BudgetError when the member table is full."""
        return BudgetMember(self._b.join(_check_str(label, "label")))

    def remove(self, force: bool = False) -> int:
        """Removes this budget from the machine (see :func:`remove`); returns
        how many live members it had."""
        return remove(self.name, force)

    def __repr__(self) -> str:
        return f"Budget(name={self.name!r}, device={self.device!r}, limit={self.limit})"


def remove(name: str, force: bool = False) -> int:
    """Removes budget ``name`` (``python -m vattn budget rm NAME``); returns
    how many live members it had. Works on a corrupt one too.

    Raises BudgetError when there is none, and (changing nothing) while it
    has live members unless ``force``: they would go on charging a segment
    nobody else sees. With ``force`` the budget is first marked removed, so
    its members are refused new memory with a BudgetError saying so (a KV
    cache manager keeps what it holds, its ``step`` raises when it needs new
    pages), then it is unlinked.
    """
    if not isinstance(force, bool):
        raise TypeError(f"force must be a bool, got {type(force).__name__}")
    return _C.Budget.remove(_check_str(name, "name"), force)


def remove_leftovers() -> list[str]:
    """Removes the staging files of budget creators that died half-way
    (killed during :meth:`Budget.create`), only those whose creator is gone;
    returns their file names in /dev/shm. ``python -m vattn budget ls`` and
    :meth:`Budget.create` call it."""
    return list(_C.Budget.remove_leftovers())


def names() -> list[str]:
    """The names of the budgets on this machine, sorted."""
    return list(_C.Budget.names())
