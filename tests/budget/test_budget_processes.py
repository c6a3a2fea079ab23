"""The budget across processes (forked children, not threads): the limit
under concurrent grants, a SIGKILLed member's share, a lock holder killed
inside the lock, a reused pid, and a member inherited through fork."""

from __future__ import annotations

import errno
import json
import os
import random
import time

import pytest
from budget_helpers import Child, budget_name, run_in_child  # noqa: F401 (fixture)

import vattn
import vattn._testing as hooks

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
            assert hooks.budget_lock_raw(name) == 0
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
        with pytest.raises(vattn.BudgetError, match=rf"held for over 0.2 s by pid {child.pid} \(a stopped"):
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


def test_a_lock_left_unrecoverable_gives_a_clear_error(budget_name):
    b = vattn.Budget.create(budget_name, MiB)
    child = Child(_grant_and_sleep(budget_name, MiB, hold_lock=True))
    try:
        assert child.recv() == "ready"
        child.kill()
        child.wait()
    finally:
        child.close()

    def lock_and_unlock_without_repair() -> None:  # in a child: a lock that never comes must not hang pytest
        rc = hooks.budget_lock_raw(budget_name, make_consistent=False)
        assert rc == errno.EOWNERDEAD, f"pthread_mutex_lock returned {rc}"  # the next holder is told
        hooks.budget_unlock_raw(budget_name)

    assert run_in_child(lock_and_unlock_without_repair, timeout_s=5) == "ok"
    with pytest.raises(vattn.BudgetError, match=rf"lock is unrecoverable.*budget rm {budget_name}"):
        b.usage()


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
        try:
            m.try_grant(MiB)
            c.send("granted")
        except vattn.BudgetError as e:
            c.send(str(e))
        own = b.join("child")  # the inherited mapping works for its own member
        c.send(str(own.try_grant(MiB)))
        # exiting destroys nothing of the parent's: the inherited member does not leave

    child = Child(body)
    try:
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
