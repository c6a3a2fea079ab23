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
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from vattn.common.errors import BudgetError

from .budget import Budget, BudgetMember, names, resolve_device

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
    that refused. :attr:`budget` is the devices' budgets as one (:class:`DeviceBudgets`)."""

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
        self.counters = dict(grants_undone=0)  # grants one device refused after others granted theirs

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

    def try_grant(self, nbytes: int, record_wait: bool = True) -> bool:
        """Grants ``nbytes`` when every device's budget grants its part; else grants nothing
        (the parts granted before the refusal are released again) and returns False."""
        parts = self.split(nbytes)
        granted: list[tuple[DeviceShare, int]] = []
        try:
            for share, part in zip(self.shares, parts):
                if not share.member.try_grant(part, record_wait):
                    self.refused = share
                    if granted:
                        self.counters["grants_undone"] += 1
                    self._undo(granted)
                    return False
                granted.append((share, part))
        except BaseException:
            self._undo(granted)
            raise
        self.refused = None
        return True

    @staticmethod
    def _undo(granted: list[tuple[DeviceShare, int]]) -> None:
        for share, part in granted:
            share.member.release(part)

    def release(self, nbytes: int) -> None:
        """Gives back ``nbytes`` (each device its part). A device whose budget raises does not keep
        the others from theirs; the first error is raised after."""
        self._each(lambda share, part: share.member.release(part), self.split(nbytes))

    def report(self, in_use_bytes: int, free_held_bytes: int) -> None:
        """Records the split of what is held, each device its part."""
        in_use, free = self.split(in_use_bytes), self.split(free_held_bytes)
        self._each(lambda share, part: share.member.report(*part), list(zip(in_use, free)))

    def _each(self, operation: Any, parts: Sequence[Any]) -> None:
        error: BaseException | None = None
        for share, part in zip(self.shares, parts):
            try:
                operation(share, part)
            except BudgetError as e:
                error = error or e
        if error is not None:
            raise error

    def pressure(self) -> int:
        """The bytes over every device to give back so that the device most asked gets its
        pressure (rounded up to whole units' worth)."""
        return max(-(-s.member.pressure() * self.unit_bytes // s.unit_bytes) for s in self.shares)

    def clear_wait(self) -> None:
        for share in self.shares:
            share.member.clear_wait()

    def wait_for_memory(self, timeout_s: float) -> bool:
        """Blocks on the budget of the device that refused the last grant (the first device when
        none did) until memory may have come free there, or ``timeout_s`` seconds."""
        return (self.refused or self.shares[0]).member.wait_for_memory(timeout_s)

    def leave(self) -> None:
        """Leaves every device's budget. Idempotent."""
        for share in self.shares:
            share.member.leave()

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
