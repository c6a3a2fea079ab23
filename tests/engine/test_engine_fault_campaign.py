"""Fault campaign over the engine: driver and OS faults injected at random
points of random iterations (page creation, maps and unmaps, in admission,
step, fork, prefix attach, prefix-cache inserts and frees, and in the
background mapper), with n > 1, the prefix cache on and a tight pool.

Checked against a fault-free run of the same workload: every request
finishes exactly once; one that finishes normally has the fault-free
output, one that finishes with an error says so and has a prefix of it.
After every iteration the engine's bookkeeping matches the cache (a reqid
allocated exactly for each running request) and the page table its
invariants; at the end every reqid is free, no page is held beyond the
prefix cache's own, and closing the engine leaves no descriptor, thread or
mapping behind.

Short by default (a few seconds); VATTN_LONG_TESTS=1 runs many more seeds
and longer workloads.
"""

from __future__ import annotations

import gc
import os
import random

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers: pip install -e \".[transformers]\"")

from conftest import assert_invariants, assert_table_is_real  # noqa: E402
from engine_faults import FAULTY_HOST, HOST_FAULTS, PAGE, VOCAB, one_torch_thread, tiny_llama  # noqa: E402

from vattn.engine import Engine, RequestOutput  # noqa: E402

LONG = os.environ.get("VATTN_LONG_TESTS") == "1"
SEEDS = range(12) if LONG else range(1)
REQUESTS = 24 if LONG else 8
FAULT_RATE = 0.35  # share of iterations with a fault armed somewhere inside

CONFIGS = {
    # the mapper off: every map and unmap happens inside the engine's own calls
    "sync": dict(policy={"background": False, "eager": False, "deferred_reclaim": True}),
    # the mapper on: faults also land in its batches and surface at the next step
    "mapper": dict(policy={"background": True, "eager": True, "eager_tokens": 32, "deferred_reclaim": True,
                           "reclaim_threshold": 0.3}),
    # free_reqid unmaps at once: faults land in frees too
    "eager-free": dict(policy={"background": False, "eager": False, "deferred_reclaim": False}),
}


OPTIONS = dict(max_batch_size=6, max_context_len=96, page_size=PAGE, physical_memory=36 * PAGE,  # 6 page ids
               prefix_cache=True, kv_retries=2, backend=FAULTY_HOST)
_fault_free: dict[int, dict] = {}  # seed -> outputs of the workload without faults


@pytest.fixture(scope="module")
def model():
    with one_torch_thread():
        yield tiny_llama()


def workload(seed: int) -> list[dict]:
    """Prompts over two shared system prompts (cache hits), n of 1 to 3,
    greedy and seeded sampling."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    systems = [torch.randint(2, VOCAB, (m,), generator=g).tolist() for m in (40, 35)]
    out = []
    for i in range(REQUESTS):
        prompt = systems[i % 2] + torch.randint(2, VOCAB, (rng.randint(1, 20),), generator=g).tolist()
        sampled = rng.random() < 0.25
        out.append(dict(prompt=prompt, max_new_tokens=rng.randint(1, 30), n=rng.choice([1, 1, 2, 3]),
                        temperature=0.8 if sampled else 0.0, seed=rng.randrange(2**31) if sampled else None))
    return out


def run(engine: Engine, requests: list[dict], rng: random.Random | None = None, plan=None) -> tuple[dict, int]:
    """Feeds the requests (a few per iteration), steps until all finished;
    with ``rng``, arms a fault in ``plan`` (a random host call, failing after
    a random number of successful ones) before some iterations. Returns the outputs by
    (request_id, sample_index) and the number of KV errors the engine met."""
    outs: dict[tuple[int, int], RequestOutput] = {}
    pending = list(requests)
    for _ in range(3000):
        if not pending and not engine.has_unfinished():
            break
        arriving = rng.randint(0, 3) if rng else 2
        for spec in pending[:arriving]:
            engine.add_request(**spec)
        del pending[:arriving]
        if rng is not None and rng.random() < FAULT_RATE:
            call = rng.choice(sorted(HOST_FAULTS))
            plan.fail(call, rng.randint(0, 4), rng.choice([1, 1, 1, 4]), HOST_FAULTS[call])
        try:
            finished = engine.step()
        finally:
            if plan is not None:
                plan.clear()
        for out in finished:
            key = (out.request_id, out.sample_index)
            assert key not in outs, f"request {key} finished twice"
            outs[key] = out
        check_bookkeeping(engine)
    else:
        raise AssertionError("the engine did not finish its requests")
    return outs, engine.stats()["kv_errors"]


def check_bookkeeping(engine: Engine) -> None:
    """Each unfinished request in one place; a reqid allocated exactly for
    each running request; the page table consistent."""
    kv, sched = engine.kv, engine.scheduler
    running = [r.reqid for r in sched.running]
    assert len(set(map(id, sched.running)) | set(map(id, sched.waiting))) == len(sched.running) + len(sched.waiting)
    assert sorted(running) == [r for r in range(kv.config.max_batch_size) if kv.is_allocated(r)]
    assert all(r.reqid == -1 for r in sched.waiting)
    assert_invariants(kv)


def check_no_leak(engine: Engine) -> None:
    """Every reqid free; every page in use is the prefix cache's or mapped
    in a free reqid for reuse (deferred reclaim, eager allocation), and
    those go back to the pool when reclaimed (eager: all but the next reqid's)."""
    kv, cache = engine.kv, engine.prefix_cache
    assert not engine.has_unfinished() and kv.stats()["reqids_allocated"] == 0
    kv.reclaim()  # also retries unmaps that failed
    kv.wait_idle()
    cached = {page for handle in cache.entries for page in cache.page_ids(handle)}
    parked = {page for r in range(kv.config.max_batch_size) for page in kv.page_ids(r)}
    stats = kv.stats()
    assert stats["pages_orphaned"] == 0
    assert stats["prefix_handles"] == len(cache.entries)
    assert stats["pages_in_use"] == len(cached | parked) * kv.config.num_buffers
    assert_invariants(kv)
    assert_table_is_real(kv)
    cache.clear()
    kv.reclaim()
    kv.wait_idle()
    eager = kv.policy["eager"] and kv.config.pages_for(kv.policy["eager_tokens"], kv.page_size)
    assert kv.stats()["pages_in_use"] <= eager * kv.config.num_buffers  # the next reqid's, if the mapper made it


def open_state() -> tuple[int, int]:
    gc.collect()
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("seed", SEEDS)
def test_engine_fault_campaign(model, config, seed, host_faults):
    """Short by default; VATTN_LONG_TESTS=1 runs 12 seeds of 24 requests each."""
    requests = workload(seed)
    options = dict(OPTIONS, **CONFIGS[config])
    if seed not in _fault_free:  # greedy outputs do not depend on the schedule: one run serves every config
        with Engine(model, **OPTIONS, **CONFIGS["sync"]) as engine:
            _fault_free[seed], errors = run(engine, requests)
            assert errors == 0 and all(out.finish_reason != "error" for out in _fault_free[seed].values())
    want = _fault_free[seed]
    fds, threads = open_state()
    rng = random.Random(f"{config}-{seed}")
    with Engine(model, **options) as engine:
        got, errors = run(engine, requests, rng, host_faults)
        assert sorted(got) == sorted(want)  # every completion of every request, once
        for key, out in got.items():
            spec = requests[key[0]]
            if out.finish_reason == "error":
                assert out.error and "KV cache failed" in out.error, out.error
                if spec["temperature"] == 0:
                    assert want[key].output[:len(out.output)] == out.output
            else:
                assert out.finish_reason == want[key].finish_reason
                if spec["temperature"] == 0:
                    assert out.output == want[key].output, f"request {key}"
        assert errors > 0  # faults really happened and were recovered from
        check_no_leak(engine)
    assert open_state() == (fds, threads)
    assert "vattn-kv-pool" not in open("/proc/self/maps").read()
