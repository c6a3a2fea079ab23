"""benchmarks/vllm_models.py's rows and error sentences (the engines
themselves run in the benchmark, not here)."""

from __future__ import annotations

from conftest import load_benchmark

vllm_models = load_benchmark("vllm_models")


def engine_result(outputs: list[list[int]], blocks: list[int]) -> dict:
    return {"phases": {"mixed": {"outputs": outputs, "prefix_cache_hits": 0}}, "usage_block_bytes": 1024,
            "usage_series": [(float(i), b) for i, b in enumerate(blocks)], "num_blocks": 100}


def vattn_stats(behind_windows: list[int], windows: list[int | None]) -> dict:
    return {"groups": [{"window": w, "layers": 2} for w in windows], "bytes_mapped_peak": 3072,
            "bytes_behind_windows_series": behind_windows, "pages_created": 2, "page_size": 4096}


def test_a_model_without_windows_has_nothing_behind_them():
    """The worker records the bytes behind windows only for a model with windows: none is 0, not an error."""
    stock = engine_result([[5, 6], [7]], [1, 4, 2])
    ours = dict(engine_result([[5, 6], [8]], [1, 4, 2]), vattn=[vattn_stats([], [None])])
    r = vllm_models.row("llama", stock, ours)
    assert r["vattn_behind_windows_peak_bytes"] == 0
    assert (r["requests"], r["requests_equal"], r["generated_tokens"]) == (2, 1, 3)
    assert r["stock_in_use_peak_bytes"] == 4 * 1024 and r["vattn_vs_stock"] == 0.75
    windowed = dict(ours, vattn=[vattn_stats([0, 8192, 4096], [None, 64])])
    assert vllm_models.row("gemma2", stock, windowed)["vattn_behind_windows_peak_bytes"] == 8192


def test_a_refusal_is_vattns_sentence_else_the_last_exception():
    log = ("INFO starting\nValueError: vattn's vLLM integration does not serve multi-head latent attention "
           "[see docs].\nRuntimeError: Engine core initialization failed\n")
    assert vllm_models.error_of(log) == "vattn's vLLM integration does not serve multi-head latent attention"
    assert vllm_models.error_of("INFO x\nRuntimeError: no kernel for this head size\n") == \
        "RuntimeError: no kernel for this head size"
    row = vllm_models.row("deepseek-v2", {"phases": {}}, {"error": "refused"})
    assert row == {"architecture": "deepseek-v2", "stock_error": None, "vattn_error": "refused"}
