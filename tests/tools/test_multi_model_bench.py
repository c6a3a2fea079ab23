"""The arithmetic of benchmarks/multi_model.py (the engines themselves run in
the benchmark, not here): the trace alternates bursts between the models, B
fits the largest burst at full length, the schedulers' blocks in use add up
across engines step by step, and throughput is taken per burst."""

from __future__ import annotations

import pytest

from conftest import load_benchmark

multi_model = load_benchmark("multi_model")


def test_bursts_alternate_between_the_models_and_arrive_within_half_a_second():
    trace = multi_model.make_trace(k=3, bursts=7, burst_requests=5, period_s=6.0, seed=1)
    assert [len(reqs) for reqs in trace] == [15, 10, 10]  # bursts 0, 3, 6 / 1, 4 / 2, 5
    for model, reqs in enumerate(trace):
        assert {r["burst"] for r in reqs} == set(range(model, 7, 3))
        for r in reqs:
            start = 1.0 + r["burst"] * 6.0
            assert start <= r["arrival_s"] <= start + 0.5
            assert multi_model.PROMPT_TOKENS[0] <= len(r["prompt"]) <= multi_model.PROMPT_TOKENS[1]
            assert multi_model.OUTPUT_TOKENS[0] <= r["max_tokens"] <= multi_model.OUTPUT_TOKENS[1]
    assert trace == multi_model.make_trace(k=3, bursts=7, burst_requests=5, period_s=6.0, seed=1)
    assert trace != multi_model.make_trace(k=3, bursts=7, burst_requests=5, period_s=6.0, seed=2)


def test_a_burst_at_full_length_counts_whole_blocks():
    block = multi_model.BLOCK
    requests = [dict(prompt=[0] * (block - 10), max_tokens=10),  # exactly one block
                dict(prompt=[0] * block, max_tokens=1)]  # one token into a second block
    per_token = multi_model.kv_bytes_per_token(4)
    assert per_token == 2 * 4 * 2 * 64 * 2
    assert multi_model.burst_peak_bytes(requests, 4) == 3 * block * per_token


def test_blocks_in_use_add_up_across_engines_at_every_step():
    engines = [dict(usage_block_bytes=10, usage_series=[(0.0, 1), (2.0, 3), (4.0, 0)]),
               dict(usage_block_bytes=100, usage_series=[(1.0, 2), (3.0, 0)])]
    out = multi_model.blocks_in_use(engines)
    assert out["blocks_in_use_t_s"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert out["blocks_in_use_bytes"] == [10, 210, 230, 30, 0]


def test_throughput_is_per_burst_from_first_arrival_to_last_answer():
    requests = [dict(burst=0, arrival_s=1.0, finish_s=1.0, generated_tokens=10),
                dict(burst=0, arrival_s=1.5, finish_s=1.5, generated_tokens=30),  # answered at 3.0
                dict(burst=2, arrival_s=10.0, finish_s=4.0, generated_tokens=8)]
    assert multi_model.burst_throughput(requests) == pytest.approx((40 / 2.0 + 8 / 4.0) / 2)
    assert multi_model.percentile([3.0, 1.0, 2.0], 99) == 3.0
    assert multi_model.percentile([float(i) for i in range(100)], 99) == 99.0
    assert multi_model.percentile([float(i) for i in range(200)], 50) == 100.0
