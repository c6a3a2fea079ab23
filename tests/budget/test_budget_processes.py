"""The budget across processes (forked children, not threads): the limit
under concurrent grants, a SIGKILLed member's share, a lock holder killed
inside the lock, a reused pid, and a member inherited through fork."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import threading
import time

import pytest
from budget_helpers import (Child, budget_name, prepare_thread_exit, read_prefix, run_in_child,  # noqa: F401 (fixture)
                            run_in_fresh_process, segment_path)

import vattn
import vattn._testing as hooks
from vattn.budget import budget as vbudget

MiB = 1 << 20


def _hammer(name: str, seed: int, ops: int, limit: int):
    """A child's body: random grants and releases, checking the limit under the lock after every grant."""

    def body(c: Child) -> None:
        b = vattn.Budget.attach(name)
        m = b.join(f"hammer-{seed}")
        rng = random.Random(seed)
        held = granted = refused = violations = 0
        c.recv()  # start together
        for _ in range(ops):
            if held and rng.random() < 0.45:
                n = rng.randint(1, held)
                m.release(n)
                held -= n
            else:
                n = rng.randint(1, limit // 3)
                if m.try_grant(n):
                    held += n
                    granted += 1
                    u = b.usage()  # read under the lock
                    violations += u.held_bytes > u.limit_bytes or sum(x.held_bytes for x in u.members) > u.limit_bytes
                else:
                    refused += 1
            if m.held_bytes != held:
                violations += 1
        c.send(json.dumps({"pid": os.getpid(), "id": m.id, "held": held, "granted": granted, "refused": refused,
                           "violations": violations}))
        c.recv()  # hold the share until the parent has checked the total

    return body


def test_the_limit_holds_across_processes_under_concurrent_grants(budget_name):
    limit = 10 * MiB
    vattn.Budget.create(budget_name, limit)
    children = [Child(_hammer(budget_name, seed, 2000, limit)) for seed in range(3)]
    try:
        for c in children:
            c.send("go")
        results = [json.loads(c.recv()) for c in children]
        u = vattn.Budget.attach(budget_name).usage()
        assert all(r["violations"] == 0 for r in results), results
        # the model: each member holds exactly what its own grants and releases left it
        assert {m.id: m.held_bytes for m in u.members} == {r["id"]: r["held"] for r in results}
        assert u.held_bytes == sum(r["held"] for r in results) <= limit
        assert sum(r["refused"] for r in results) > 0 and sum(r["granted"] for r in results) > 0  # contention happened
        for c in children:
            c.send("exit")
            assert c.wait() == 0
        assert vattn.Budget.attach(budget_name).usage().held_bytes == 0  # exited members are gone
    finally:
        for c in children:
            c.close()


def _grant_and_sleep(name: str, nbytes: int, hold_lock: bool = False):
    def body(c: Child) -> None:
        m = vattn.Budget.attach(name).join("victim")
        assert m.try_grant(nbytes)
        if hold_lock:
            assert hooks.budget_lock_raw(name) == 0  # and dies holding it
        c.send("ready")
        time.sleep(60)

    return body


def test_a_sigkilled_members_share_returns_at_the_next_operation(budget_name):
    limit = 8 * MiB
    b = vattn.Budget.create(budget_name, limit)
    mine = b.join("survivor")
    child = Child(_grant_and_sleep(budget_name, 6 * MiB))
    try:
        assert child.recv() == "ready"
        assert not mine.try_grant(4 * MiB)
        child.kill()  # not reaped yet: a zombie's share returns too
        start = time.monotonic()
        while not mine.try_grant(4 * MiB):  # the next grant that needs the share gets it
            assert time.monotonic() - start < 1.0, "the killed member's share did not return within a second"
            time.sleep(0.005)
        assert time.monotonic() - start < 1.0
        assert [m.label for m in b.usage().members] == ["survivor"]
        assert child.wait() == -9
    finally:
        child.close()


def test_a_budget_whose_members_all_died_is_reusable(budget_name):
    vattn.Budget.create(budget_name, 4 * MiB)
    child = Child(_grant_and_sleep(budget_name, 4 * MiB))
    try:
        assert child.recv() == "ready"
        child.kill()
        child.wait()
    finally:
        child.close()
    b = vattn.Budget.attach(budget_name)
    u = b.usage()
    assert (u.held_bytes, u.members) == (0, ())
    assert b.join("again").try_grant(4 * MiB)


def test_a_lock_holder_killed_inside_the_lock_does_not_wedge_the_budget(budget_name):
    b = vattn.Budget.create(budget_name, 8 * MiB)
    child = Child(_grant_and_sleep(budget_name, 5 * MiB, hold_lock=True))
    try:
        assert child.recv() == "ready"
        # while the holder lives, the lock is held: an operation waits, and after its timeout says who holds it
        start = time.monotonic()
        with pytest.raises(vattn.BudgetLockTimeout, match=rf"held for over 0.2 s by pid {child.pid} \(a stopped"):
            vattn.Budget.attach(budget_name, lock_timeout_s=0.2).usage()
        assert 0.2 <= time.monotonic() - start < 1.0
        child.kill()
        child.wait()

        def next_operation() -> None:  # by another process, timed there (the fork is not part of it)
            start = time.monotonic()
            assert vattn.Budget.attach(budget_name).join("next").try_grant(8 * MiB), "the dead share did not return"
            assert time.monotonic() - start < 1.0, f"took {time.monotonic() - start:.2f} s"

        assert run_in_child(next_operation, timeout_s=5) == "ok"
        u = b.usage()  # and the lock keeps working
        assert (u.held_bytes, [m.label for m in u.members]) == (0, [])
        assert b.join("after").try_grant(8 * MiB)
    finally:
        child.close()


def test_a_reused_pid_is_told_apart_by_its_start_time(budget_name):
    b = vattn.Budget.create(budget_name, 10 * MiB)
    me = os.getpid()
    start = hooks.budget_process_start_ticks(me)
    parent = os.getppid()
    parent_start = hooks.budget_process_start_ticks(parent)
    # entries as dead processes would have left them: a live pid (ours, another
    # process's) with another start time
    hooks.budget_add_entry(budget_name, me, start - 1, "ghost-of-an-older-process", 4 * MiB)
    hooks.budget_add_entry(budget_name, parent, parent_start + 1, "ghost-of-another", 4 * MiB)
    # a live process with its true start time, and this very process
    hooks.budget_add_entry(budget_name, parent, parent_start, "parent", 1 * MiB)
    hooks.budget_add_entry(budget_name, me, start, "me", 2 * MiB)
    u = b.usage()
    assert sorted((m.label, m.pid) for m in u.members) == [("me", me), ("parent", parent)]
    assert u.held_bytes == 3 * MiB


def test_a_dead_pid_is_dropped(budget_name):
    b = vattn.Budget.create(budget_name, 10 * MiB)
    child = Child(lambda c: None)
    child.wait()
    child.close()
    hooks.budget_add_entry(budget_name, child.pid, 1, "gone", 4 * MiB)
    assert b.usage().members == ()


def test_a_member_inherited_through_fork_stays_the_parents(budget_name):
    b = vattn.Budget.create(budget_name, 10 * MiB)
    m = b.join("parent")
    assert m.try_grant(MiB)

    def body(c: Child) -> None:
        # every operation refuses, the lock-free ones too (pressure answered 0 from the parent's entry,
        # wait_for_memory waited, held_bytes showed the parent's share)
        for name, op in (("try_grant", lambda: m.try_grant(MiB)), ("pressure", m.pressure),
                         ("wait_for_memory", lambda: m.wait_for_memory(0.2)), ("held_bytes", lambda: m.held_bytes)):
            try:
                op()
                c.send(f"{name} went through")
            except vattn.BudgetError as e:
                c.send(str(e))
        own = b.join("child")  # the inherited mapping works for its own member
        c.send(str(own.try_grant(MiB)))
        # exiting destroys nothing of the parent's: the inherited member does not leave

    child = Child(body)
    try:
        for _ in range(4):
            assert "inherited through fork" in child.recv()
        assert child.recv() == "True"
        assert child.wait() == 0
    finally:
        child.close()
    assert [(x.label, x.held_bytes) for x in b.usage().members] == [("parent", MiB)]
    assert m.try_grant(MiB) and m.held_bytes == 2 * MiB


def test_pressure_seen_from_another_process(budget_name):
    b = vattn.Budget.create(budget_name, 10 * MiB)
    holder = b.join("holder")
    assert holder.try_grant(9 * MiB)
    holder.report(4 * MiB, 5 * MiB)

    def body(c: Child) -> None:
        asker = vattn.Budget.attach(budget_name).join("asker")
        c.send(str(asker.try_grant(3 * MiB)))
        c.recv()
        c.send(str(asker.try_grant(3 * MiB)))

    child = Child(body)
    try:
        assert child.recv() == "False"
        assert holder.pressure() == 2 * MiB
        holder.release(2 * MiB)  # what a manager under pressure does with free pages
        assert holder.pressure() == 0
        child.send("again")
        assert child.recv() == "True"
        assert child.wait() == 0
    finally:
        child.close()
    assert b.usage().held_bytes == 7 * MiB


def _proc_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (the thread-group leader's)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _main_thread_exits(name: str, nbytes: int):
    """A child's body: another thread joins and holds ``nbytes``, then the main
    thread leaves with pthread_exit while that thread runs on."""

    def body(c: Child) -> None:
        import ctypes
        import threading

        held = threading.Event()

        def hold() -> None:
            m = vattn.Budget.attach(name).join("threads-live-on")
            assert m.try_grant(nbytes)
            held.set()
            c.recv()  # lives until the parent says so (or kills it)
            m.leave()

        threading.Thread(target=hold).start()
        held.wait()
        c.send("ready")
        ctypes.CDLL(None).pthread_exit(None)  # the main thread ends; the process lives in its other thread

    return body


def test_a_member_whose_main_thread_exited_keeps_its_share(budget_name, request):
    """/proc/PID/stat shows a process whose main thread exited as a zombie ('Z')
    while its other threads run: it is alive, and its share must not be handed out.
    Forked from a fresh interpreter: a child's pthread_exit can block on a lock
    one of the suite's threads held when it forked."""
    if run_in_fresh_process(request):
        return
    b = vattn.Budget.create(budget_name, 8 * MiB)
    newcomer = b.join("newcomer")
    prepare_thread_exit()
    child = Child(_main_thread_exits(budget_name, 6 * MiB))
    try:
        assert child.recv(60) == "ready"
        deadline = time.monotonic() + 5
        while _proc_state(child.pid) != "Z":  # the main thread is gone, the process is not
            assert time.monotonic() < deadline, "the child's main thread did not exit"
            time.sleep(0.01)
        assert not newcomer.try_grant(4 * MiB)  # a refusal checks liveness first: the member stays
        assert [(m.label, m.held_bytes) for m in b.usage().members] == [("newcomer", 0), ("threads-live-on", 6 * MiB)]
        assert b.held_bytes <= b.limit
        child.send("leave")
        deadline = time.monotonic() + 5
        while b.usage().members != tuple(m for m in b.usage().members if m.label == "newcomer"):
            assert time.monotonic() < deadline, "the member did not leave"
            time.sleep(0.01)
        assert newcomer.try_grant(4 * MiB)
    finally:
        child.close()


def _join_then_exec(name: str, nbytes: int):
    """A child's body: joins and holds ``nbytes``, then execs another program
    (same pid, same start time; every page of the old image is gone)."""

    def body(c: Child) -> None:
        m = vattn.Budget.attach(name).join("execs")
        assert m.try_grant(nbytes)
        c.send("ready")
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)"])

    return body


def _wait_for_exec(child: Child) -> None:
    """Until ``child`` runs the new program (its end of the pipe closed at exec)."""
    try:
        child.recv()
    except EOFError:
        pass
    deadline = time.monotonic() + 10
    while b"time.sleep" not in open(f"/proc/{child.pid}/cmdline", "rb").read():
        assert time.monotonic() < deadline, "the child did not exec"
        time.sleep(0.01)


def test_a_member_that_execs_gives_its_share_back(budget_name):
    b = vattn.Budget.create(budget_name, 8 * MiB)
    newcomer = b.join("newcomer")
    child = Child(_join_then_exec(budget_name, 6 * MiB))
    try:
        assert child.recv() == "ready"
        assert not newcomer.try_grant(4 * MiB)
        _wait_for_exec(child)
        deadline = time.monotonic() + 2  # the new program shows in /proc a moment before the old files close
        while not newcomer.try_grant(4 * MiB):  # the old image's share is gone with it
            assert time.monotonic() < deadline, "the share of a member that exec'd did not come back"
            time.sleep(0.005)
        assert [m.label for m in b.usage().members] == ["newcomer"]
    finally:
        child.close()


def test_a_creator_killed_during_create_leaves_nothing_behind(budget_name, capsys):
    """A creator killed half-way (here by SIGXFSZ at the segment's ftruncate,
    as final as SIGKILL: no destructor runs) leaves its staging file; `ls` and
    a later create remove it, a live creator's file stays."""
    import resource
    import signal as sig

    from budget_helpers import SHM_DIR

    from vattn.__main__ import main

    def body(c: Child) -> None:
        sig.signal(sig.SIGXFSZ, sig.SIG_DFL)  # Python ignores it; the kernel's default ends the process
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # the segment of 4096 members is larger
        vattn.Budget.create(budget_name, MiB, max_members=4096)

    child = Child(body)
    try:
        assert child.wait() == -sig.SIGXFSZ
    finally:
        child.close()
    leftovers = list(SHM_DIR.glob(f"vattn-budget-~{budget_name}~*"))
    assert len(leftovers) == 1 and str(child.pid) in leftovers[0].name
    live = SHM_DIR / f"vattn-budget-~{budget_name}~{os.getpid()}~1"  # a creator that is still running: us
    live.write_bytes(b"")
    try:
        assert main(["budget", "ls"]) == 0
        said = capsys.readouterr()
        assert not leftovers[0].exists(), "ls left the dead creator's staging file"
        assert leftovers[0].name in said.out + said.err  # and said what it removed
        assert live.exists()
    finally:
        live.unlink()
    vattn.Budget.create(budget_name, MiB)  # and the name is free


def _craft_pthread_lock(name: str, owner: int) -> None:
    """Writes the bytes of a glibc mutex of kind robust + priority-inheritance
    owned by ``owner`` where the header keeps its lock (its last 64-byte
    block): what once tripped a glibc assertion in every process that locked it."""
    from budget_helpers import segment_path

    _, _, header_bytes, _, _ = read_prefix(name)
    with open(segment_path(name), "r+b") as f:
        f.seek(header_bytes - 64)
        f.write(struct.pack("<iIiIi", owner, 0, owner, 0, 16 | 32))  # __lock, __count, __owner, __nusers, __kind


def test_crafted_lock_bytes_never_abort(budget_name):
    from vattn.__main__ import main

    b = vattn.Budget.create(budget_name, 8 * MiB)
    dead = Child(lambda c: None)
    dead.wait()
    dead.close()
    _craft_pthread_lock(budget_name, dead.pid)

    def api() -> None:
        vattn.Budget.attach(budget_name).join("x").try_grant(MiB)

    def top() -> None:
        assert main(["top", "--once", budget_name]) == 1  # named and unreadable: exit status 1

    def ls() -> None:
        assert main(["budget", "ls"]) == 0

    result = run_in_child(api, timeout_s=10)
    assert result.startswith("BudgetError:") and "corrupt" in result and budget_name in result, result
    assert run_in_child(top, timeout_s=10) == "ok"
    assert run_in_child(ls, timeout_s=10) == "ok"
    with pytest.raises(vattn.BudgetError, match="corrupt"):
        b.usage()


OTHER_REMOVER = """
import os, sys, vattn._testing as hooks
name, path = sys.argv[1], sys.argv[2]
hooks.budget_lock_raw(name); print("held", flush=True)
sys.stdin.readline(); os.unlink(path); print("unlinked", flush=True)
sys.stdin.readline(); hooks.budget_unlock_raw(name); print("unlocked", flush=True)
"""


def test_a_removal_never_unlinks_a_budget_created_under_the_name_meanwhile(budget_name):
    """remove counts the members of the file it opened; if that file was removed (by force) and a budget
    created under the name while remove waited for the lock, the new budget is not the one counted: remove
    raises instead of unlinking it (it unlinked the new budget, members and all)."""
    vattn.Budget.create(budget_name, MiB)
    other = subprocess.Popen([sys.executable, "-c", OTHER_REMOVER, budget_name, str(segment_path(budget_name))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        outcome: list[BaseException | int] = []

        def remove() -> None:
            try:
                outcome.append(vbudget.remove(budget_name))
            except BaseException as e:  # noqa: BLE001
                outcome.append(e)

        remover = threading.Thread(target=remove)
        remover.start()
        time.sleep(0.3)  # it opened the file and waits for its lock
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "unlinked"
        new = vattn.Budget.create(budget_name, MiB)
        member = new.join("user of the new budget")
        assert member.try_grant(4096)
        other.stdin.write("\n")
        other.stdin.flush()
        remover.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], vattn.BudgetError), outcome
        assert "was removed (and perhaps created again) while this removal ran" in str(outcome[0])
        assert budget_name in vbudget.names() and [m.label for m in new.usage().members] == ["user of the new budget"]
        member.leave()
    finally:
        other.kill()
        other.wait()
