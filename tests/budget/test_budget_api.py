"""The budget in one process: accounting, limits, waits and pressure, bad
arguments, names, corrupt segments, a full member table, device names."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import pytest
from budget_helpers import budget_name, patch_prefix, read_prefix, segment_path  # noqa: F401 (fixture)

import vattn
from vattn.budget import budget as vbudget

MiB = 1 << 20


def test_create_attach_and_account(budget_name):
    b = vattn.Budget.create(budget_name, 10 * MiB)
    assert (b.name, b.device, b.limit, b.max_members) == (budget_name, "cpu", 10 * MiB, 64)
    assert budget_name in vbudget.names()
    other = vattn.Budget.attach(budget_name)  # a second mapping, as another process would have
    a, c = b.join("engine-a"), other.join("engine-c")
    assert a.try_grant(6 * MiB) and c.try_grant(4 * MiB)
    assert not a.try_grant(1)  # exactly at the limit
    assert (a.held_bytes, c.held_bytes, b.held_bytes) == (6 * MiB, 4 * MiB, 10 * MiB)
    a.report(5 * MiB, 1 * MiB)
    u = other.usage()
    assert (u.limit_bytes, u.held_bytes, u.in_use_bytes, u.free_held_bytes) == (10 * MiB, 10 * MiB, 5 * MiB, 1 * MiB)
    assert u.available_bytes == 0
    assert [(m.label, m.pid, m.held_bytes) for m in u.members] == [
        ("engine-a", os.getpid(), 6 * MiB), ("engine-c", os.getpid(), 4 * MiB)]
    (p,) = u.processes
    assert (p.pid, p.managers, p.held_bytes, p.in_use_bytes, p.free_held_bytes) == (
        os.getpid(), ("engine-a", "engine-c"), 10 * MiB, 5 * MiB, 1 * MiB)
    # releasing comes out of the free part first until the next report
    a.release(2 * MiB)
    (ma, _) = b.usage().members
    assert (ma.held_bytes, ma.in_use_bytes, ma.free_held_bytes) == (4 * MiB, 4 * MiB, 0)
    assert c.try_grant(2 * MiB)
    c.leave()
    c.leave()  # idempotent
    assert c.held_bytes == 0
    assert b.usage().held_bytes == 4 * MiB
    with pytest.raises(vattn.BudgetError, match="no longer in the budget"):
        c.try_grant(1)
    d = b.usage().to_dict()
    assert d["processes"][0]["managers"] == ["engine-a"] and d["members"][0]["label"] == "engine-a"


def test_threads_of_one_process_share_the_limit(budget_name):
    limit = 10 * MiB
    b = vattn.Budget.create(budget_name, limit)
    held: dict[int, int] = {}
    exceeded: list[int] = []

    def work(seed: int) -> None:
        m, rng, mine = b.join(f"thread-{seed}"), random.Random(seed), 0
        for _ in range(1500):  # the calls release the GIL: the threads really contend for the lock
            if mine and rng.random() < 0.45:
                n = rng.randint(1, mine)
                m.release(n)
                mine -= n
            elif m.try_grant(n := rng.randint(1, limit // 3)):
                mine += n
                if b.usage().held_bytes > limit:
                    exceeded.append(seed)
        held[m.id] = mine
        threads_done.wait()  # keep the member until all are counted

    threads_done = threading.Barrier(5)
    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(held) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    u = b.usage()
    threads_done.wait()
    for t in threads:
        t.join()
    assert not exceeded
    assert {m.id: m.held_bytes for m in u.members} == held and u.held_bytes == sum(held.values()) <= limit
    assert b.available_bytes == limit  # the members left when their threads ended


def test_bad_amounts_leave_the_state_unchanged(budget_name):
    b = vattn.Budget.create(budget_name, 10 * MiB)
    m = b.join("m")
    assert m.try_grant(3 * MiB)
    with pytest.raises(ValueError, match="exceed the 3145728 bytes"):
        m.release(3 * MiB + 1)
    with pytest.raises(ValueError, match="exceed the 3145728 bytes"):
        m.report(2 * MiB, 1 * MiB + 1)
    with pytest.raises(ValueError, match="nbytes"):
        m.try_grant(-1)
    with pytest.raises(TypeError, match="nbytes"):
        m.try_grant(1.5)
    with pytest.raises(TypeError, match="nbytes"):
        m.release(True)
    with pytest.raises(ValueError, match="limit_bytes"):
        b.set_limit(2**64)
    assert m.held_bytes == 3 * MiB and b.limit == 10 * MiB
    assert m.try_grant(0)


def test_a_speculative_ask_records_no_wait(budget_name):
    b = vattn.Budget.create(budget_name, 4 * MiB)
    holder, asker = b.join("holder"), b.join("asker")
    assert holder.try_grant(3 * MiB)
    assert not asker.try_grant(2 * MiB, record_wait=False)  # ahead of need: nobody should give back for it
    assert b.usage().waiting_bytes == 0 and holder.pressure() == 0
    assert asker.try_grant(MiB, record_wait=False)


def test_a_refused_grant_waits_and_others_see_pressure(budget_name):
    b = vattn.Budget.create(budget_name, 10 * MiB)
    holder, asker = b.join("holder"), b.join("asker")
    assert holder.try_grant(8 * MiB)
    holder.report(5 * MiB, 3 * MiB)
    assert holder.pressure() == 0 and asker.pressure() == 0
    assert not asker.try_grant(4 * MiB)
    (mh, ma) = b.usage().members
    assert (ma.waiting_bytes, mh.waiting_bytes) == (4 * MiB, 0) and ma.waiting_seconds >= 0
    assert b.usage().waiting_bytes == 4 * MiB
    # the holder should give back what the asker lacks (2 MiB are free within the limit)
    assert holder.pressure() == 2 * MiB
    assert asker.pressure() == 0  # its own wait is not pressure on itself
    holder.release(2 * MiB)
    assert holder.pressure() == 0
    assert asker.try_grant(4 * MiB)  # granted: no longer waiting
    assert b.usage().waiting_bytes == 0
    # a wait ends when cleared, or when not renewed for a second
    assert not asker.try_grant(1 * MiB)
    assert holder.pressure() == 1 * MiB
    asker.clear_wait()
    assert holder.pressure() == 0
    assert not asker.try_grant(1 * MiB)
    time.sleep(1.05)  # the wait expires a second after its last refusal
    assert holder.pressure() == 0 and b.usage().waiting_bytes == 0


def test_a_wait_counts_from_its_first_refusal(budget_name):
    """``waiting_seconds`` (top's "for"): an ask ahead of need granted in between does not restart a
    wait that goes on; a grant of what was waited for or a cleared wait ends it."""
    b = vattn.Budget.create(budget_name, 4 * MiB)
    holder, asker = b.join("holder"), b.join("asker")
    assert holder.try_grant(3 * MiB)

    def waited() -> float:
        (m,) = [m for m in b.usage().members if m.label == "asker"]
        return m.waiting_seconds

    assert not asker.try_grant(2 * MiB)
    time.sleep(0.3)
    assert asker.try_grant(MiB // 2, record_wait=False)  # ahead of need: fits, the wait goes on
    assert not asker.try_grant(2 * MiB)
    assert waited() >= 0.3
    asker.release(MiB // 2)
    assert not asker.try_grant(2 * MiB, record_wait=False)
    assert waited() >= 0.3
    holder.release(MiB)
    assert asker.try_grant(2 * MiB)  # what it waited for: the wait ended
    assert not asker.try_grant(MiB)
    assert waited() < 0.2
    time.sleep(0.3)
    asker.clear_wait()  # given up: the next refusal is a new wait
    assert not asker.try_grant(MiB)
    assert waited() < 0.2


def test_lowering_the_limit_below_use_refuses_and_makes_pressure(budget_name):
    b = vattn.Budget.create(budget_name, 10 * MiB)
    m, n = b.join("m"), b.join("n")
    assert m.try_grant(6 * MiB) and n.try_grant(2 * MiB)
    b.set_limit(5 * MiB)
    assert b.limit == 5 * MiB
    assert m.pressure() == 3 * MiB and n.pressure() == 3 * MiB  # the total is 3 MiB above the limit
    assert not n.try_grant(1)  # nothing is granted while above the limit
    assert m.held_bytes == 6 * MiB  # nothing is taken
    u = b.usage()
    assert u.held_bytes == 8 * MiB and u.available_bytes == 0
    m.release(4 * MiB)
    assert m.pressure() == 0
    assert n.try_grant(1 * MiB) and not n.try_grant(1)
    b.set_limit(20 * MiB)
    assert n.try_grant(10 * MiB)


def test_names_are_checked(budget_name):
    for bad in ["", "a/b", ".hidden", "-x", "with space", "x" * 65, "ü", "a~b"]:
        with pytest.raises(ValueError, match="budget name"):
            vattn.Budget.create(bad, MiB)
        with pytest.raises(ValueError, match="budget name"):
            vattn.Budget.attach(bad)
        with pytest.raises(ValueError, match="budget name"):
            vbudget.remove(bad)
    with pytest.raises(TypeError, match="name"):
        vattn.Budget.attach(3)
    b = vattn.Budget.create(budget_name, MiB)
    for bad in ["", "x" * 48, "tab\there"]:
        with pytest.raises(ValueError, match="label"):
            b.join(bad)
    b.join("x" * 47).leave()


def test_missing_existing_and_removed_budgets(budget_name):
    with pytest.raises(vattn.BudgetError, match=rf"no budget '{budget_name}'.*budget create {budget_name}"):
        vattn.Budget.attach(budget_name)
    with pytest.raises(vattn.BudgetError, match="no budget .* to remove"):
        vbudget.remove(budget_name)
    b = vattn.Budget.create(budget_name, MiB)
    with pytest.raises(vattn.BudgetError, match=rf"'{budget_name}' already exists.*budget rm {budget_name}"):
        vattn.Budget.create(budget_name, 2 * MiB)
    assert vattn.Budget.attach(budget_name).limit == MiB  # the failed create changed nothing
    b.remove()
    assert budget_name not in vbudget.names()
    assert not list(segment_path(budget_name).parent.glob(f"vattn-budget-~{budget_name}~*"))  # no staging left


def test_create_arguments_are_checked(budget_name):
    with pytest.raises(ValueError, match="limit_bytes"):
        vattn.Budget.create(budget_name, -1)
    with pytest.raises(TypeError, match="limit_bytes"):
        vattn.Budget.create(budget_name, "4GiB")
    with pytest.raises(ValueError, match="max_members"):
        vattn.Budget.create(budget_name, MiB, max_members=0)
    with pytest.raises(ValueError, match="device"):
        vattn.Budget.create(budget_name, MiB, device="tpu")
    assert budget_name not in vbudget.names()
    assert vattn.Budget.create(budget_name, MiB, device="GPU-0123").device == "GPU-0123"


def test_a_full_member_table(budget_name):
    b = vattn.Budget.create(budget_name, MiB, max_members=2)
    first, _second = b.join("a"), b.join("b")
    with pytest.raises(vattn.BudgetError, match=rf"'{budget_name}': its member table is full \(2 live members\)"):
        b.join("c")
    first.leave()
    b.join("c")


def _corrupt_message(name: str) -> str:
    return rf"'{name}' .*is corrupt: .*budget rm {name}` and create it again"


@pytest.mark.parametrize("damage", ["empty", "garbage", "magic", "sizes", "members", "truncated", "entry"])
def test_corrupt_segments_give_clear_errors(budget_name, damage):
    vattn.Budget.create(budget_name, MiB, max_members=4)
    path = segment_path(budget_name)
    expected = {
        "empty": "only 0 bytes",
        "garbage": "bad magic",
        "magic": "bad magic",
        "sizes": "header/entry sizes",
        "members": "member table of 100000 entries",
        "truncated": "bytes, expected",
        "entry": "member entry 2 has state 7",
    }[damage]
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(os.urandom(4096))
    elif damage == "magic":
        patch_prefix(budget_name, magic=0x1234)
    elif damage == "sizes":
        patch_prefix(budget_name, entry_bytes=read_prefix(budget_name)[3] + 8)
    elif damage == "members":
        patch_prefix(budget_name, max_members=100000)
    elif damage == "truncated":
        os.truncate(path, path.stat().st_size - 1)
    else:  # a member entry whose state is neither free nor live
        _, _, header_bytes, entry_bytes, _ = read_prefix(budget_name)
        with open(path, "r+b") as f:
            f.seek(header_bytes + 2 * entry_bytes)
            f.write((7).to_bytes(4, "little"))
    with pytest.raises(vattn.BudgetError, match=_corrupt_message(budget_name)) as info:
        vattn.Budget.attach(budget_name).usage()
    assert expected in str(info.value)
    vbudget.remove(budget_name)  # a corrupt budget can be removed
    assert budget_name not in vbudget.names()


def test_another_format_version_is_named(budget_name):
    vattn.Budget.create(budget_name, MiB)
    patch_prefix(budget_name, version=7)
    with pytest.raises(vattn.BudgetError, match=rf"format version 7, this vattn reads version 2.*budget rm {budget_name}"):
        vattn.Budget.attach(budget_name)


def test_device_names(fake_cuda, budget_name):
    assert vbudget.resolve_device("cpu") == "cpu"
    assert vbudget.resolve_device("GPU-5d3c") == "GPU-5d3c"
    # the fake driver's UUID is the bytes "vattn-fake-gpu" and the ordinal, printed as nvidia-smi does
    h = (b"vattn-fake-gpu\x00\x00").hex()
    expected = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    assert vbudget.resolve_device("cuda:0") == expected == vbudget.resolve_device("cuda")
    with pytest.raises(ValueError, match="1 CUDA device"):
        vbudget.resolve_device("cuda:3")
    with pytest.raises(ValueError, match="device must be"):
        vbudget.resolve_device("cuda:x")
    assert vattn.Budget.create(budget_name, MiB, device="cuda:0").device == expected


def test_a_missing_cuda_driver_names_the_way_out(monkeypatch):
    monkeypatch.setenv("VATTN_CUDA_DRIVER_LIB", "/nonexistent/libcuda.so.1")
    with pytest.raises(vattn.BackendUnavailable, match="GPU-"):
        vbudget.resolve_device("cuda:0")


def test_a_segment_another_user_owns_or_others_may_write_is_refused(budget_name):
    """Another local user who created (or opened up) a budget's segment could
    rewrite it and have every member's pages taken: attach refuses it and says why."""
    vattn.Budget.create(budget_name, MiB)
    path = segment_path(budget_name)
    assert path.stat().st_mode & 0o777 == 0o600
    os.chown(path, 12345, -1)
    with pytest.raises(vattn.BudgetError, match=rf"'{budget_name}'.*owned by uid 12345.*not by this process's user"):
        vattn.Budget.attach(budget_name)
    os.chown(path, os.geteuid(), -1)
    os.chmod(path, 0o666)
    with pytest.raises(vattn.BudgetError, match=rf"'{budget_name}'.*mode 0666.*other users"):
        vattn.Budget.attach(budget_name)
    os.chmod(path, 0o600)
    assert vattn.Budget.attach(budget_name).limit == MiB  # nothing changed


def test_a_label_that_is_not_text_makes_the_budget_corrupt(budget_name):
    b = vattn.Budget.create(budget_name, MiB, max_members=4)
    member = b.join("fine")  # noqa: F841 (kept: its entry is the one damaged)
    _, _, header_bytes, entry_bytes, _ = read_prefix(budget_name)
    with open(segment_path(budget_name), "r+b") as f:
        f.seek(header_bytes + entry_bytes - 48)  # entry 0's label: the entry's last 48 bytes
        f.write(b"\xff\xfe\x80 not utf-8\x00")
    with pytest.raises(vattn.BudgetError, match=_corrupt_message(budget_name)) as info:
        b.usage()
    assert "label" in str(info.value)


def test_a_device_field_overwritten_under_an_attached_budget_makes_it_corrupt(budget_name):
    """The device is read again at every use: bytes written over it after attach give BudgetError (usage()
    raised UnicodeDecodeError, and the command line printed a traceback)."""
    b = vattn.Budget.create(budget_name, MiB)
    assert b.device == "cpu"
    with open(segment_path(budget_name), "r+b") as f:
        f.seek(32)  # the header's device field: after the 24-byte prefix, the lock kind and a reserved word
        f.write(b"\xff\xfe\x80" + b"x" * 61)  # not text, and no terminating NUL in its 64 bytes
    for read in (lambda: b.device, b.usage):
        with pytest.raises(vattn.BudgetError, match=_corrupt_message(budget_name)) as info:
            read()
        assert "device field" in str(info.value)


OUT_OF_DESCRIPTORS = """
import os, resource, sys
import vattn
from vattn.budget import budget as vbudget
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
fds = []
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
try:
    vbudget.remove(sys.argv[1])
    print("removed")
except vattn.BudgetError as e:
    print("refused:", e)
"""


def test_remove_out_of_descriptors_refuses_instead_of_unlinking_a_live_budget(budget_name):
    """A process that cannot open the segment (no descriptor left) cannot count its members: remove raises
    the system's error. (It took the budget for an unreadable one and unlinked it under a live member.)"""
    b = vattn.Budget.create(budget_name, 4 * MiB)
    m = b.join("user")
    assert m.try_grant(MiB)
    out = subprocess.run([sys.executable, "-c", OUT_OF_DESCRIPTORS, budget_name], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.startswith("refused:") and "Too many open files" in out.stdout, out.stdout + out.stderr
    assert budget_name in vbudget.names() and m.held_bytes == MiB and [u.label for u in b.usage().members] == ["user"]
    m.leave()


def test_a_limit_of_zero_is_refused_at_creation(budget_name):
    with pytest.raises(ValueError, match=r"limit_bytes must be in \[1, 2\*\*64 - 1\] bytes.*grants nothing"):
        vattn.Budget.create(budget_name, 0)
    assert budget_name not in vbudget.names()


def test_remove_refuses_live_members_unless_forced(budget_name):
    """Removing a budget that members use would split the account (they would
    go on charging a segment nobody else sees): refused, unless forced; then
    the members see it removed and are refused from then on."""
    b = vattn.Budget.create(budget_name, 4 * MiB)
    m = b.join("user")
    assert m.try_grant(MiB)
    with pytest.raises(vattn.BudgetError, match=rf"'{budget_name}' has 1 live member.*force"):
        vbudget.remove(budget_name)
    assert budget_name in vbudget.names() and m.held_bytes == MiB  # nothing changed
    vbudget.remove(budget_name, force=True)
    assert budget_name not in vbudget.names()
    with pytest.raises(vattn.BudgetError, match=rf"'{budget_name}' was removed"):
        m.try_grant(MiB)
    with pytest.raises(vattn.BudgetError, match="was removed"):
        b.join("late")
    m.release(MiB)  # giving back stays quiet: nothing to return to
    m.leave()
    vattn.Budget.create(budget_name, MiB)  # the name is free
