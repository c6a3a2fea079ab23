"""Two serving engines in two processes under one budget: the budget fits a
few requests of one engine, never both engines' peaks, and its limit is
lowered below what they hold while requests decode (it grants nothing then), until one is
preempted. Both finish
every request with the greedy fp32 tokens they produce alone (none fails),
the budget's total never passes its limit, and the contention shows as
refused page creations and preemptions
(tests/budget/engine_budget_scenario.py is one engine). In one process: a
limit lowered for a moment, a request larger than the pool, and a waiting
engine's CPU time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from budget_helpers import budget_name  # noqa: F401 (fixture)

import vattn

pytest.importorskip("transformers", reason="needs transformers: pip install -e \".[transformers]\"")

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = Path(__file__).with_name("engine_budget_scenario.py")
ID_BYTES = 6 * 4096  # 3 layers x K, V pages of 4 KiB


def test_two_engines_in_two_processes_share_one_budget(budget_name):
    limit = 8 * ID_BYTES  # a lone request needs at most 4 page ids
    budget = vattn.Budget.create(budget_name, limit)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("VATTN_BUDGET", None)
    engines = [subprocess.Popen([sys.executable, str(SCENARIO), budget_name, str(seed)], env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE) for seed in (1, 2)]

    def tell_all() -> None:
        for p in engines:
            p.stdin.write("go\n")
            p.stdin.flush()

    try:
        for p in engines:
            assert p.stdout.readline().strip() == "ready"
        tell_all()
        # Each engine stops where two of its requests decode with a page crossing ahead of each (or 3 s
        # passed). The limit drops to 2 page ids there, below what they hold: the first crossing is
        # refused, and with another request beside it the engine preempts one. The limit rises again once
        # an engine says so (or 10 s passed). (Windows set by the clock or by the bytes held met the
        # engines between such moments on a loaded 2-core VM, or the whole workload ran inside one.)
        lines: list[list[str]] = [[], []]  # each engine's lines: ``preempted N`` (contention may preempt
        # before the pause too), ``paused N``, ..., its JSON line; read by a thread apiece
        readers = [threading.Thread(target=lambda p=p, out=out: out.extend(line.strip() for line in p.stdout))
                   for p, out in zip(engines, lines)]
        for r in readers:
            r.start()
        peak = 0
        paused_at: list[int] | None = None  # each engine's lines before the limit dropped
        lowered = 0.0
        held_when_lowered = held_while_low = 0  # bytes the engines held as the limit dropped, and after

        def preempted_since_lowered() -> bool:
            return paused_at is not None and any(
                line.startswith("preempted") for out, i in zip(lines, paused_at) for line in out[i:])

        while any(p.poll() is None for p in engines):
            held = budget.held_bytes
            peak = max(peak, held)  # the whole run, the contention before the pause included
            if paused_at is not None and budget.limit < limit:
                held_while_low = max(held_while_low, held)
            if paused_at is None and any(p.poll() is not None for p in engines):
                break  # one ended before its pause: the other waits for a line that will not come
            if paused_at is None and all(any(line.startswith("paused ") for line in out) for out in lines):
                paused_at = [len(out) for out in lines]
                held_when_lowered = budget.held_bytes  # both engines wait: nothing moves meanwhile
                budget.set_limit(2 * ID_BYTES)
                lowered = time.monotonic()
                tell_all()
            elif (paused_at is not None and budget.limit < limit
                  and (preempted_since_lowered() or time.monotonic() - lowered >= 10.0)):
                budget.set_limit(limit)
            time.sleep(0.002)
        budget.set_limit(limit)
        for r in readers:
            r.join(30)
        assert [p.returncode for p in engines] == [0, 0] and paused_at is not None and all(lines), lines
        paused = [next(line for line in out if line.startswith("paused ")) for out in lines]
        assert max(int(line.split()[1]) for line in paused) >= 2, lines
        results = [json.loads(out[-1]) for out in lines]
        preempted = preempted_since_lowered()
    finally:
        for p in engines:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(r["equal"] for r in results), results
    assert [r["label"] for r in results] == ["engine", "engine"]
    assert 0 < peak <= limit
    # below what they held, the lowered limit grants nothing: a page the engines use meanwhile is one they hold
    assert 2 * ID_BYTES < held_when_lowered and 0 < held_while_low <= held_when_lowered, (held_when_lowered,
                                                                                         held_while_low)
    assert sum(r["refused"] for r in results) > 0 and preempted, (results, lines)
    assert budget.usage().members == ()


VOCAB = 96


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The model runs in this process with one thread: an OpenMP pool started
    here would hang the children that later tests fork from it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(30, 60, (n,), generator=g)]


OPTIONS = dict(max_batch_size=4, max_context_len=128, page_size=4096)


def test_a_limit_lowered_for_a_moment_loses_no_request(budget_name, model):
    """The limit is a live setting: lowered below what a running request needs
    for a moment and restored, the requests wait (preempted, requeued)
    instead of failing."""
    from vattn.engine import Engine

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, VOCAB, (40,), generator=g).tolist() for _ in range(2)]  # 2 page ids each...
    with Engine(model, budget=False, **OPTIONS) as alone:
        expected = alone.generate(prompts, max_new_tokens=60)  # ...and a third at 64 tokens
    budget = vattn.Budget.create(budget_name, 8 * ID_BYTES)
    # no mapper running ahead: the third page is asked for when the tokens reach it
    with Engine(model, budget=budget_name, idle_release_s=0.2, policy={"background": False}, **OPTIONS) as engine:
        def lower() -> None:
            while engine.iteration < 3:
                time.sleep(0.001)
            budget.set_limit(ID_BYTES)  # less than either request holds
            deadline = time.monotonic() + 5
            while engine.iteration < 30 and time.monotonic() < deadline:  # past the third page's first token
                time.sleep(0.001)
            time.sleep(0.3)
            budget.set_limit(8 * ID_BYTES)

        lowering = threading.Thread(target=lower)
        lowering.start()
        try:
            got = engine.generate(prompts, max_new_tokens=60)
        finally:
            lowering.join()
        assert got == expected
        assert engine.stats()["creations_refused"] > 0  # the lowered limit was felt


def test_a_request_larger_than_the_pool_fails_alone_and_the_batch_is_kept(budget_name, model):
    from vattn.engine import Engine, GenerateError

    vattn.Budget.create(budget_name, 64 * ID_BYTES)
    prompts = _prompts(3, 2)
    with Engine(model, budget=False, **OPTIONS) as alone:
        expected = alone.generate(prompts, max_new_tokens=8)
    big = [2 + i % 90 for i in range(98)]  # 4 page ids: more than the pool's 3
    with Engine(model, budget=budget_name, physical_memory=3 * ID_BYTES, **OPTIONS) as engine:
        with pytest.raises(GenerateError, match="request 1 failed: needs .* more than the physical pool") as info:
            engine.generate([prompts[0], big, prompts[1], prompts[2]], max_new_tokens=8)
        outputs = info.value.outputs
        assert [outputs[i] for i in (0, 2, 3)] == expected and outputs[1] is None
        assert [out.request_id for out in info.value.failed] == [1]


def test_a_waiting_engine_blocks_instead_of_spinning(budget_name, model):
    """Waiting 2 s for another member's memory costs almost no CPU: the wait
    blocks on the budget (woken when memory is released or the limit raised)
    instead of asking again and again. A bound on CPU time and on refused
    page creations, generous on both sides: a spinning wait took ~70% of a
    core and tens of thousands of refusals."""
    from vattn.engine import Engine

    budget = vattn.Budget.create(budget_name, 8 * ID_BYTES)
    prompt = _prompts(1, 3)
    with Engine(model, budget=budget_name, idle_release_s=0.05, **OPTIONS) as engine:
        expected = engine.generate(prompt, max_new_tokens=4)  # warm: the model's first run costs most
        deadline = time.monotonic() + 5
        while budget.held_bytes:  # the engine gives its free pages back: it must ask for new ones
            assert time.monotonic() < deadline
            time.sleep(0.01)
        hog = budget.join("hog")
        assert hog.try_grant(8 * ID_BYTES)
        releaser = threading.Timer(2.0, hog.leave)
        refused = engine.stats()["creations_refused"]
        releaser.start()
        t0, cpu0 = time.monotonic(), time.process_time()
        try:
            got = engine.generate(prompt, max_new_tokens=4)
        finally:
            releaser.join()
        cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
        assert got == expected and wall >= 1.9
        assert cpu / wall < 0.1, f"{cpu:.3f} s of CPU for a {wall:.2f} s wait"
        assert engine.stats()["creations_refused"] - refused < 200


def test_a_request_over_the_limit_fails_after_the_wait_and_the_others_run(budget_name, model):
    """A request whose pages alone exceed the current limit (it fits the pool) is set aside: the
    requests behind it run meanwhile, and it fails with OutOfPages naming the limit and its need once
    ``budget_wait_s`` passed without the limit rising; the wait costs no CPU."""
    from vattn.engine import Engine, GenerateError

    budget = vattn.Budget.create(budget_name, 3 * ID_BYTES)
    prompts = _prompts(3, 2)  # up to 68 tokens with their outputs: 3 page ids of 32 tokens
    with Engine(model, budget=False, **OPTIONS) as alone:
        expected = alone.generate(prompts, max_new_tokens=8)
    big = [2 + i % 90 for i in range(98)]  # 4 page ids: over the limit, within the pool
    with Engine(model, budget=budget_name, budget_wait_s=1.5, **OPTIONS) as engine:
        assert engine.scheduler.request_bytes(len(big)) == 4 * ID_BYTES
        t0 = time.monotonic()
        with pytest.raises(GenerateError) as info:
            engine.generate([big, *prompts], max_new_tokens=8)
        waited = time.monotonic() - t0
        outputs = info.value.outputs
        assert outputs[1:] == expected and outputs[0] is None
        (failure,) = info.value.failed
        assert failure.error == (f"OutOfPages: budget '{budget_name}': this request needs {4 * ID_BYTES} bytes of "
                                 f"KV cache (98 tokens) alone, more than the budget's limit of {3 * ID_BYTES} bytes, "
                                 f"and the limit did not rise within 1.5 s (VATTN_BUDGET_WAIT_S / budget_wait_s)")
        assert 1.5 <= waited < 4.0, waited
        # alone, over the limit: the engine sleeps until the limit may have risen or the wait is up
        t0, cpu0 = time.monotonic(), time.process_time()
        with pytest.raises(GenerateError, match="OutOfPages: .* within 1.5 s"):
            engine.generate([big], max_new_tokens=8)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
        assert 1.5 <= wall and cpu / wall < 0.1, f"{cpu:.3f} s of CPU in {wall:.2f} s"
        # the limit raised within the wait: it runs
        threading.Timer(0.5, budget.set_limit, (4 * ID_BYTES,)).start()
        assert len(engine.generate([big], max_new_tokens=8)[0]) == 8
    assert budget.usage().members == ()
