"""vLLM's scheduler under vattn's budget hooks with steps that overlap, and with grants another member
races, in one process without a model (run by tests/integrations/test_vllm_budget_async.py in vLLM's
environment).

``overlap``: vLLM's ``AsyncScheduler`` stepped the way ``EngineCore.step_with_batch_queue`` steps it with
asynchronous scheduling (two batches in flight: step N+1 is scheduled, and its forward starts, before
step N's output is back), another member asking for memory after every output so that the engine gives
free pages back all the time. A fake worker creates a block's pages when a forward first reads it and
gives back the ids a step carries before that step's forward, except ids a forward still in flight reads
(kept, as vattn's worker keeps them in its release backlog). Records every release of a block a forward
in flight still read, every moment the worker held more pages than the engine's charge, and the budget's
peak.

``race``: vLLM's ``Scheduler`` stepped synchronously while another member takes one block's bytes just
before each of the engine's grants (after the engine counted on the free bytes), for a while, then gives
everything back. Records whether a step raised, what the engine's counters say and each request's outcome.

``outside``: blocks handed out with no ``allocate_slots`` around them (``get_new_blocks`` called
directly), their bytes taken by another member before the grant: what the engine does instead of
raising.

``engine``: ``vllm.LLM`` with asynchronous scheduling under a budget, against stock vLLM (:func:`engine`).
``idle-wait``: the CPU a request waiting on the budget costs then (:func:`idle_wait`).

``python vllm_budget_async.py MODE MODEL BUDGET [async|sync]``; prints one JSON line.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import random
import sys
import threading
import time

BLOCK = 16
TOKEN_BYTES = 1024  # the test model: 2 layers x K/V x 2 KV heads x 32 fp32
BLOCK_BYTES = BLOCK * TOKEN_BYTES
STOP = 2  # a token that ends a request: the scheduler learns it only from the output, a step later


def make_config(model: str):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, dtype="float32", max_model_len=256, max_num_seqs=4, block_size=BLOCK,
                      enable_prefix_caching=True, skip_tokenizer_init=True, enforce_eager=True).create_engine_config()


def make_scheduler(config, num_blocks: int, scheduler_class):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config.cache_config.num_gpu_blocks = num_blocks  # what the engine core sets after profiling
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(["layers.0", "layers.1"], spec)])
    return scheduler_class(config, kv_config, StructuredOutputManager(config), block_size=BLOCK)


def block_hasher():
    """What the engine core gives every request with prefix caching on: its blocks' hashes."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK, hash_fn)


def make_request(rid: str, prompt: list[int], max_tokens: int, hasher):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, stop_token_ids=[STOP])
    return Request(rid, prompt, params, None, arrival_time=time.time(), block_hasher=hasher)


class FakeWorker:
    """The worker side of the protocol: pages per block id, forwards in flight and what they read."""

    def __init__(self, scheduler, member, rng: random.Random, stop_probability: float) -> None:
        self.rng = rng
        self.stop_probability = stop_probability  # of each token after a prompt's end: the request stops
        self.scheduler = scheduler
        self.member = member
        self.pages: set[int] = set()  # block ids whose pages the worker holds
        self.backlog: set[int] = set()  # released ids a forward in flight still read: pages kept
        self.forwards: collections.deque = collections.deque()  # (output, ids read, tokens) in flight
        self.released_while_read: list[int] = []
        self.above_charge: list[tuple[int, int]] = []  # (pages' bytes, engine's charge) where pages > charge

    def _read_by_forwards(self) -> set[int]:
        return {i for _, read, _ in self.forwards for i in read}

    def execute(self, output) -> None:
        """Starts ``output``'s forward: its releases first, then the pages of the blocks it reads."""
        from vattn.integrations.vllm.worker_budget import RELEASE_ATTRIBUTE

        read_now = self._read_by_forwards()
        released = set(getattr(output, RELEASE_ATTRIBUTE, None) or ()) | self.backlog
        still_read = released & read_now
        self.released_while_read += sorted(still_read - self.backlog)
        self.backlog = still_read
        self.pages -= released - still_read
        null = self.scheduler.kv_cache_manager.block_pool.null_block.block_id
        read, tokens = set(), {}
        for rid in output.num_scheduled_tokens:
            request = self.scheduler.requests[rid]
            for group in self.scheduler.kv_cache_manager.get_block_ids(rid):
                read.update(i for i in group if i != null)
            # one token at a prompt's end and after; now and then the stop token
            tokens[rid] = [] if request.is_prefill_chunk else [STOP if self.rng.random() < self.stop_probability else 7]
        self.pages |= read
        self.check_charge()
        self.forwards.appendleft((output, read, tokens))

    def finish(self):
        """The oldest forward is done: its output and its ModelRunnerOutput."""
        from vllm.v1.outputs import ModelRunnerOutput

        output, _, tokens = self.forwards.pop()
        ids = list(tokens)
        return output, ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                                         sampled_token_ids=[tokens[rid] for rid in ids])

    def check_charge(self) -> None:
        held = len(self.pages) * BLOCK_BYTES
        if held > self.member.held_bytes:
            self.above_charge.append((held, self.member.held_bytes))


def overlap(model: str, budget_name: str) -> dict:
    import vattn
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from vattn.integrations.vllm.engine_attach import POOL_ATTRIBUTE
    from vattn.integrations.vllm.engine_budget import BudgetedBlockPool

    config = make_config(model)
    budget = vattn.Budget.attach(budget_name)
    scheduler = make_scheduler(config, 64, AsyncScheduler)
    member = budget.join("vllm async")
    other = budget.join("other model")
    pool = BudgetedBlockPool(scheduler, member, budget, BLOCK_BYTES, 1, idle_release_s=1e9)
    setattr(scheduler, POOL_ATTRIBUTE, pool)
    rng = random.Random(3)
    worker = FakeWorker(scheduler, member, rng, 0.15)
    system = [rng.randrange(3, 200) for _ in range(40)]  # a shared prefix: cached blocks are given back too
    arrivals = {}
    for n in range(24):
        prompt = (system if n % 3 == 0 else []) + [rng.randrange(3, 200) for _ in range(rng.randint(5, 60))]
        arrivals.setdefault(rng.randint(0, 60), []).append((str(n), prompt, rng.randint(2, 12)))
    hasher = block_hasher()
    finished: dict[str, str] = {}
    batch_queue: collections.deque = collections.deque()
    peak, iteration, batches = 0, 0, 2  # vLLM's batch queue under asynchronous scheduling: 2 batches
    try:
        while len(finished) < 24 and iteration < 3000:
            for rid, prompt, max_tokens in arrivals.get(iteration, ()):
                scheduler.add_request(make_request(rid, prompt, max_tokens, hasher))
            iteration += 1
            # EngineCore.step_with_batch_queue: schedule while the queue has room, then take the oldest
            if scheduler.has_requests():
                output = scheduler.schedule()
                worker.execute(output)
                batch_queue.appendleft(output)
                if len(batch_queue) < batches and (output.total_num_scheduled_tokens or scheduler.has_requests()):
                    continue
            elif not batch_queue:
                continue
            output = batch_queue.pop()
            done, model_output = worker.finish()
            assert done is output
            for eco in scheduler.update_from_output(output, model_output).values():
                for o in eco.outputs:
                    if o.finish_reason is not None:
                        finished[o.request_id] = str(o.finish_reason)
            # another model asks for memory: the keeper gives free pages back
            if other.try_grant(4 * BLOCK_BYTES):
                other.release(4 * BLOCK_BYTES)
            pool._keeper_tick()
            worker.check_charge()
            peak = max(peak, budget.held_bytes)
        stats = pool.stats()
    finally:
        pool.close()
        other.leave()
    return dict(finished=finished, released_while_read=worker.released_while_read,
                above_charge=worker.above_charge[:5], num_above_charge=len(worker.above_charge), peak=peak,
                limit=budget.limit, iterations=iteration, blocks_released=stats["blocks_released"],
                releases_sent=stats["releases_sent"], grant_waits=stats["grant_waits"], detached=stats["detached"])


class HostileMember:
    """The engine's membership in a budget in which, while ``hostile`` is set, another member takes one
    block's bytes just before each of the engine's grants: after the engine read the free bytes and
    counted on them, before its grant."""

    def __init__(self, member, taker) -> None:
        self._member = member
        self.taker = taker
        self.hostile = False
        self.taken = 0

    def __getattr__(self, name: str):
        return getattr(self._member, name)

    def try_grant(self, nbytes: int, record_wait: bool = True) -> bool:
        if self.hostile and self.taker.try_grant(BLOCK_BYTES, record_wait=False):
            self.taken += BLOCK_BYTES
        return self._member.try_grant(nbytes, record_wait=record_wait)


def raced_pool(model: str, budget_name: str, label: str) -> tuple:
    """A scheduler of ``model`` whose block pool is under the budget through a :class:`HostileMember`
    labelled ``label`` (another member, ``taker``, takes a block's bytes before each of its grants);
    returns ``(budget, scheduler, taker, hostile, pool)``."""
    import vattn
    from vllm.v1.core.sched.scheduler import Scheduler

    from vattn.integrations.vllm.engine_attach import POOL_ATTRIBUTE
    from vattn.integrations.vllm.engine_budget import BudgetedBlockPool

    budget = vattn.Budget.attach(budget_name)
    scheduler = make_scheduler(make_config(model), 64, Scheduler)
    taker = budget.join("other model")
    hostile = HostileMember(budget.join(label), taker)
    pool = BudgetedBlockPool(scheduler, hostile, budget, BLOCK_BYTES, 1, idle_release_s=1e9)
    setattr(scheduler, POOL_ATTRIBUTE, pool)
    return budget, scheduler, taker, hostile, pool


def race(model: str, budget_name: str) -> dict:
    """A budget of 6 blocks: request "x" (2 blocks) runs and finishes, leaving 2 free blocks with pages;
    then, while another member takes one block's bytes before each of the engine's grants, request "y"
    needs 4 blocks of which at most 2 can have pages; after 5 steps the other member gives everything
    back."""
    budget, scheduler, taker, hostile, pool = raced_pool(model, budget_name, "vllm race")
    hasher = block_hasher()
    finished: dict[str, list] = {}
    error, peak = None, 0
    worker = FakeWorker(scheduler, hostile, random.Random(0), 0.0)
    try:
        for iteration in range(12):
            if iteration == 0:
                scheduler.add_request(make_request("x", list(range(3, 34)), 1, hasher))
            if iteration == 1:
                hostile.hostile = True
                scheduler.add_request(make_request("y", list(range(100, 160)), 1, hasher))
            if iteration == 6:
                hostile.hostile = False
                taker.release(taker.held_bytes)  # the other model's memory comes back
            try:
                output = scheduler.schedule()
            except Exception as e:  # noqa: BLE001 - what the engine core would die of
                error = f"{type(e).__name__}: {e}"
                break
            worker.execute(output)
            output, model_output = worker.finish()
            for eco in scheduler.update_from_output(output, model_output).values():
                for o in eco.outputs:
                    if o.finish_reason is not None:
                        finished[o.request_id] = [str(o.finish_reason), iteration]
            peak = max(peak, budget.held_bytes)
        stats = pool.stats()
    finally:
        pool.close()
        taker.leave()
    return dict(error=error, finished=finished, peak=peak, limit=budget.limit, taken=hostile.taken,
                num_above_charge=len(worker.above_charge), grant_waits=stats["grant_waits"],
                waits_recorded=stats["waits_recorded"], detached=stats["detached"])


def outside(model: str, budget_name: str) -> dict:
    from vattn.integrations.vllm import engine_budget

    engine_budget.GRANT_WAIT_S = 0.5
    budget, scheduler, taker, hostile, pool = raced_pool(model, budget_name, "vllm outside")
    error = None
    try:
        taker.try_grant(budget.available_bytes - 2 * BLOCK_BYTES)
        hostile.hostile = True
        started = time.monotonic()
        try:
            blocks = scheduler.kv_cache_manager.block_pool.get_new_blocks(2)
        except Exception as e:  # noqa: BLE001 - what the engine core would die of
            error, blocks = f"{type(e).__name__}: {e}", []
        waited = time.monotonic() - started
        stats = pool.stats()
    finally:
        pool.close()
        taker.leave()
    return dict(error=error, handed_out=len(blocks), waited_s=waited, detached=stats["detached"],
                grant_waits=stats["grant_waits"], held=budget.held_bytes, limit=budget.limit)


ENGINE_BLOCK = 32  # vLLM-CPU's attention wants a multiple of 32 tokens


def engine_prompts() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(20, 90))] for _ in range(10)]
    return prompts, [rng.randint(20, 60) for _ in prompts]


def with_async_scheduling() -> None:
    """vLLM-CPU's platform turns asynchronous scheduling off in its configuration check: on again after it,
    as on a GPU (vLLM's AsyncScheduler and a batch queue of two)."""
    from vllm.platforms.cpu import CpuPlatform

    stock = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        stock(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def engine(model: str, budget_name: str, scheduling: str) -> dict:
    """``LLM`` with the engine core in this process, greedy fp32, 10 prompts; ``scheduling`` "async" (with
    vattn under ``VATTN_BUDGET``, another member asking for 2 blocks every 0.05 s and holding them 0.3 s
    when granted, the budget's total sampled every 5 ms) or "sync" (stock vLLM)."""

    import vattn

    if scheduling == "async":
        with_async_scheduling()
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_model_len=256, max_num_seqs=4, block_size=ENGINE_BLOCK,
              enable_prefix_caching=True, enforce_eager=True, skip_tokenizer_init=True,
              async_scheduling=scheduling == "async")
    core = llm.llm_engine.engine_core.engine_core
    prompts, max_tokens = engine_prompts()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
    result = dict(scheduler=type(core.scheduler).__name__, batch_queue_size=core.batch_queue_size)
    if scheduling == "sync":
        outs = llm.generate([dict(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return dict(result, tokens=[list(o.outputs[0].token_ids) for o in outs])
    budget = vattn.Budget.attach(budget_name)
    other = budget.join("other model")
    done = threading.Event()
    peak = [0]

    def other_model() -> None:
        want = 2 * ENGINE_BLOCK * TOKEN_BYTES
        while not done.is_set():
            if other.try_grant(want):
                done.wait(0.3)
                other.release(want)
            done.wait(0.05)

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], budget.held_bytes)
            done.wait(0.005)

    threads = [threading.Thread(target=other_model), threading.Thread(target=sample)]
    for t in threads:
        t.start()
    try:
        outs = llm.generate([dict(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        while core.batch_queue:  # the step LLM left queued after its requests finished: its output back
            llm.llm_engine.step()
        busy = core.vattn_budget_stats()
    finally:
        done.set()
        for t in threads:
            t.join()
        other.leave()
    time.sleep(float(os.environ["VATTN_VLLM_IDLE_RELEASE_S"]) + 1.5)  # idle: every free block goes back
    return dict(result, tokens=[list(o.outputs[0].token_ids) for o in outs], peak=peak[0], limit=budget.limit,
                budget=busy, idle=core.vattn_budget_stats(), vattn=llm.collective_rpc("vattn_stats"))


def idle_wait(model: str) -> dict:
    """vllm_budget_waits.py's ``idle-wait`` (one request waiting while another member holds the whole
    budget: the CPU time meanwhile) with asynchronous scheduling on and the engine core in this process.
    Its caller steps the engine until vLLM's batch queue is empty too: ``LLM`` stops stepping once the
    requests finished, leaving the step scheduled after them queued, unconfirmed, until its next call."""
    import vllm_budget_waits

    with_async_scheduling()
    made = []
    stock_make, stock_run = vllm_budget_waits.make_llm, vllm_budget_waits.run_requests

    def make_llm(model: str, engine: dict):
        made.append(stock_make(model, dict(engine, async_scheduling=True)))
        return made[-1]

    def run_requests(llm, prompts: list[list[int]], max_tokens: int) -> dict:
        done = stock_run(llm, prompts, max_tokens)
        while llm.llm_engine.engine_core.engine_core.batch_queue:
            llm.llm_engine.step()
        return done

    vllm_budget_waits.make_llm, vllm_budget_waits.run_requests = make_llm, run_requests
    result = vllm_budget_waits.main("idle-wait", model)
    core = made[0].llm_engine.engine_core.engine_core
    return dict(result, scheduler=type(core.scheduler).__name__, batch_queue_size=core.batch_queue_size)


def exit_without_vattn_threads() -> None:
    """Registered first, so it runs after every exit handler vattn registers (the last registered runs
    first): a vattn thread still running then meets the interpreter's finalization, where a call
    returning into torch's or pybind11's GIL guard aborts the process (docs/design.md "Threads at exit")."""
    alive = [t.name for t in threading.enumerate() if t.name.startswith("vattn") and t.is_alive()]
    if alive:
        print(f"vattn threads still running at exit: {alive}", file=sys.stderr, flush=True)
        os._exit(3)


def main(mode: str, model: str, budget_name: str, *rest: str) -> dict:
    from vattn.integrations.vllm.hooks import install_hooks

    atexit.register(exit_without_vattn_threads)

    if mode == "engine":
        return engine(model, budget_name, *rest)
    if mode == "idle-wait":
        return idle_wait(model)
    install_hooks()
    return dict(overlap=overlap, race=race, outside=outside)[mode](model, budget_name)


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])), flush=True)
