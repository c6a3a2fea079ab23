"""KV cache managers in one budget from separate processes (forked children,
or fresh interpreters for what a framework starts): the limit holds under
concurrent steps, checked against each process's own count of the pages it
created; a refused step succeeds once another process gives back; a
SIGKILLed process's pages go back; a lowered limit takes free pages only;
VATTN_BUDGET joins without code."""

from __future__ import annotations

import ctypes
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

from budget_helpers import (Child, budget_name, prepare_thread_exit, run_in_fresh_process, segment_path,  # noqa: F401
                            stuck_lock_holder)
from manager_helpers import B, ID_BYTES, TOKENS_PER_PAGE, make_kv, pages, wait_until

import vattn

ROOT = Path(__file__).resolve().parents[2]


def _stepper(name: str, seed: int, ops: int, limit: int, in_thread: bool = False, broken_ok: bool = False):
    """A child's body: random admissions, growth and preemptions (as an
    engine does) in its own manager, mapper on; checks that no request loses
    a page and that the budget's total never passes the limit.

    ``in_thread``: the work runs in a second thread and the main thread exits
    (pthread_exit) once the manager holds pages: the process lives on.
    ``broken_ok``: half-way it waits for the parent to truncate the segment;
    the manager then detaches from the budget when it next needs a page and
    steps on within its pool (``broken``: it did, with the reason)."""

    def run(c: Child) -> None:
        budget = vattn.Budget.attach(name)
        kv = make_kv(budget=name, idle_release_s=None, budget_label=f"stepper-{seed}")
        rng = random.Random(seed)
        live: dict[int, int] = {}  # reqid -> tokens stepped
        steps = refused = violations = 0
        c.send("ready")
        c.recv()  # start together
        for op in range(ops):
            if broken_ok and op == ops // 2:
                c.send("midway")  # the parent truncates the segment now
                c.recv()
            x = rng.random()
            if x < 0.2 and len(live) < B:
                live[kv.alloc_reqid()] = 0
            elif x < 0.3 and live:
                r = rng.choice(sorted(live))
                kv.free_reqid(r)
                del live[r]
            elif live:
                target = {r: min(4096, n + rng.randint(1, 3 * TOKENS_PER_PAGE)) for r, n in live.items()}
                lens = [target.get(r, 0) for r in range(B)]
                before = {r: kv.page_ids(r) for r in live}
                steps += 1
                stepped = kv.step(lens)  # a budget that cannot be used detaches the cache: no error
                if stepped:
                    live = target
                    violations += sum(kv.mapped_tokens(r) < n for r, n in live.items())
                else:
                    refused += 1  # the mapper may have grown a request meanwhile, never shrunk one
                    violations += sum(kv.page_ids(r)[:len(before[r])] != before[r] for r in live)
                    r = max(live)  # preempt the most recent
                    kv.free_reqid(r)
                    del live[r]
            try:
                violations += budget.held_bytes > limit
            except vattn.BudgetError:  # truncated: the lock-free read says so instead of reading zeros
                if not broken_ok:
                    raise
            if in_thread and steps == 5 and not main_may_exit.is_set():
                main_may_exit.set()
                deadline = time.monotonic() + 5
                while _proc_state(os.getpid()) != "Z":  # the rest runs with the main thread gone
                    assert time.monotonic() < deadline, "the main thread did not exit"
                    time.sleep(0.001)
        kv.wait_idle()
        main_may_exit.set()
        c.send("done")
        c.recv()  # the others are done too and no wait is left: nothing moves any more
        kv.wait_idle()
        c.send(json.dumps({"label": f"stepper-{seed}", "share": kv.budget_share(), "steps": steps,
                           "created": kv.stats()["bytes_created"], "refused": refused, "violations": violations,
                           "invariants": kv._pages.check_invariants(),
                           "broken": "cannot be used" in kv.budget_share()["detached"]}))
        c.recv()  # keep the pages until the parent has looked
        kv.cleanup()

    main_may_exit = threading.Event()

    def body(c: Child) -> None:
        if not in_thread:
            return run(c)
        threading.Thread(target=run, args=(c,)).start()
        main_may_exit.wait()
        ctypes.CDLL(None).pthread_exit(None)  # the process goes on in the stepping thread

    return body


def _exec_after_holding(name: str, ids: int):
    """A child's body: a manager holding ``ids`` page ids under a request; on
    "go" the process execs another program (same pid and start time, its
    pages gone with the old image)."""

    def body(c: Child) -> None:
        kv = make_kv(budget=name, idle_release_s=None,
                     policy={"background": False, "eager": False}, budget_label="execs")
        a = kv.alloc_reqid()
        while not kv.step(pages(a, ids * TOKENS_PER_PAGE)):
            kv.wait_for_budget(0.1)
        c.send("holding")
        c.recv()
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)"])

    return body


def test_the_limit_holds_across_processes_under_concurrent_steps(budget_name):
    limit = 24 * ID_BYTES  # each child could use 64 ids: the budget is what binds
    budget = vattn.Budget.create(budget_name, limit)
    children = [Child(_stepper(budget_name, seed, 150, limit)) for seed in range(3)]
    try:
        assert [c.recv() for c in children] == ["ready"] * 3
        for c in children:
            c.send("go")
        assert [c.recv(300) for c in children] == ["done"] * 3
        # Until the last refused wait expires (1 s) the keepers still give free pages back to it.
        time.sleep(1.1)
        for c in children:
            c.send("report")
        results = [json.loads(c.recv()) for c in children]
        assert all(r["violations"] == 0 and r["invariants"] == "" for r in results), results
        # the model: each member holds exactly the pages its process created
        held = {m.label: m.held_bytes for m in budget.usage().members}
        assert held == {r["label"]: r["created"] for r in results} == {r["label"]: r["share"]["held_bytes"]
                                                                       for r in results}
        assert sum(held.values()) == budget.held_bytes <= limit
        assert sum(r["refused"] for r in results) > 0  # the processes did contend
        for c in children:
            c.send("exit")
            assert c.wait() == 0
        assert budget.usage().members == () and budget.held_bytes == 0
    finally:
        for c in children:
            c.close()


def test_members_that_exec_or_lose_their_main_thread_under_concurrent_steps(budget_name, request):
    """The stress above with two more members: one whose main thread exits
    early (its share stays counted: the process lives and steps on), and one
    that execs while the others step (its share comes back to them). Forks
    from a fresh interpreter: a child that ends its main thread must not
    inherit a lock another thread of the suite's process held."""
    if run_in_fresh_process(request):
        return
    limit = 24 * ID_BYTES
    budget = vattn.Budget.create(budget_name, limit)
    prepare_thread_exit()
    execs = Child(_exec_after_holding(budget_name, 6))
    assert execs.recv(120) == "holding"
    children = [Child(_stepper(budget_name, seed, 150, limit, in_thread=seed == 3)) for seed in range(4)]
    try:
        assert [c.recv(120) for c in children] == ["ready"] * 4
        for c in children:
            c.send("go")
        execs.send("exec")
        assert [c.recv(300) for c in children] == ["done"] * 4
        assert _proc_state(children[3].pid) == "Z"  # its main thread is gone; the process steps on
        time.sleep(1.1)
        for c in children:
            c.send("report")
        results = [json.loads(c.recv(120)) for c in children]
        assert all(r["violations"] == 0 and r["invariants"] == "" for r in results), results
        # each member holds exactly the pages its process created; the exec'd one holds nothing
        held = {m.label: m.held_bytes for m in budget.usage().members}
        assert held == {r["label"]: r["created"] for r in results} == {r["label"]: r["share"]["held_bytes"]
                                                                       for r in results}
        assert sum(held.values()) == budget.held_bytes <= limit
        for c in children:
            c.send("exit")
            assert c.wait() == 0
        assert budget.usage().members == () and budget.held_bytes == 0
    finally:
        for c in [*children, execs]:
            c.close()


def test_a_segment_truncated_under_stepping_members_kills_nobody(budget_name):
    """The segment's file is truncated while three processes step: none dies
    (SIGBUS); each detaches from the budget when it next needs pages, saying
    why, and steps on within its own pool."""
    limit = 24 * ID_BYTES
    vattn.Budget.create(budget_name, limit)
    children = [Child(_stepper(budget_name, seed, 600, limit, broken_ok=True)) for seed in range(3)]
    try:
        assert [c.recv() for c in children] == ["ready"] * 3
        for c in children:
            c.send("go")
        assert [c.recv() for c in children] == ["midway"] * 3  # every one holds pages and steps on
        os.truncate(segment_path(budget_name), 0)
        for c in children:
            c.send("go on")
        assert [c.recv() for c in children] == ["done"] * 3
        for c in children:
            c.send("report")
        results = [json.loads(c.recv()) for c in children]
        assert all(r["violations"] == 0 and r["invariants"] == "" for r in results), results
        assert all(r["broken"] for r in results)  # each met it, and went on
        for c in children:
            c.send("exit")
            assert c.wait() == 0
    finally:
        for c in children:
            c.close()


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _holder(name: str, in_use_ids: int, free_ids: int = 0):
    """A child's body: a manager holding in_use_ids under a request and free_ids
    free-held (a freed request's pages), then obeying commands."""

    def body(c: Child) -> None:
        kv = make_kv(budget=name, idle_release_s=None,
                     policy={"background": False, "eager": False}, budget_label="holder")
        a = kv.alloc_reqid()
        if free_ids:
            f = kv.alloc_reqid()
            assert kv.step(pages(f, free_ids * TOKENS_PER_PAGE))
            kv.free_reqid(f)
        assert kv.step(pages(a, in_use_ids * TOKENS_PER_PAGE))
        c.send(json.dumps(kv.page_ids(a)))
        while (cmd := c.recv()) != "exit":
            if cmd == "free":
                kv.free_reqid(a)
            c.send(json.dumps({"ids": kv.page_ids(a), "share": kv.budget_share()}))
        kv.cleanup()

    return body


def test_a_refused_step_succeeds_once_another_process_gives_back(budget_name):
    budget = vattn.Budget.create(budget_name, 8 * ID_BYTES)
    child = Child(_holder(budget_name, 6))
    try:
        assert len(json.loads(child.recv())) == 6
        with make_kv(budget=budget_name, policy={"background": False, "eager": False}) as kv:
            r = kv.alloc_reqid()
            lens = pages(r, 4 * TOKENS_PER_PAGE)
            assert kv.step(lens) is False  # 2 ids left, and the other's 6 are under a request
            time.sleep(0.2)
            assert kv.step(lens) is False  # waiting takes nothing from a request
            assert {m.label: m.held_bytes for m in budget.usage().members}["holder"] == 6 * ID_BYTES
            child.send("free")  # the request ends: its pages are free-held, and someone waits
            child.recv()
            deadline, tries = time.monotonic() + 5, 0
            while not kv.step(lens):
                tries += 1
                assert time.monotonic() < deadline, "the other process never gave back"
                time.sleep(0.005)
            assert kv.budget_share()["held_bytes"] == 4 * ID_BYTES and budget.held_bytes <= 8 * ID_BYTES
            child.send("report")
            share = json.loads(child.recv())["share"]
            assert share["in_use_bytes"] == 0 and share["held_bytes"] <= 4 * ID_BYTES  # gave back 2 ids or more
        child.send("exit")
        assert child.wait() == 0
    finally:
        child.close()


def test_a_killed_process_gives_its_managers_pages_back(budget_name):
    budget = vattn.Budget.create(budget_name, 8 * ID_BYTES)
    child = Child(_holder(budget_name, 6))
    try:
        json.loads(child.recv())
        with make_kv(budget=budget_name, policy={"background": False, "eager": False}) as kv:
            r = kv.alloc_reqid()
            lens = pages(r, 4 * TOKENS_PER_PAGE)
            assert kv.step(lens) is False
            child.kill()  # SIGKILL, not reaped yet: a zombie holds nothing either
            t0 = time.monotonic()
            while not kv.step(lens):  # a refusal checks liveness first: the next step once it is dead
                assert time.monotonic() - t0 < 1.0, "the killed process's share did not come back"
                time.sleep(0.001)
            assert [m.label for m in budget.usage().members] == ["kv 1x1x64 float32"]
        assert child.wait() == -9
    finally:
        child.close()


def test_a_lowered_limit_makes_other_processes_give_back_free_pages_only(budget_name):
    budget = vattn.Budget.create(budget_name, 16 * ID_BYTES)
    child = Child(_holder(budget_name, 4, free_ids=6))
    try:
        ids = json.loads(child.recv())
        assert budget.held_bytes == 10 * ID_BYTES
        budget.set_limit(5 * ID_BYTES)
        wait_until(lambda: budget.held_bytes <= 5 * ID_BYTES, what="the other process shedding to the limit")
        assert budget.held_bytes == 5 * ID_BYTES
        budget.set_limit(0)
        wait_until(lambda: budget.held_bytes == 4 * ID_BYTES, what="every free page given back")
        time.sleep(0.1)
        child.send("report")
        report = json.loads(child.recv())
        assert report["ids"] == ids and budget.held_bytes == 4 * ID_BYTES  # the request kept its pages
        assert report["share"] == dict(budget=budget_name, held_bytes=4 * ID_BYTES, in_use_bytes=4 * ID_BYTES,
                                       free_held_bytes=0, detached="")
        child.send("exit")
        assert child.wait() == 0
    finally:
        child.close()


JOIN_BY_ENV = """
import json, os, torch, vattn
kv = vattn.KVCacheManager(num_layers=2, num_kv_heads=1, head_dim=64, dtype=torch.float32, max_batch_size=2,
                          max_context_len=1024, page_size=65536, policy={"background": False, "eager": False})
r = kv.alloc_reqid()
assert kv.step([300 if i == r else 0 for i in range(2)])
u = kv.budget.usage()
print(json.dumps({"pid": os.getpid(), "share": kv.budget_share(),
                  "members": [[m.pid, m.label, m.held_bytes] for m in u.members]}))
"""


def test_vattn_budget_in_the_environment_joins_without_code(budget_name):
    vattn.Budget.create(budget_name, 64 * ID_BYTES)
    env = dict(os.environ, VATTN_BUDGET=budget_name, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", JOIN_BY_ENV], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    held = 2 * 4 * 64 * 1024  # 300 tokens: 2 pages of 64 KiB a buffer, 4 buffers
    assert got["share"] == dict(budget=budget_name, held_bytes=held, in_use_bytes=held, free_held_bytes=0, detached="")
    assert got["members"] == [[got["pid"], "kv 2x1x64 float32", held]]
    assert vattn.Budget.attach(budget_name).usage().members == ()  # it left when it exited


def test_a_stuck_lock_holder_is_a_refusal_not_a_reason_to_leave_the_budget(budget_name):
    """Another process holds the budget's lock past lock_timeout_s (stopped, stuck): a step that needs pages
    is refused (the manager had detached from the budget for good and created pages nobody counted, past
    the limit), pages released meanwhile are given back once the lock is free (they had stayed charged),
    and a manager closed meanwhile leaves (its entry had stayed, with its bytes)."""
    budget = vattn.Budget.create(budget_name, 8 * ID_BYTES, lock_timeout_s=0.2)
    quiet = dict(budget=budget, idle_release_s=None,
                 policy={"background": False, "eager": False, "deferred_reclaim": False})
    kv, other = make_kv(budget_label="kv", **quiet), make_kv(budget_label="other", **quiet)
    a, b = kv.alloc_reqid(), other.alloc_reqid()
    assert kv.step(pages(a, 4 * TOKENS_PER_PAGE)) and other.step(pages(b, 2 * TOKENS_PER_PAGE))
    kv.free_reqid(a)  # its 4 ids stay created, in the pool, charged
    try:
        with stuck_lock_holder(budget_name) as let_go:
            c = kv.alloc_reqid()
            assert kv.step(pages(c, 6 * TOKENS_PER_PAGE)) is False  # 2 ids more than the pool's 4: refused
            assert kv.budget_share()["detached"] == ""
            assert kv.release_free_memory() == 4 * ID_BYTES  # the pages go; the budget's lock is not to be had
            other.cleanup()  # it cannot clear its entry now
            let_go()
        # the keeper gives the released ids back; the closed manager's entry goes at the next sweep
        wait_until(lambda: budget.held_bytes == 0 and [m.label for m in budget.usage().members] == ["kv"],
                   what="the released pages and the closed member given back")
        assert kv.step(pages(c, 8 * TOKENS_PER_PAGE))  # the whole limit
        assert kv.step(pages(c, 9 * TOKENS_PER_PAGE)) is False  # beyond it: still in the budget
        assert budget.held_bytes == 8 * ID_BYTES == kv.stats()["bytes_created"]
        assert kv.budget_share()["detached"] == ""
    finally:
        kv.cleanup()
        other.cleanup()
