"""vLLM runs for the vLLM tests (tests/integrations/test_vllm*.py) and the vLLM benchmarks.

Runs under the interpreter of the vLLM environment (vLLM starts its workers
with spawn, so everything happens under ``__main__``):

    python workloads/vllm_scenario.py make-model DIR [LAYERS HIDDEN [QUERY_HEADS MAX_POSITIONS]]
    python workloads/vllm_scenario.py make-arch DIR ARCHITECTURE   (vllm_models.ARCHITECTURES)
    python workloads/vllm_scenario.py run DIR SPEC.json OUT.json
    python workloads/vllm_scenario.py serve DIR SPEC.json OUT.json

SPEC: ``engine`` (keyword arguments of ``vllm.LLM``: dtype, max_model_len,
max_num_seqs, block_size, enable_prefix_caching, kv_cache_memory_bytes,
tensor_parallel_size, pipeline_parallel_size, enforce_eager (default True),
...) and ``phases``, each ``{"name", "prompts" (token id
lists), "max_tokens" (one per prompt)}``, generated one after the other on one
engine (so later phases can hit what earlier ones cached). vattn is used when
the caller sets VATTN_VLLM=1. ``barrier`` ``{"dir", "parties"}``: after start-up,
wait until that many engines (processes) reached it, so their phases overlap;
``profile``: names of phases whose ``llm.generate`` runs under cProfile (the
engine core in this process): OUT gets per phase the seconds spent in each of
PROFILE_PARTS and the functions with the most time of their own
(``profile_dump``: a folder that also gets each phase's whole profile, ``PHASE.pstats``);
``idle_s``: afterwards, sleep that long and record the worker's stats again
(``vattn_idle``); ``sleep``: afterwards, ``llm.sleep()``, the worker's stats
(``vattn_asleep``), ``llm.wake_up()``. With ``record_usage`` the engine core runs in
this process and the scheduler's blocks in use are recorded at every step,
with the bytes one block holds (the layers of one KV cache group); with
``record_batches`` it runs in this process and each phase gets its forwards'
batches (``batches``: per forward, the requests' computed and scheduled tokens);
``clocks``: each phase gets, per worker, the seconds its forwards spent in
attention, attention metadata and the rest (workloads/forward_clocks.py);
``pad_attention``: a factor above 1, every attention call stretched to that
many times its length by a busy wait that touches no memory, on
``pad_threads`` threads (1 by default; workloads/attention_padding.py).

OUT: per phase the generated ids, seconds, generated tokens, time to first
token of every request, and the phase's prefix-cache hits, queries and
preemptions (vLLM's own counters); the engine's block count and size and KV
bytes per token; the attention backend vLLM selects; with vattn the worker
cache's stats and per-forward series.

``serve`` (the multi-model benchmark) replays a timed trace instead of phases:
SPEC ``engine``, ``warmup`` (prompts generated before the start), ``requests``
(``{"arrival_s", "prompt", "max_tokens"}``, seconds after the common start) and
``start`` ``{"dir", "parties"}``: every engine writes a ready file there after
its warm-up; once all are ready, each starts its clock 0.5 s after the last
ready file was written, so the engines' traces share one clock. The engine
core runs in this process and is stepped here; a request is added when its
arrival time has passed. OUT: per request its output ids, time to first
token and to finish (seconds after its arrival), and its arrival; the start
(time.time()); the scheduler's blocks in use at every step (seconds since the
start); preemptions.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time


def make_model(path: str, layers: int = 2, hidden: int = 128, query_heads: int = 4, max_positions: int = 1024) -> None:
    """A small random-weight Llama with GQA (``query_heads`` query heads, 2 KV
    heads of hidden / query_heads), bf16, vocabulary 256 and no tokenizer (the
    scenarios pass token ids): ``python -m vattn make-model``'s model
    (vattn/cli/make_model.py), at the tests' sizes."""
    from vattn.cli.make_model import make_model as make

    make(path, "llama", layers=layers, hidden=hidden, query_heads=query_heads, kv_heads=2,
         max_positions=max_positions, vocab_size=256, tokenizer=False)


def counter(llm, name: str) -> int:
    return int(sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name))


class UsageRecorder:
    """The scheduler's blocks in use (held by requests) after every schedule()."""

    def __init__(self) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler

        self.series: list[tuple[float, int]] = []  # (time.monotonic(), blocks in use)
        self.block_bytes = 0  # bytes one block id holds: K and V of one KV cache group's layers
        self.scheduler = None
        original = Scheduler.schedule
        recorder = self

        def schedule(scheduler, *args, **kwargs):
            out = original(scheduler, *args, **kwargs)
            recorder.scheduler = scheduler
            recorder.sample()
            return out

        Scheduler.schedule = schedule

    def sample(self) -> None:
        """Records the blocks in use now (also called by ``serve`` when the engine has gone idle)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        # the free queue itself: under a budget get_num_free_blocks() counts what can be granted instead
        self.series.append((time.monotonic(), pool.num_gpu_blocks - 1 - pool.free_block_queue.num_free_blocks))
        self.block_bytes = max(len(g.layer_names) * g.kv_cache_spec.page_size_bytes
                               for g in self.scheduler.kv_cache_config.kv_cache_groups)


class BatchRecorder:
    """Every forward's batch as the scheduler sent it: per request, the tokens
    already computed and the tokens scheduled now (a prefill chunk, or 1 for a
    decode), in the scheduler's order; ``take()`` hands over what was recorded
    since it was last called."""

    def __init__(self) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler

        self.batches: list[list[list[int]]] = []
        original = Scheduler.schedule
        recorder = self

        def schedule(scheduler, *args, **kwargs):
            out = original(scheduler, *args, **kwargs)
            scheduled = out.num_scheduled_tokens
            if scheduled:  # schedule() has already counted the scheduled tokens as computed
                recorder.batches.append([[scheduler.requests[r].num_computed_tokens - n for r, n in scheduled.items()],
                                         list(scheduled.values())])
            return out

        Scheduler.schedule = schedule

    def take(self) -> list[list[list[int]]]:
        batches, self.batches = self.batches, []
        return batches


PROFILE_PARTS = {  # part of a forward -> (file name ending, function) whose cumulative time it is
    "attention layers (kernel and cache write)": [("backends/cpu_attn.py", "forward"),
                                                  ("vattn/integrations/vllm/attention.py", "forward")],
    "attention metadata": [("backends/cpu_attn.py", "build"), ("vattn/integrations/vllm/attention.py", "build")],
    "vattn mapping": [("vattn/integrations/vllm/worker_cache.py", "map_forward")],
    "model runner step (inputs, metadata, forward)": [("v1/worker/gpu_model_runner.py", "execute_model")],
    "model forward (the layers)": [("v1/worker/gpu_model_runner.py", "_model_forward")],
    "scheduler": [("v1/core/sched/scheduler.py", "schedule")],
}


def profile_summary(profiler, seconds: float, top: int = 15) -> dict:
    """Seconds per part of PROFILE_PARTS (each a function that does not call itself: its
    cumulative time; a match called by another match of the same part is inside it, not
    added again) and the ``top`` functions by time of their own."""
    import pstats

    stats = pstats.Stats(profiler).stats  # (file, line, function) -> (calls, primitive, own, cumulative, callers)
    parts = {}
    for part, places in PROFILE_PARTS.items():
        def matches(where: tuple) -> bool:
            return any(where[0].endswith(end) and where[2] == name for end, name in places)

        parts[part] = sum(cum for where, (_, _, _, cum, callers) in stats.items()
                          if matches(where) and not any(matches(caller) for caller in callers))
    own = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {"generate_s": seconds, "parts_s": parts,
            "top_own_s": [(f"{os.path.basename(file)}:{line}:{func}", round(tt, 4), calls)
                          for (file, line, func), (calls, _, tt, _, _) in own]}


def wait_for_parties(dir: str, parties: int, timeout_s: float = 300) -> None:
    """A barrier between processes: one file per arrival in ``dir``."""
    open(os.path.join(dir, f"arrived-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while sum(n.startswith("arrived-") for n in os.listdir(dir)) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{parties} engines did not all start within {timeout_s} s")
        time.sleep(0.05)


def attention_backend(config, head_dim: int) -> str:
    """The attention backend class vLLM's selector picks for this model (the
    plugin, when switched on, registers its own), as ``module.ClassName``."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    with set_current_vllm_config(config):
        backend = get_attn_backend(head_dim, config.model_config.dtype, config.cache_config.cache_dtype)
    return f"{backend.__module__}.{backend.__name__}"


def make_llm(model: str, engine: dict):
    """``vllm.LLM`` with the scenarios' defaults (no tokenizer, eager, stats on) under ``engine``'s arguments."""
    from vllm import LLM

    return LLM(model=model, **dict(dict(skip_tokenizer_init=True, enforce_eager=True, disable_log_stats=False),
                                   **engine))


def budget_stats(llm):
    """The engine core's budget counters (vattn/integrations/vllm/engine_budget.py), wherever it runs; None
    outside a budget."""
    client = llm.llm_engine.engine_core
    if hasattr(client, "call_utility"):
        return client.call_utility("vattn_budget_stats")
    return client.engine_core.vattn_budget_stats()


def greedy(max_tokens: int):
    """Sampling parameters of every scenario request: greedy, exactly ``max_tokens`` tokens."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def run(model: str, spec: dict) -> dict:
    recorder = None
    if spec.get("record_usage") or spec.get("profile") or spec.get("record_batches"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler (and the worker) in this process
    if spec.get("record_usage"):
        recorder = UsageRecorder()
    batches = BatchRecorder() if spec.get("record_batches") else None
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = make_llm(model, spec["engine"])
    result: dict = {"startup_s": time.perf_counter() - start, "phases": {}}
    if spec.get("pad_attention"):  # before the clocks, so that the wait counts as attention
        import attention_padding  # workloads/attention_padding.py

        llm.collective_rpc(attention_padding.install, args=(spec["pad_attention"], spec.get("pad_threads", 1)))
    clocks = None
    if spec.get("clocks"):
        import forward_clocks as clocks  # workloads/forward_clocks.py (this script's folder is on sys.path)

        llm.collective_rpc(clocks.install)
    if spec.get("barrier"):
        wait_for_parties(**spec["barrier"])
    for phase in spec["phases"]:
        before = {n: counter(llm, n) for n in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries",
                                               "vllm:num_preemptions")}
        prompts = [TokensPrompt(prompt_token_ids=p) for p in phase["prompts"]]
        params = [greedy(n) for n in phase["max_tokens"]]
        if batches is not None:
            batches.take()  # start-up's and earlier phases' forwards
        profiler = None
        if phase["name"] in spec.get("profile", ()):
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        if clocks is not None:
            llm.collective_rpc(clocks.take)  # what earlier phases left on the clocks
        modules, usage = set(sys.modules), resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False)
        t1 = time.monotonic()
        usage_after = resource.getrusage(resource.RUSAGE_SELF)
        if profiler is not None:
            profiler.disable()
            result.setdefault("profile", {})[phase["name"]] = profile_summary(profiler, t1 - t0)
            if spec.get("profile_dump"):  # the whole profile, for pstats: DIR/<phase>.pstats
                profiler.dump_stats(os.path.join(spec["profile_dump"], f"{phase['name']}.pstats"))
        result["phases"][phase["name"]] = {
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "start": t0,
            "generate_s": t1 - t0,
            "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "ttft_s": [o.metrics.first_token_latency if o.metrics else None for o in outs],
            "prefix_cache_hits": counter(llm, "vllm:prefix_cache_hits") - before["vllm:prefix_cache_hits"],
            "prefix_cache_queries": counter(llm, "vllm:prefix_cache_queries") - before["vllm:prefix_cache_queries"],
            "preemptions": counter(llm, "vllm:num_preemptions") - before["vllm:num_preemptions"],
            # what this process paid during the phase beside the forwards' work (its threads; in vLLM's
            # default layout the engine core's process is another): first-use costs show here
            "modules_imported": sorted(set(sys.modules) - modules),
            "minor_faults": usage_after.ru_minflt - usage.ru_minflt,
            "major_faults": usage_after.ru_majflt - usage.ru_majflt,
            "cpu_s": (usage_after.ru_utime + usage_after.ru_stime) - (usage.ru_utime + usage.ru_stime),
        }
        if batches is not None:
            result["phases"][phase["name"]]["batches"] = batches.take()
        if clocks is not None:  # per worker (rank)
            result["phases"][phase["name"]]["forward_clocks"] = llm.collective_rpc(clocks.take)
    if spec.get("sleep"):
        llm.sleep()
        time.sleep(spec.get("sleep_settle_s", 0.5))  # the engine core's release runs as its next step
        result["vattn_asleep"] = llm.collective_rpc("vattn_stats")
        result["budget_asleep"] = budget_stats(llm)
        llm.wake_up()
    if spec.get("idle_s"):
        time.sleep(spec["idle_s"])
        result["vattn_idle"] = llm.collective_rpc("vattn_stats")
        result["budget_idle"] = budget_stats(llm)
    config = llm.llm_engine.vllm_config
    model_config = config.model_config
    head_dim = model_config.get_head_size()
    per_token = (2 * model_config.hf_text_config.num_hidden_layers * model_config.get_total_num_kv_heads()
                 * head_dim * model_config.dtype.itemsize)
    cache = config.cache_config
    result.update(
        num_blocks=cache.num_gpu_blocks,
        block_size=cache.block_size,
        enable_prefix_caching=cache.enable_prefix_caching,
        kv_bytes_per_token=per_token,  # K and V of every layer, all ranks
        block_bytes=cache.block_size * per_token,
        kv_bytes_allocated=cache.num_gpu_blocks * cache.block_size * per_token,
        usage_series=recorder.series if recorder else None,
        usage_block_bytes=recorder.block_bytes if recorder else None,
        attention_backend=attention_backend(config, head_dim),
        vattn=llm.collective_rpc("vattn_stats") if os.environ.get("VATTN_VLLM") == "1" else None,
        budget=budget_stats(llm) if os.environ.get("VATTN_BUDGET") else None,
    )
    return result


def start_clock(dir: str, parties: int) -> float:
    """The common start of the engines' traces (time.time()): 0.5 s after the last one was ready."""
    wait_for_parties(dir, parties)
    return max(os.stat(os.path.join(dir, n)).st_mtime for n in os.listdir(dir) if n.startswith("arrived-")) + 0.5


def serve(model: str, spec: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core (and a budget's scheduler) in this process
    recorder = UsageRecorder()
    from vllm.inputs import TokensPrompt

    llm = make_llm(model, spec["engine"])
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["warmup"]], greedy(4), use_tqdm=False)
    engine = llm.llm_engine
    requests = sorted(enumerate(spec["requests"]), key=lambda r: r[1]["arrival_s"])
    first, done, outputs = {}, {}, {}
    preempted_before = counter(llm, "vllm:num_preemptions")
    del recorder.series[:]
    start = start_clock(**spec["start"])
    while time.time() < start:
        time.sleep(0.001)
    t0 = time.monotonic() - (time.time() - start)  # the common start on this process's monotonic clock
    pending = 0
    while pending < len(requests) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while pending < len(requests) and requests[pending][1]["arrival_s"] <= now:
            i, r = requests[pending]
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=r["prompt"]), greedy(r["max_tokens"]))
            pending += 1
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, requests[pending][1]["arrival_s"] - now)))
            continue
        for out in engine.step():
            i = int(out.request_id)
            now = time.monotonic() - t0
            if out.outputs and out.outputs[0].token_ids and i not in first:
                first[i] = now
            if out.finished:
                done[i], outputs[i] = now, list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            recorder.sample()  # idle: the last schedule() saw the finished requests' blocks
    return {
        "start_unix": start,
        "requests": [{"arrival_s": r["arrival_s"], "ttft_s": first[i] - r["arrival_s"],
                      "finish_s": done[i] - r["arrival_s"], "generated_tokens": len(outputs[i]),
                      "outputs": outputs[i]} for i, r in enumerate(spec["requests"])],
        "preemptions": counter(llm, "vllm:num_preemptions") - preempted_before,
        "usage_series": [(round(t - t0, 4), blocks) for t, blocks in recorder.series],
        "usage_block_bytes": recorder.block_bytes,
        "num_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        "vattn": llm.collective_rpc("vattn_stats") if os.environ.get("VATTN_VLLM") == "1" else None,
    }


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        make_model(sys.argv[2], *map(int, sys.argv[3:7]))
    elif sys.argv[1] == "make-arch":
        import vllm_models  # workloads/vllm_models.py: a script's own folder is first on sys.path

        vllm_models.make(sys.argv[3], sys.argv[2])
    else:
        command, model_dir, spec_path, out_path = sys.argv[1:]
        with open(spec_path) as f:
            spec = json.load(f)
        result = serve(model_dir, spec) if command == "serve" else run(model_dir, spec)
        with open(out_path, "w") as f:
            json.dump(result, f)
