"""VAttnCache against transformers' DynamicCache on small random-weight models."""

from __future__ import annotations

import gc

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e \".[transformers]\"")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import vattn  # noqa: E402
from vattn.integrations.transformers import VAttnCache  # noqa: E402

PAGE = 4096  # small pages, so generation crosses many page boundaries
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=None)


def llama(attn: str = "sdpa", kv_heads: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(num_key_value_heads=kv_heads, **SMALL)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation(attn)
    return model


def qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **SMALL)).eval()


MODELS = {
    "llama-gqa-sdpa": lambda: llama("sdpa"),
    "llama-gqa-eager": lambda: llama("eager"),
    "llama-mha": lambda: llama("sdpa", kv_heads=4),
    "qwen2-gqa": qwen2,
}


def prompts(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded token ids and attention mask for prompts of these lengths."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(2, SMALL["vocab_size"], (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


def generate(model, cache, ids, mask, new_tokens=24, **kwargs) -> torch.Tensor:
    return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                          do_sample=False, **kwargs)


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
@pytest.mark.parametrize("lengths", [[17], [5, 40, 23]], ids=["single", "left-padded"])
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_equals_dynamic_cache(name, lengths, layout):
    model = MODELS[name]()
    ids, mask = prompts(lengths)
    expected = generate(model, DynamicCache(config=model.config), ids, mask)
    with VAttnCache.from_model(model, max_batch_size=4, max_context_len=128, page_size=PAGE,
                               layout=layout) as cache:
        got = generate(model, cache, ids, mask)
        assert cache.get_seq_length() == ids.shape[1] + 24 - 1
    assert torch.equal(got, expected)


def test_sampling_equals_dynamic_cache():
    model = llama()
    ids, mask = prompts([9, 30])
    sample = dict(do_sample=True, temperature=0.8, top_p=0.9)
    torch.manual_seed(123)
    expected = model.generate(ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config),
                              max_new_tokens=30, **sample)
    with VAttnCache.from_model(model, max_batch_size=2, max_context_len=128, page_size=PAGE) as cache:
        torch.manual_seed(123)
        got = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=30, **sample)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_mapped_memory_follows_tokens_held(layout):
    model = llama()
    batch, max_len = 3, 512
    ids, mask = prompts([20, 61, 33])
    with VAttnCache.from_model(model, max_batch_size=8, max_context_len=max_len, page_size=PAGE,
                               layout=layout) as cache:
        generate(model, cache, ids, mask, new_tokens=40)
        cache.manager.wait_idle()
        held = cache.get_seq_length()  # tokens per row, padding included
        cfg = cache.manager.config
        pages_needed = -(-held * cfg.token_bytes_per_buffer // PAGE)
        stats = cache.stats()
        per_row_buffer = stats["pages_mapped"] / (batch * cfg.num_buffers)
        # exactly the pages for the tokens held, plus at most one (the mapper's lookahead)
        assert pages_needed <= per_row_buffer <= pages_needed + 1
        for row in range(batch, 8):
            assert cache.manager.mapped_tokens(row) == 0  # rows the batch does not use hold nothing
        assert stats["bytes_mapped"] * 4 < stats["bytes_static"]


def test_forward_loop_equals_dynamic_cache():
    """A hand-written prefill + decode loop, logits compared step by step."""
    model = llama()
    ids, _ = prompts([12, 12])

    def run(cache) -> list[torch.Tensor]:
        logits, tokens = [], ids
        for _ in range(20):
            out = model(tokens, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            tokens = out.logits[:, -1:].argmax(-1)
        return logits

    expected = run(DynamicCache(config=model.config))
    with VAttnCache.from_model(model, max_batch_size=2, max_context_len=64, page_size=PAGE) as cache:
        got = run(cache)
        assert cache.get_seq_length() == 12 + 19
        k, v = cache.layers[0].keys, cache.layers[0].values
        assert k.shape == (2, 2, 31, 16) and v.shape == k.shape  # only the filled rows
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op,arg", [("reorder_cache", [1, 0, 0]), ("batch_select_indices", [2, 0]),
                                    ("batch_repeat_interleave", 2)])
def test_batch_reshaping_matches_dynamic_cache(op, arg):
    model = llama()
    ids, mask = prompts([7, 11, 9])
    dynamic = DynamicCache(config=model.config)
    with VAttnCache.from_model(model, max_batch_size=6, max_context_len=64, page_size=PAGE) as cache:
        for c in (dynamic, cache):
            model(ids, attention_mask=mask, past_key_values=c, use_cache=True)
            getattr(c, op)(torch.tensor(arg) if isinstance(arg, list) else arg)
        for layer_d, layer_v in zip(dynamic.layers, cache.layers):
            assert torch.equal(layer_v.keys, layer_d.keys)
            assert torch.equal(layer_v.values, layer_d.values)
        # the reshaped cache keeps generating like the reshaped DynamicCache
        token = torch.full((layer_d.keys.shape[0], 1), 5)
        a = model(token, past_key_values=dynamic, use_cache=True).logits
        b = model(token, past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_reset_reuses_the_cache_for_a_new_batch():
    model = llama()
    with VAttnCache.from_model(model, max_batch_size=4, max_context_len=128, page_size=PAGE) as cache:
        for lengths in ([30, 8, 15, 22], [6, 19]):
            ids, mask = prompts(lengths, seed=len(lengths))
            expected = generate(model, DynamicCache(config=model.config), ids, mask)
            cache.reset()
            assert torch.equal(generate(model, cache, ids, mask), expected)
        with pytest.raises(ValueError, match="holds a batch of 2"):
            model(torch.ones(3, 1, dtype=torch.long), past_key_values=cache, use_cache=True)


def test_errors_name_the_limit_and_leave_the_cache_usable():
    model = llama()
    with VAttnCache.from_model(model, max_batch_size=2, max_context_len=32, page_size=PAGE) as cache:
        with pytest.raises(ValueError, match="max_batch_size"):
            model(torch.ones(3, 4, dtype=torch.long), past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="max_context_len=32"):
            model(torch.ones(1, 33, dtype=torch.long), past_key_values=cache, use_cache=True)
        cache.reset()
        ids, mask = prompts([10])
        expected = generate(model, DynamicCache(config=model.config), ids, mask, new_tokens=8)
        assert torch.equal(generate(model, cache, ids, mask, new_tokens=8), expected)
    with VAttnCache.from_model(model, max_batch_size=2, max_context_len=256, page_size=PAGE,
                               physical_memory=8 * PAGE) as cache:
        with pytest.raises(vattn.OutOfPages, match="physical_memory"):
            model(torch.ones(2, 200, dtype=torch.long), past_key_values=cache, use_cache=True)
    with VAttnCache.from_model(model, max_batch_size=1, max_context_len=32, dtype=torch.float16) as cache:
        with pytest.raises(TypeError, match="float16"):
            model(torch.ones(1, 4, dtype=torch.long), past_key_values=cache, use_cache=True)


def test_from_model_reads_the_config():
    model = qwen2()
    with VAttnCache.from_model(model, max_batch_size=3, max_context_len=100) as cache:
        cfg = cache.manager.config
        assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype) == (3, 2, 16, torch.float32)
        assert (cfg.max_batch_size, cfg.max_context_len) == (3, 100)
        assert len(cache.layers) == 3 and cache.get_max_length() == 100


def test_close_and_garbage_collection_release_the_manager():
    model = llama()
    cache = VAttnCache.from_model(model, max_batch_size=1, max_context_len=64)
    manager = cache.manager
    cache.close()
    cache.close()  # idempotent
    assert cache.closed and manager.closed
    with pytest.raises(vattn.ClosedError):
        model(torch.ones(1, 4, dtype=torch.long), past_key_values=cache, use_cache=True)

    cache = VAttnCache.from_model(model, max_batch_size=1, max_context_len=64)
    generate(model, cache, *prompts([5]), new_tokens=4)
    manager = cache.manager
    del cache
    gc.collect()
    assert manager.closed


def test_bad_layer_index_and_row_indices_are_refused_with_state_unchanged():
    model = llama()
    with VAttnCache.from_model(model, max_batch_size=3, max_context_len=64, page_size=PAGE) as cache:
        ids, mask = prompts([7, 7, 7])
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        k = torch.zeros(3, 2, 1, 16)
        for bad in (3, -1, 1.0, True, "0"):
            with pytest.raises(ValueError, match=r"layer_idx must be an int in \[0, 2\]"):
                cache.update(k, k, bad)
        before = [layer.keys.clone() for layer in cache.layers], cache.get_seq_length()
        for bad in (torch.tensor([1.0, 0.0, 2.0]), torch.tensor([True, False, True]), [0.5, 1.5]):
            with pytest.raises(TypeError, match="integers"):
                cache.reorder_cache(bad)
        with pytest.raises(ValueError, match="repeats"):
            cache.batch_repeat_interleave(0)
        after = [layer.keys for layer in cache.layers], cache.get_seq_length()
        assert after[1] == before[1] and all(torch.equal(a, b) for a, b in zip(after[0], before[0]))


def test_eager_mapping_is_off_unless_the_policy_asks_for_it():
    model = llama()
    with VAttnCache.from_model(model, max_batch_size=1, max_context_len=64) as cache:
        assert cache.manager.policy["eager"] is False
    with VAttnCache.from_model(model, max_batch_size=1, max_context_len=64, policy={"lookahead_tokens": 16}) as cache:
        assert (cache.manager.policy["eager"], cache.manager.policy["lookahead_tokens"]) == (False, 16)
    with VAttnCache.from_model(model, max_batch_size=1, max_context_len=64, policy={"eager": True}) as cache:
        assert cache.manager.policy["eager"] is True
    with VAttnCache.from_model(model, max_batch_size=1, max_context_len=64, policy=vattn.Policy()) as cache:
        assert cache.manager.policy["eager"] is vattn.Policy().eager
