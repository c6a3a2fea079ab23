"""workloads/forward_clocks.py: the worker's clocks count every clocked call
once, in its part, and the rest is the step less attention and metadata; in
an eager run the attention layers' whole calls are clocked too."""

from __future__ import annotations

import gc
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


class Layer:
    """vLLM's Attention layer: its own work (output allocation, op dispatch) around the impl's calls."""

    def __init__(self) -> None:
        self.impl = Impl()

    def forward(self):
        time.sleep(0.001)
        self.impl.do_kv_cache_update()
        return self.impl.forward()


class Runner:
    def __init__(self, layers: int, eager: bool = False) -> None:
        self.layers = [Layer() for _ in range(layers)]
        self.model_config = SimpleNamespace(enforce_eager=eager)
        context = {f"layer.{i}": layer for i, layer in enumerate(self.layers)}
        context["no_attention"] = SimpleNamespace()  # other static-context entries have no impl
        self.compilation_config = SimpleNamespace(static_forward_context=context)
        self.builder = Builder()
        self.attn_groups = [[SimpleNamespace(metadata_builders=[self.builder])]]

    def execute_model(self):
        assert self.builder.build() == "metadata"
        for layer in self.layers:
            assert layer.forward() == "out"
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
    assert parts["layer_calls"] == 0 and "outside_layers_s" not in parts  # not eager: layers not clocked
    # sleeping is wall time, not CPU time: the thread's CPU clock barely moves
    assert 0.0 <= parts["rest_cpu_s"] < parts["rest_s"] / 2
    assert 0.0 <= parts["attention_cpu_s"] < parts["attention_s"] / 2
    assert parts["step_involuntary_switches"] >= 0


class BusyRunner(Runner):
    """A runner whose rest of the model computes for 20 ms of its thread's CPU time."""

    def execute_model(self):
        super().execute_model()
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass


def test_the_rests_cpu_time_counts_the_steps_own_work():
    worker = SimpleNamespace(model_runner=BusyRunner(layers=1))
    forward_clocks.install(worker)
    worker.model_runner.execute_model()
    parts = forward_clocks.take(worker)
    assert 0.02 <= parts["rest_cpu_s"] <= parts["rest_s"] + 1e-3
    assert parts["step_cpu_s"] == pytest.approx(parts["rest_cpu_s"] + parts["attention_cpu_s"] + parts["metadata_cpu_s"])


def test_an_eager_run_clocks_the_attention_layers_whole_calls():
    worker = SimpleNamespace(model_runner=Runner(layers=3, eager=True))
    assert forward_clocks.install(worker) == 3
    worker.model_runner.execute_model()
    worker.model_runner.sample_tokens()
    parts = forward_clocks.take(worker)
    assert parts["layer_calls"] == 3 and parts["attention_calls"] == 6
    # a layer's call holds its impl's calls and its own work (1 ms a layer here)
    assert parts["layer_s"] >= parts["attention_s"] + 3 * 0.001
    assert parts["outside_layers_s"] == pytest.approx(parts["step_s"] - parts["layer_s"] - parts["metadata_s"])
    assert parts["outside_layers_s"] >= 0.003 + 0.001 and parts["outside_layers_s"] < parts["rest_s"]


def test_installing_twice_is_refused():
    worker = SimpleNamespace(model_runner=Runner(layers=1))
    forward_clocks.install(worker)
    with pytest.raises(RuntimeError, match="already installed"):
        forward_clocks.install(worker)


class CollectingRunner(Runner):
    """A runner whose rest of the model runs a full garbage collection over 20,000 objects in cycles."""

    def execute_model(self):
        super().execute_model()
        garbage = [[] for _ in range(20000)]
        for item in garbage:
            item.append(item)
        del garbage, item
        gc.collect()


def test_garbage_collections_inside_a_step_are_counted_apart():
    worker = SimpleNamespace(model_runner=CollectingRunner(layers=1))
    forward_clocks.install(worker)
    worker.model_runner.execute_model()
    gc.collect(0)  # outside any step: in the process's total only
    parts = forward_clocks.take(worker)
    assert parts["gc_full_collections"] >= 1 and parts["gc_collections"] >= 2
    assert 0.0 < parts["step_gc_s"] < parts["gc_s"] and parts["step_gc_s"] <= parts["rest_s"]
    assert forward_clocks.take(worker)["gc_s"] == 0.0  # taken: reset
