"""The continuous-batching engine against generating each request alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vattn

pytest.importorskip("transformers", reason="needs transformers: pip install -e \".[transformers]\"")

from engine import engine_models  # noqa: E402
from engine.engine_models import VOCAB, alone, tiny_llama  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from vattn.engine import Engine  # noqa: E402

PAGE = 4096


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama(3)


def workload(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    return engine_models.workload(n, seed, prompt_tokens=(3, 60), new_tokens=(1, 30))


@pytest.fixture(scope="module")
def reference(model):
    prompts, news = workload(12, seed=5)
    return prompts, news, [alone(model, p, n) for p, n in zip(prompts, news)]


@pytest.mark.parametrize("options", [
    pytest.param({}, id="defaults"),
    pytest.param({"prefill_chunk_size": 7}, id="chunked-prefill"),
    pytest.param({"layout": "all_layers"}, id="all_layers"),
    pytest.param({"policy": {"background": False, "deferred_reclaim": False, "eager": False}}, id="sync"),
])
def test_outputs_equal_generating_each_request_alone(model, reference, options):
    prompts, news, expected = reference
    with Engine(model, max_batch_size=4, max_context_len=128, page_size=PAGE, **options) as engine:
        assert engine.generate(prompts, max_new_tokens=news) == expected
        assert engine.stats()["preemptions"] == 0
        # requests joined and left at different iterations: fewer iterations than one at a time
        assert engine.iteration < sum(news)
        assert max(h["running"] for h in engine.history) == 4
        assert engine.stats()["reqids_allocated"] == 0
        # one kernel for every layer, chosen for this cache's geometry
        assert engine.stats()["attention_kernel"] == vattn.kernels.KERNELS["host"].name
        k_cache = engine.kv.layer(0)[0]
        assert (engine._case.slice_stride, engine._case.row_stride) == (k_cache.stride(0), k_cache.stride(1))


def test_small_pool_preempts_and_every_output_is_still_right(model, reference):
    prompts, news, expected = reference
    # 24 pages of 4 KiB over 6 buffers: 4 pages per buffer, ~2-4 requests at a time
    with Engine(model, max_batch_size=4, max_context_len=128, page_size=PAGE, physical_memory=24 * PAGE) as engine:
        finished = {}
        for i, (p, n) in enumerate(zip(prompts, news)):
            assert engine.add_request(p, n) == i
        while engine.has_unfinished():
            for out in engine.step():
                assert out.request_id not in finished  # no request finishes twice
                finished[out.request_id] = out
        assert sorted(finished) == list(range(len(prompts)))  # none lost
        assert [finished[i].output for i in range(len(prompts))] == expected
        assert engine.stats()["preemptions"] > 0
        assert sum(out.preemptions for out in finished.values()) == engine.stats()["preemptions"]
        assert all(out.finish_reason == "length" for out in finished.values())


def test_requests_added_while_others_run(model, reference):
    prompts, news, expected = reference
    with Engine(model, max_batch_size=3, max_context_len=128, page_size=PAGE) as engine:
        finished = {}
        pending = list(range(len(prompts)))
        while pending or engine.has_unfinished():
            if pending:  # one new request every other iteration
                if engine.iteration % 2 == 0:
                    i = pending.pop(0)
                    assert engine.add_request(prompts[i], news[i]) == i
            for out in engine.step():
                finished[out.request_id] = out
                assert out.first_token_time is not None and out.arrival_time <= out.first_token_time
        assert [finished[i].output for i in range(len(prompts))] == expected


def test_bad_requests_are_refused_without_disturbing_others(model, reference):
    prompts, news, expected = reference
    with Engine(model, max_batch_size=4, max_context_len=128, page_size=PAGE) as engine:
        for i in range(3):
            engine.add_request(prompts[i], news[i])
        engine.step()
        bad = [
            (ValueError, dict(prompt=[]), "at least one token"),
            (ValueError, dict(prompt=[5] * 129), "max_context_len is 128"),
            (ValueError, dict(prompt=[5, 3], max_new_tokens=0), "max_new_tokens must be an int >= 1"),
            (ValueError, dict(prompt=[5, VOCAB]), r"\[0, 95\]"),
            (ValueError, dict(prompt=[5, -1]), r"\[0, 95\]"),
            (TypeError, dict(prompt=[5, 2.5]), "int token ids"),
            (TypeError, dict(prompt=[5, True]), "not bools"),
            (TypeError, dict(prompt=None), "sequence of int token ids"),
            (TypeError, dict(prompt="ab"), "sequence of int token ids"),
            (ValueError, dict(prompt=[5], temperature=-1.0), "temperature"),
            (ValueError, dict(prompt=[5], temperature=float("inf")), "finite"),
            (ValueError, dict(prompt=[5], temperature=float("nan")), "temperature"),
            (TypeError, dict(prompt=[5], temperature=None), "temperature must be a number"),
            (TypeError, dict(prompt=[5], temperature="0.5"), "temperature must be a number"),
            (ValueError, dict(prompt=[5], top_p=0.0), "top_p"),
            (TypeError, dict(prompt=[5], top_p=None), "top_p must be a number"),
            (TypeError, dict(prompt=[5], seed="x"), "seed must be an int"),
            (TypeError, dict(prompt=[5], seed=1.5), "seed must be an int"),
            (ValueError, dict(prompt=[5], seed=2**64), r"seed must be in \[0, 2\*\*63"),
            (ValueError, dict(prompt=[5], n=0), "n must be an int >= 1"),
        ]
        for exc, kwargs, message in bad:
            with pytest.raises(exc, match=message):
                engine.add_request(**kwargs)
        with pytest.raises(ValueError, match="prompt 1: .*at least one token"):
            engine.generate([[4, 5], []])
        with pytest.raises(TypeError, match="prompt 2: .*int token ids"):
            engine.generate([[4, 5], [6], [7, "x"]])
        with pytest.raises(ValueError, match="prompt 1: max_new_tokens"):
            engine.generate([[4, 5], [6]], max_new_tokens=[3, 0])
        with pytest.raises(TypeError, match="prompts must be"):
            engine.generate(None)
        finished = {}
        while engine.has_unfinished():
            finished.update((o.request_id, o) for o in engine.step())
        assert sorted(finished) == [0, 1, 2]  # the refused requests were never queued
        assert [finished[i].output for i in range(3)] == expected[:3]


def test_context_limit_eos_and_sampling(model):
    prompt = list(range(2, 30))
    with Engine(model, max_batch_size=2, max_context_len=32, page_size=PAGE) as engine:
        rid = engine.add_request(prompt, max_new_tokens=50)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        # 28 prompt tokens + 5 generated: the 5th needs no cache row, a 6th would need row 33
        assert outs[0].request_id == rid and outs[0].finish_reason == "context" and len(outs[0].output) == 5

    greedy = alone(model, prompt, 6)
    stop = greedy.index(greedy[2])  # the first time that token comes out
    model.generation_config.eos_token_id = greedy[2]
    try:
        with Engine(model, max_batch_size=2, max_context_len=64, page_size=PAGE) as engine:
            engine.add_request(prompt, max_new_tokens=6)
            out = []
            while engine.has_unfinished():
                out += engine.step()
            assert out[0].finish_reason == "eos" and out[0].output == greedy[:stop + 1]
    finally:
        model.generation_config.eos_token_id = None

    with Engine(model, max_batch_size=4, max_context_len=64, page_size=PAGE) as engine:
        a = engine.generate([prompt, prompt], max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7)
        b = engine.generate([prompt, prompt], max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7)
        assert a == b  # seeded per request: reproducible
        assert a[0] != a[1]  # seed + i: the two prompts sample differently
        assert all(0 <= t < VOCAB for t in a[0])


def test_a_request_larger_than_the_pool_fails_alone(model):
    with Engine(model, max_batch_size=2, max_context_len=128, page_size=PAGE, physical_memory=6 * PAGE) as engine:
        big = engine.add_request(list(range(2, 90)), max_new_tokens=2)  # 88 tokens need 3 pages per buffer
        small = engine.add_request([3, 4, 5], max_new_tokens=2)
        outs = {}
        while engine.has_unfinished():
            outs.update((o.request_id, o) for o in engine.step())
        assert outs[big].finish_reason == "error" and "physical pool" in outs[big].error
        assert outs[small].finish_reason == "length" and len(outs[small].output) == 2


def test_generate_accepts_generators_and_integer_scalars(model, reference):
    prompts, news, _ = reference
    want = [alone(model, p, news[0]) for p in prompts[:2]]  # before the engine takes the model's attention
    with Engine(model, max_batch_size=4, max_context_len=128, page_size=PAGE) as engine:
        assert engine.generate((p for p in prompts[:2]), max_new_tokens=np.int64(news[0])) == want


def test_close_restores_the_model(model):
    before = model.config._attn_implementation
    engine = Engine(model, max_batch_size=1, max_context_len=32)
    assert model.config._attn_implementation != before
    engine.close()
    engine.close()
    assert model.config._attn_implementation == before and engine.kv.closed
    with pytest.raises(vattn.ClosedError, match="closed"):
        engine.add_request([1, 2])
    with pytest.raises(vattn.ClosedError, match="closed"):
        engine.step()


# ---- shared pages: parallel sampling and the prefix cache ---------------------------


def test_n_completions_share_the_prompt(model, reference):
    prompts, news, expected = reference
    with Engine(model, max_batch_size=9, max_context_len=128, page_size=PAGE) as engine:
        greedy = engine.generate(prompts[:3], max_new_tokens=news[:3], n=3)
        assert greedy == [[want] * 3 for want in expected[:3]]  # greedy: every completion is the n=1 one
        assert engine.kv.stats()["forks"] == 6  # 9 slots: every prompt forked into 2 more completions
        sampled = engine.generate(prompts[:2], max_new_tokens=10, n=4, temperature=1.0, seed=11)
        again = engine.generate(prompts[:2], max_new_tokens=10, n=4, temperature=1.0, seed=11)
        assert sampled == again  # seeded: reproducible
        assert all(len({tuple(c) for c in outs}) > 1 for outs in sampled)  # the completions differ
        assert engine.kv.stats()["reqids_allocated"] == 0


def test_n_completions_under_a_tight_pool(model, reference):
    """Forks whose pages run out are preempted and recomputed; outputs stay right."""
    prompts, news, expected = reference
    with Engine(model, max_batch_size=8, max_context_len=128, page_size=PAGE, physical_memory=24 * PAGE) as engine:
        assert engine.generate(prompts[:4], max_new_tokens=news[:4], n=2) == [[w] * 2 for w in expected[:4]]


@pytest.mark.parametrize("options", [
    pytest.param({}, id="defaults"),
    # all layers in one buffer: 3 layers x 2 heads x 16 x fp32 = 384 bytes per token
    pytest.param({"layout": "all_layers", "prefill_chunk_size": 9, "page_size": 3 * PAGE}, id="all_layers-chunked"),
    pytest.param({"physical_memory": 40 * PAGE}, id="tight-pool"),
])
def test_prefix_cache_outputs_equal_no_cache(model, options):
    g = torch.Generator().manual_seed(3)
    systems = [torch.randint(2, VOCAB, (m,), generator=g).tolist() for m in (40, 57)]
    prompts = [systems[i % 2] + torch.randint(2, VOCAB, (int(t),), generator=g).tolist()
               for i, t in enumerate(torch.randint(1, 20, (8,), generator=g))]
    options = {"page_size": PAGE, **options}
    with Engine(model, max_batch_size=4, max_context_len=128, **options) as engine:
        want = engine.generate(prompts, max_new_tokens=8)
    with Engine(model, max_batch_size=4, max_context_len=128, prefix_cache=True, **options) as engine:
        assert engine.generate(prompts, max_new_tokens=8) == want
        stats = engine.stats()
        page_tokens = engine.kv.page_tokens
        # one query per admission; a tight pool sends some requests back to wait and admits them again
        assert stats["prefix_cache_queries"] >= len(prompts)
        assert stats["prefix_cache_queries"] == len(prompts) or "physical_memory" in options
        # the first batch (4 requests) computes both system prompts side by side; every later
        # prompt finds at least its system prompt's whole pages
        assert stats["prefix_cache_hit_tokens"] >= (len(prompts) - 4) * (40 // page_tokens) * page_tokens > 0
        assert stats["prefix_cache_hit_tokens"] <= stats["prefix_cache_query_tokens"]
    with Engine(model, max_batch_size=4, max_context_len=128, prefix_cache=True, **options) as engine:
        # the same prompt again: everything but the last (partial) page is a hit, and the output is unchanged
        assert engine.generate([prompts[0]], max_new_tokens=8) == [want[0]]
        assert engine.generate([prompts[0]], max_new_tokens=8) == [want[0]]
        assert engine.stats()["prefix_cache_hit_tokens"] > 0


def test_generate_keeps_what_add_request_queued_for_the_next_step(model, reference):
    """Requests queued by add_request run alongside generate; those that finish meanwhile come out of the
    next step (generate dropped them: no later step returned them)."""
    prompts, news, expected = reference
    with Engine(model, max_batch_size=4, max_context_len=128, page_size=PAGE) as engine:
        queued = [engine.add_request(prompts[i], news[i]) for i in range(2)]
        assert engine.generate(prompts[2:4], max_new_tokens=list(news[2:4])) == expected[2:4]
        finished = {}
        while engine.has_unfinished():
            finished.update((out.request_id, out.output) for out in engine.step())
        assert finished == {queued[0]: expected[0], queued[1]: expected[1]}
