"""What both pipelines of benchmarks/multi_model.py share (the engines in
the benchmark's process, benchmarks/multi_model.py; API servers,
benchmarks/multi_model_serve.py): the engines' settings, a process's
resident memory, and one configuration's outcome from its engines' requests
and the memory samples taken while they served."""

from __future__ import annotations

import statistics

MiB = 1 << 20
BLOCK = 128  # vLLM-CPU's default block size (tokens)
MAX_MODEL_LEN = 2048
SAMPLE_S = 0.05  # memory sampling interval


def read_rss(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssShmem of a process, bytes (empty once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "RssAnon", "RssShmem"):
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def late_bursts(requests: list[dict], period_s: float) -> list[int]:
    """The bursts (numbers) whose last answer came after the next burst began
    (``period_s`` after its own start; every burst starts at 1 + j * period_s)."""
    last: dict[int, float] = {}
    for r in requests:
        last[r["burst"]] = max(last.get(r["burst"], 0.0), r["arrival_s"] + r["finish_s"])
    return sorted(j for j, t in last.items() if t > 1.0 + (j + 1) * period_s)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def burst_throughput(requests: list[dict]) -> float:
    """Generated tokens over the seconds from a burst's first arrival to its last answer, mean over bursts."""
    bursts: dict[int, list[dict]] = {}
    for r in requests:
        bursts.setdefault(r["burst"], []).append(r)
    rates = []
    for rs in bursts.values():
        first = min(r["arrival_s"] for r in rs)
        last = max(r["arrival_s"] + r["finish_s"] for r in rs)
        rates.append(sum(r["generated_tokens"] for r in rs) / (last - first))
    return statistics.fmean(rates)


def run_outcome(models: list[tuple], engines: list[dict], samples: list[dict], start_unix: float, budgeted: bool,
                budget_bytes: int, period_s: float) -> dict:
    """One configuration's engines and memory series (from the sampler's ``samples``), its lines printed."""
    memory = {"t_s": [round(s["unix"] - start_unix, 3) for s in samples],
              "rss_bytes": [sum(r.get("VmRSS", 0) for r in s["rss"]) for s in samples],
              "rss_shmem_bytes": [sum(r.get("RssShmem", 0) for r in s["rss"]) for s in samples]}
    if budgeted:
        memory["budget_held_bytes"] = [sum(s["budget_held"]) for s in samples]
        memory["budget_held_bytes_per_model"] = [[s["budget_held"][i] for s in samples] for i in range(len(models))]
    for (name, *_), e in zip(models, engines):
        ttft = [q["ttft_s"] for q in e["requests"]]
        late = late_bursts(e["requests"], period_s)
        print(f"  {name:12s} TTFT mean {statistics.fmean(ttft):.2f} s, p99 {percentile(ttft, 99):.2f} s, "
              f"{burst_throughput(e['requests']):.0f} tokens/s per burst, {e['preemptions']} preemptions"
              + (f", bursts {late} still served when the next burst began" if late else ""), flush=True)
    if budgeted:
        print(f"  budget held at most {max(memory['budget_held_bytes'], default=0) / MiB:.1f} MiB "
              f"of {budget_bytes / MiB:.1f} MiB", flush=True)
    return {"engines": engines, "memory": memory}
