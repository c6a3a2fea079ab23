"""workloads/forward_clocks.py: the worker's clocks count every clocked call
once, in its part, and the rest is the step less attention and metadata."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from workloads import forward_clocks


class Impl:
    def forward(self, *args):
        time.sleep(0.002)
        return "out"

    def do_kv_cache_update(self, *args):
        time.sleep(0.001)


class Builder:
    def build(self, *args):
        time.sleep(0.001)
        return "metadata"


class Runner:
    def __init__(self, layers: int) -> None:
        self.layers = [SimpleNamespace(impl=Impl()) for _ in range(layers)]
        context = {f"layer.{i}": layer for i, layer in enumerate(self.layers)}
        context["no_attention"] = SimpleNamespace()  # other static-context entries have no impl
        self.compilation_config = SimpleNamespace(static_forward_context=context)
        self.builder = Builder()
        self.attn_groups = [[SimpleNamespace(metadata_builders=[self.builder])]]

    def execute_model(self):
        assert self.builder.build() == "metadata"
        for layer in self.layers:
            layer.impl.do_kv_cache_update()
            assert layer.impl.forward() == "out"
        time.sleep(0.003)  # the rest of the model

    def sample_tokens(self):
        time.sleep(0.001)


def test_each_part_counts_its_calls_and_the_rest_is_what_remains():
    worker = SimpleNamespace(model_runner=Runner(layers=3))
    assert forward_clocks.install(worker) == 3
    for _ in range(2):
        worker.model_runner.execute_model()
        worker.model_runner.sample_tokens()
    parts = forward_clocks.take(worker)
    assert parts["step_calls"] == 4 and parts["attention_calls"] == 12 and parts["metadata_calls"] == 2
    assert parts["attention_s"] >= 2 * 3 * 0.003 and parts["metadata_s"] >= 2 * 0.001
    assert parts["rest_s"] == pytest.approx(parts["step_s"] - parts["attention_s"] - parts["metadata_s"])
    assert parts["rest_s"] >= 2 * (0.003 + 0.001)
    assert forward_clocks.take(worker)["step_calls"] == 0  # taken: reset


def test_installing_twice_is_refused():
    worker = SimpleNamespace(model_runner=Runner(layers=1))
    forward_clocks.install(worker)
    with pytest.raises(RuntimeError, match="already installed"):
        forward_clocks.install(worker)
