"""benchmarks/engine_e2e.py's warm-up of transformers' caches: on CUDA, where
``generate`` compiles a StaticCache's decode step for each group's shape, every
group runs once untimed as it will run timed, so the timed run holds no
compilation; on the CPU, where nothing compiles, one short call."""

from __future__ import annotations

import torch
from conftest import load_benchmark

e2e = load_benchmark("engine_e2e")


def test_on_cuda_every_group_is_warmed_as_it_will_run_and_on_the_cpu_one_short_call():
    groups = [[[1, 2, 3], [4, 5]], [[6, 7, 8, 9]], [[10]]]
    assert e2e.warmup_calls(groups, 64, torch.device("cuda")) == [(g, 64) for g in groups]
    assert e2e.warmup_calls(groups, 64, torch.device("cpu")) == [(groups[0], 2)]
