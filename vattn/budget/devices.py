"""Budgets of several devices: one budget name, one segment per memory.

A budget governs one memory: the host's, or one GPU's (named by its UUID, so
that processes numbering GPUs differently through CUDA_VISIBLE_DEVICES
agree). An engine whose ranks lie on several GPUs (tensor or pipeline
parallel) is charged on each GPU's own budget. They share one name: the
budget ``NAME`` governs a device when ``NAME`` itself governs it (a budget
created for one device), else its per-device segment
``NAME.GPU-<last 12 hex digits of the UUID>`` does (:func:`device_budget_name`;
``python -m vattn budget create NAME --device cuda:0 --device cuda:1``
creates one per device). The segment records the whole UUID, so two UUIDs
that end alike are told apart with an error, never confused.

:class:`DeviceMember` is one member over several devices' budgets, with the
interface of :class:`~vattn.budget.budget.BudgetMember` (``try_grant``,
``release``, ``pressure``, ...) and a budget view
(:class:`DeviceBudgets`: ``limit``, ``held_bytes``, ``available_bytes``)
for callers that count in blocks: every amount is bytes over all devices
together, split among them in proportion to the bytes one block holds on
each (``unit_bytes``). A grant succeeds on every device or on none.

A device's budget whose lock another process holds past ``lock_timeout_s``
(:class:`~vattn.common.errors.BudgetLockTimeout`: stopped or stuck, the
budget sound) is, for a :class:`DeviceMember`, what it is for a cache's
member: a grant is refused, a release is kept and given back once the lock is
free, and the member does not leave. Its calls do not wait on that lock again
until :meth:`DeviceMember.recover` finds it free (or ``LOCK_RETRY_S`` have
passed): an engine's scheduler pays one ``lock_timeout_s``, not one per call.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from vattn.common.errors import BudgetError, BudgetLockTimeout

from .budget import Budget, BudgetMember, names, resolve_device

LOCK_RETRY_S = 1.0  # after a lock timeout: how long a device's lock is left alone unless recover() finds it free
SUFFIX_HEX_DIGITS = 12  # of a UUID in a per-device segment's name: the UUID's last group
_SUFFIX = re.compile(r"\.(GPU|MIG)-[0-9a-f]{%d}$" % SUFFIX_HEX_DIGITS)


def device_budget_name(name: str, device: str) -> str:
    """The name of budget ``name``'s segment for ``device`` (``"cpu"``, ``"cuda:N"`` or a
    UUID): ``name`` itself for the host, ``NAME.GPU-<last 12 hex digits of the UUID>`` for a
    GPU (``MIG-`` for a MIG instance). ValueError when the result is longer than a budget name
    may be (64 characters: ``name`` at most 47)."""
    uuid = resolve_device(device)
    if uuid == "cpu":
        return name
    digits = "".join(c for c in uuid[4:].lower() if c in "0123456789abcdef")
    if len(digits) < SUFFIX_HEX_DIGITS:
        raise ValueError(f"device {uuid!r} has fewer than {SUFFIX_HEX_DIGITS} hex digits to name a budget by")
    full = f"{name}.{uuid[:3]}-{digits[-SUFFIX_HEX_DIGITS:]}"
    if len(full) > 64:
        raise ValueError(f"budget name {name!r} is too long for a per-device budget: {full!r} has {len(full)} "
                         f"characters, at most 64 (a name of at most {64 - len(full) + len(name)})")
    return full


def family(name: str, existing: Iterable[str] | None = None) -> list[str]:
    """Budget ``name`` and its per-device segments among ``existing`` (the machine's budgets
    when None), sorted: what ``set``, ``rm`` and ``top`` act on for a name given."""
    existing = names() if existing is None else existing
    return sorted(n for n in existing if n == name or (n.startswith(name + ".") and
                                                        _SUFFIX.fullmatch(n[len(name):])))


def attach_for_device(name: str, device: str) -> Budget:
    """The budget named ``name`` that governs ``device`` (``"cpu"``, ``"cuda:N"`` or a UUID):
    ``name`` itself when it governs that device, else its segment for the device
    (:func:`device_budget_name`). Raises BudgetError when neither exists (saying how to create
    one), ValueError when the only one there governs another device."""
    uuid = resolve_device(device)
    if uuid == "cpu":
        budget = Budget.attach(name)  # BudgetError when there is none
        if budget.device != uuid:
            raise ValueError(f"budget '{name}' governs device {budget.device}, but this cache lives on cpu; "
                             f"create a budget for that device")
        return budget
    direct = Budget.attach(name) if name in names() else None
    if direct is not None and direct.device == uuid:
        return direct
    per_device = device_budget_name(name, uuid)
    try:
        budget = Budget.attach(per_device)
    except BudgetError:
        if per_device in names():
            raise
        where = f"budget '{name}' governs device {direct.device}" if direct is not None else f"no budget '{name}'"
        text = (f"{where}, and there is no budget '{per_device}' for device {uuid}; create one: python -m vattn "
                f"budget create {name} --limit SIZE --device {uuid} --per-device (or one per GPU at once: "
                f"--device cuda:0 --device cuda:1 ...)")
        if direct is not None:
            raise ValueError(text) from None
        raise BudgetError(text) from None
    if budget.device != uuid:
        raise ValueError(f"budget '{per_device}' governs device {budget.device}, not {uuid} (two UUIDs ending "
                         f"alike); create a budget of another name for one of them")
    return budget


def create_for_devices(name: str, limit_bytes: int, devices: Sequence[str], per_device: bool | None = None,
                       **options: Any) -> list[Budget]:
    """Creates budget ``name`` of ``limit_bytes`` bytes on each of ``devices`` (``"cpu"``,
    ``"cuda:N"`` or UUIDs), each device its own limit: one segment per device
    (:func:`device_budget_name`) when ``per_device`` (the default for several devices), else
    ``name`` itself for the one device. What was created is removed again when one creation
    fails. ``options``: those of :meth:`Budget.create`."""
    if not devices:
        raise ValueError("devices must name at least one device")
    resolved = [resolve_device(d) for d in devices]
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"devices name one device twice: {', '.join(resolved)}")
    per_device = len(resolved) > 1 if per_device is None else per_device
    if not per_device:
        if len(resolved) > 1:
            raise ValueError(f"one budget name without per-device segments governs one device, got {len(resolved)}")
        return [Budget.create(name, limit_bytes, resolved[0], **options)]
    if "cpu" in resolved:
        raise ValueError("per-device budgets are one per GPU; the host's is a budget of its own (--device cpu alone)")
    targets = [device_budget_name(name, uuid) for uuid in resolved]  # every name checked before any is created
    created: list[Budget] = []
    try:
        for target, uuid in zip(targets, resolved):
            created.append(Budget.create(target, limit_bytes, uuid, **options))
    except BaseException:
        for budget in created:
            budget.remove(force=True)
        raise
    return created


@dataclasses.dataclass(frozen=True)
class DeviceShare:
    """One device's part of a :class:`DeviceMember`."""

    budget: Budget  # the budget governing the device
    member: BudgetMember  # the membership there
    unit_bytes: int  # bytes one unit (a block id) holds on this device: every rank there together, > 0


class DeviceBudgets:
    """The budgets of a :class:`DeviceMember`'s devices as one, for a caller that counts in
    units (blocks) of ``unit_bytes`` bytes over every device: each figure is the tightest
    device's, scaled to bytes over every device, so ``figure // unit_bytes`` is whole units
    exactly as on the tightest device. With one device, that device's own figures."""

    def __init__(self, name: str, shares: Sequence[DeviceShare]) -> None:
        self.name = name
        self.shares = tuple(shares)
        self.unit_bytes = sum(s.unit_bytes for s in self.shares)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(s.budget.device for s in self.shares)

    @property
    def device(self) -> str:
        """The devices, comma-separated ("cpu", or GPU UUIDs)."""
        return ",".join(self.devices)

    def _scaled(self, nbytes: int, share: DeviceShare) -> int:
        return nbytes * self.unit_bytes // share.unit_bytes

    @property
    def limit(self) -> int:
        """Bytes over every device that whole units may take on every device's limit."""
        return min(self._scaled(s.budget.limit, s) for s in self.shares)

    @property
    def available_bytes(self) -> int:
        """Bytes over every device that a grant of whole units could get now (0 on a device above
        its limit)."""
        return min(self._scaled(s.budget.available_bytes, s) for s in self.shares)

    @property
    def held_bytes(self) -> int:
        """``limit`` plus the worst device's excess over its limit, scaled (rounded up): so
        ``ceil((held_bytes - limit) / unit_bytes)`` is the units the members hold above the
        limit on the device most over it, and ``held_bytes <= limit`` when none is."""
        excess = max(-(-(s.budget.held_bytes - s.budget.limit) * self.unit_bytes // s.unit_bytes)
                     for s in self.shares)
        return self.limit + excess

    def __repr__(self) -> str:
        return f"DeviceBudgets(name={self.name!r}, devices={self.devices})"


class DeviceMember:
    """One member over several devices' budgets (:class:`DeviceShare` each, in a fixed order),
    with :class:`~vattn.budget.budget.BudgetMember`'s interface. Amounts are bytes over every
    device; device ``d`` takes ``nbytes * unit_bytes_d / unit_bytes``, so with several devices
    an amount must be whole units (ValueError otherwise).

    A grant asks each device in turn; when one refuses, those granted before it are released
    again (nothing half-granted is left) and the refusal is recorded as a wait on the device
    that refused. :attr:`budget` is the devices' budgets as one (:class:`DeviceBudgets`).

    A device whose budget's lock timed out (``BudgetLockTimeout``) is *stalled*: grants are
    refused there, releases are kept (``unreturned_bytes``, still charged) and given back by
    the next call that finds the lock free, reports and ``clear_wait`` are skipped, and its
    ``pressure`` counts 0, each at once, without waiting on the lock again, until
    :meth:`recover` (the caller's keeper) finds it free, or for ``LOCK_RETRY_S`` seconds."""

    def __init__(self, name: str, shares: Sequence[DeviceShare]) -> None:
        if not shares:
            raise ValueError("shares must hold at least one device's")
        for share in shares:
            if isinstance(share.unit_bytes, bool) or not isinstance(share.unit_bytes, int) or share.unit_bytes <= 0:
                raise ValueError(f"unit_bytes of device {share.budget.device} must be an int > 0, "
                                 f"got {share.unit_bytes!r}")
        self.shares = tuple(shares)
        self.budget = DeviceBudgets(name, self.shares)
        self.unit_bytes = self.budget.unit_bytes
        self.refused: DeviceShare | None = None  # the device that refused the last grant
        # grants one device refused after others granted theirs; calls that met a stuck lock
        self.counters = dict(grants_undone=0, lock_timeouts=0)
        self.unreturned = [0] * len(self.shares)  # per device: bytes released while its lock was stuck
        self.stalled_until = [0.0] * len(self.shares)  # per device: monotonic time its lock is left alone till
        self._unreturned_lock = threading.Lock()  # the keeper's recover() and the caller's releases

    @property
    def label(self) -> str:
        return self.shares[0].member.label

    @property
    def held_bytes(self) -> int:
        """Bytes held over every device."""
        return sum(s.member.held_bytes for s in self.shares)

    def held_by_device(self) -> dict[str, int]:
        """Bytes held on each device, by device."""
        return {s.budget.device: s.member.held_bytes for s in self.shares}

    def split(self, nbytes: int) -> list[int]:
        """Each device's part of ``nbytes`` (bytes over every device)."""
        if len(self.shares) == 1:
            return [nbytes]
        units, rest = divmod(nbytes, self.unit_bytes)
        if rest:
            raise ValueError(f"nbytes must be whole units of {self.unit_bytes} bytes over "
                             f"{len(self.shares)} devices, got {nbytes}")
        return [units * s.unit_bytes for s in self.shares]

    @property
    def unreturned_bytes(self) -> int:
        """Bytes released while a device's lock was stuck, not given back yet (still charged)."""
        return sum(self.unreturned)

    @property
    def stalled(self) -> bool:
        """Whether a device's budget lock timed out and no call has found it free since."""
        return any(until > 0.0 for until in self.stalled_until)

    def _on_device(self, index: int, operation: Any, probe: bool = False) -> tuple[bool, Any]:
        """``(True, operation())`` on device ``index``; ``(False, None)`` when its budget's lock is
        stuck: it timed out now, or did before and ``probe`` is False and neither ``LOCK_RETRY_S``
        seconds nor a probe that found the lock free have passed since. Other errors are raised."""
        if not probe and time.monotonic() < self.stalled_until[index]:
            return False, None
        if probe or self.stalled_until[index]:
            self.stalled_until[index] = math.inf  # other threads' calls meanwhile do not wait on it too
        try:
            result = operation()
        except BudgetLockTimeout:
            self.stalled_until[index] = time.monotonic() + LOCK_RETRY_S
            self.counters["lock_timeouts"] += 1
            return False, None
        except BaseException:
            self.stalled_until[index] = 0.0
            raise
        self.stalled_until[index] = 0.0
        return True, result

    def try_grant(self, nbytes: int, record_wait: bool = True) -> bool:
        """Grants ``nbytes`` when every device's budget grants its part; else grants nothing
        (the parts granted before the refusal are released again) and returns False. A device
        whose lock is stuck refuses."""
        parts = self.split(nbytes)
        self._give_back()
        granted: list[tuple[int, int]] = []
        try:
            for index, (share, part) in enumerate(zip(self.shares, parts)):
                answered, ok = self._on_device(index, lambda: share.member.try_grant(part, record_wait))
                if not (answered and ok):
                    self.refused = share
                    if granted:
                        self.counters["grants_undone"] += 1
                    self._undo(granted)
                    return False
                granted.append((index, part))
        except BaseException:
            self._undo(granted)
            raise
        self.refused = None
        return True

    def _undo(self, granted: list[tuple[int, int]]) -> None:
        parts = [0] * len(self.shares)
        for index, part in granted:
            parts[index] = part
        self._owe(parts)

    def release(self, nbytes: int) -> None:
        """Gives back ``nbytes`` (each device its part). A device whose lock is stuck keeps its
        part (``unreturned_bytes``) until a later call finds the lock free. A device whose budget
        raises does not keep the others from theirs; the first error is raised after."""
        self._owe(self.split(nbytes))

    def _owe(self, parts: Sequence[int]) -> None:
        """Adds ``parts`` (bytes per device) to what each device is owed, and gives back all it can."""
        with self._unreturned_lock:
            for index, part in enumerate(parts):
                self.unreturned[index] += part
        self._give_back()

    def _give_back(self, probe: bool = False) -> None:
        """Releases what each device is owed (``unreturned``); a stuck lock keeps it owed."""
        if not any(self.unreturned):  # the common case: every grant asks, nothing is owed
            return

        def give(index: int, share: DeviceShare) -> None:
            with self._unreturned_lock:
                part, self.unreturned[index] = self.unreturned[index], 0
            if not part:
                return
            # an error (the budget removed or damaged) leaves nothing owed: there is nothing to give back to
            answered, _ = self._on_device(index, lambda: share.member.release(part), probe)
            if not answered:
                with self._unreturned_lock:
                    self.unreturned[index] += part

        self._each(give)

    def recover(self) -> None:
        """For the caller's keeper (its own thread): waits on each stalled device's lock, up to its
        ``lock_timeout_s``, giving back what that device is owed (or asking nothing of it, a
        probe); a device whose lock is free again is no longer stalled. Returns at once when no
        device is stalled or owed."""
        def ask_nothing(index: int, share: DeviceShare) -> None:
            if self.unreturned[index]:
                return  # the give-back just now timed out
            if self.stalled_until[index] and self.stalled_until[index] != math.inf:  # none under way elsewhere
                self._on_device(index, lambda: share.member.try_grant(0, False), probe=True)

        self._give_back(probe=True)
        self._each(ask_nothing)

    def report(self, in_use_bytes: int, free_held_bytes: int) -> bool:
        """Records the split of what is held, each device its part; False when a device's lock
        was stuck (its part not recorded: report again later)."""
        in_use, free = self.split(in_use_bytes), self.split(free_held_bytes)
        recorded = []

        def report(index: int, share: DeviceShare) -> None:
            answered, _ = self._on_device(index, lambda: share.member.report(in_use[index], free[index]))
            recorded.append(answered)

        self._each(report)
        return all(recorded)

    def _each(self, operation: Any) -> None:
        """``operation(index, share)`` for every device; one that raises ``BudgetError`` does not keep
        the others from theirs: the first error is raised after."""
        error: BaseException | None = None
        for index, share in enumerate(self.shares):
            try:
                operation(index, share)
            except BudgetError as e:
                error = error or e
        if error is not None:
            raise error

    def pressure(self) -> int:
        """The bytes over every device to give back so that the device most asked gets its
        pressure (rounded up to whole units' worth); a device whose lock is stuck counts 0."""
        asked = [self._on_device(i, s.member.pressure) for i, s in enumerate(self.shares)]
        return max(-(-(bytes_ if answered else 0) * self.unit_bytes // s.unit_bytes)
                   for (answered, bytes_), s in zip(asked, self.shares))

    def clear_wait(self) -> None:
        """Clears the wait on every device (skipped on one whose lock is stuck: it expires there)."""
        self._each(lambda index, share: self._on_device(index, share.member.clear_wait))

    def wait_for_memory(self, timeout_s: float) -> bool:
        """Blocks on the budget of the device that refused the last grant (the first device when
        none did) until memory may have come free there, or ``timeout_s`` seconds."""
        return (self.refused or self.shares[0]).member.wait_for_memory(timeout_s)

    def leave(self) -> None:
        """Leaves every device's budget (with its entry goes all it holds, owed releases too; a
        device whose lock is stuck frees the entry at its next sweep). Idempotent."""
        for share in self.shares:
            share.member.leave()
        with self._unreturned_lock:
            self.unreturned = [0] * len(self.shares)

    close = leave

    def __repr__(self) -> str:
        return f"DeviceMember(label={self.label!r}, held_by_device={self.held_by_device()})"


def join_devices(name: str, unit_bytes: Mapping[str, int], label: str) -> DeviceMember:
    """Joins budget ``name`` on every device of ``unit_bytes`` (device -> bytes one unit holds
    there, every rank on it together) as ``label``, each device's budget found by
    :func:`attach_for_device`. Nothing stays joined when one device's cannot be."""
    shares: list[DeviceShare] = []
    try:
        for device, nbytes in sorted(unit_bytes.items()):
            budget = attach_for_device(name, device)
            shares.append(DeviceShare(budget, budget.join(label), nbytes))
        return DeviceMember(name, shares)
    except BaseException:
        for share in shares:
            share.member.leave()
        raise
