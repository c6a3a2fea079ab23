"""benchmarks/placer_replay.py: its scheduler makes the batches vLLM made on
the same trace, and a small replay maps every request's blocks once (less
what slices reused), unmaps every page it mapped by the round's end, leaves
no request holding a slice, and writes its JSON."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from conftest import BENCHMARKS, load_benchmark

placer_replay = load_benchmark("placer_replay")
harness = load_benchmark("harness")
RECORDED = BENCHMARKS / "results" / "vllm_serving_short_fp32_profile_cpu-2core.json"


def test_the_schedule_is_the_one_vllm_ran():
    # vllm_serving.py --profile recorded every forward's batch (per request: tokens computed before, tokens
    # scheduled) of round 1's prompts; the simulated scheduler and pool, prefix-cache hits included, make the same
    recorded = json.loads(RECORDED.read_text()).get("batches") if RECORDED.exists() else None
    if recorded is None:
        pytest.skip(f"needs a profile's recorded batches: {RECORDED.name} has none")
    phases = {p["name"]: p for p in placer_replay.short_phases(64, seed=0)}
    pool = placer_replay.BlockPool(placer_replay.NUM_BLOCKS)
    for name in ["warmup", "shared", "independent"]:
        forwards, _ = placer_replay.schedule(phases[name]["prompts"], phases[name]["max_tokens"], pool, name)
        if name in recorded:
            made = [[(f.seq_lens - f.query_lens).tolist(), f.query_lens.tolist()] for f in forwards]
            assert made == recorded[name], name


def test_a_small_replay_maps_each_block_once_and_unmaps_every_page_by_the_end(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    monkeypatch.setattr(placer_replay, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["placer_replay.py", "--rounds", "2", "--requests", "20"])
    placer_replay.main()
    (path,) = tmp_path.glob("placer_replay_*.json")
    payload = json.loads(path.read_text())
    assert {"benchmark", "revision", "machine", "parameters", "cache", "order", "rounds", "summary"} <= set(payload)
    assert payload["parameters"]["rounds"] == 2 and payload["parameters"]["requests"] == 20
    buffers = payload["cache"]["num_buffers"]
    assert (payload["cache"]["layout"], payload["cache"]["page_size"], buffers) == ("per_layer", 64 << 10, 16)
    assert [r["order"] for r in payload["rounds"]] == [["shared", "independent"], ["independent", "shared"]]
    for r in payload["rounds"]:
        phases = {p["name"]: p for p in placer_replay.short_phases(20, seed=r["round"] - 1)}
        for name, t in r["traces"].items():
            # each request's blocks at its last forward (prompt + max_tokens - 1 tokens), one position each:
            # mapped, or found still mapped in the free slice it took
            blocks = sum(-(-(len(p) + m - 1) // placer_replay.BLOCK)
                         for p, m in zip(phases[name]["prompts"], phases[name]["max_tokens"]))
            assert t["positions_needed"] + t["positions_reused"] == blocks, (r["round"], name)
            assert t["pages_mapped"] == buffers * t["positions_needed"]
            assert t["forwards"] >= max(phases[name]["max_tokens"]) and t["map_ms"] > 0
        second = r["traces"][r["order"][1]]
        assert second["pages_unmapped"] > 0  # 44 requests on 32 slices: the second trace reuses slices
        # what the traces and the end's reclaim unmapped is what the round mapped; nothing is left
        assert r["round_pages_unmapped"] == r["round_pages_mapped"] > 0
        assert r["pages_mapped_at_end"] == 0 and r["live_requests_at_end"] == 0
    assert any(r["traces"]["shared"]["positions_reused"] > 0 for r in payload["rounds"])  # a system prompt's slice
    for name in placer_replay.TRACES:
        row = payload["summary"][name]
        assert set(row["by_position"]) == {"first", "second"}
        for figure in ("forwards", "pages_mapped", "pages_unmapped", "map_ms", "assign_ms", "release_ms"):
            q = row[figure]
            assert q["min"] <= q["median"] <= q["max"]
    if importlib.util.find_spec("matplotlib"):
        assert path.with_suffix(".png").exists()
