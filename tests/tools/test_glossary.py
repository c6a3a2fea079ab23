"""docs/design.md's glossary: one word per concept. Retired words are gone from
the code, and the public names that used them still work, with a warning
that names the new word."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

import vattn
from vattn.common import errors
from vattn.kernels import AttentionCase

ROOT = Path(__file__).resolve().parents[2]
# "slot" was a reqid, a slice and a partial result at once; __slots__ and
# dataclass(slots=True) are Python's word, and allocate_slots is vLLM's
# (its KVCacheManager's method, which the budget wraps).
RETIRED = re.compile(r"(?<!allocate_)slot(?!s__|s=True)", re.IGNORECASE)
# Where the retired names are still answered, with a warning: only there.
ALIASES = {"vattn/__init__.py", "vattn/common/errors.py", "vattn/common/deprecation.py", "vattn/kernels/protocol.py",
           "vattn/core/manager.py"}
ALIAS_NAMES = re.compile(r"OutOfSlots|slot_stride|slot_bytes|slots_allocated|page_slots_mapped")


def test_the_glossary_is_in_the_design():
    text = (ROOT / "docs" / "design.md").read_text()
    glossary = text.split("## 10. Glossary", 1)[1].split("\n## ", 1)[0]
    for word in ("reqid", "slice", "token row", "batch", "page id", "position", "mapper", "release", "reclaim"):
        assert f"**{word}**" in glossary, word


@pytest.mark.parametrize("folder", ["vattn", "csrc"])
def test_retired_words_are_gone_from_the_code(folder):
    found = []
    for path in sorted((ROOT / folder).rglob("*")):
        if path.suffix not in (".py", ".h", ".cpp", ".c"):
            continue
        name = str(path.relative_to(ROOT))
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if RETIRED.search(line) and not (name in ALIASES and ALIAS_NAMES.search(line)):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_out_of_slots_is_out_of_reqids_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"vattn\.OutOfSlots is deprecated; use vattn\.OutOfReqids"):
        assert vattn.OutOfSlots is vattn.OutOfReqids
    with pytest.warns(DeprecationWarning, match=r"OutOfSlots is deprecated; use vattn\.common\.errors\.OutOfReqids"):
        assert errors.OutOfSlots is errors.OutOfReqids
    with pytest.raises(AttributeError):
        errors.OutOfNothing  # noqa: B018 - only retired names are answered


def test_stats_answer_their_old_keys_with_a_warning():
    kv = vattn.KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=16, dtype=torch.float32, max_batch_size=2,
                              max_context_len=64, device="cpu", policy={"background": False})
    try:
        r = kv.alloc_reqid()
        assert kv.step([10 if i == r else 0 for i in range(2)])
        s = kv.stats()
        assert "slots_allocated" not in s and "page_slots_mapped" not in s  # iteration shows the new words only
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert s["reqids_allocated"] == 1 and s["page_mappings"] == kv.config.num_buffers
        with pytest.warns(DeprecationWarning, match=r"stats\(\)\['slots_allocated'\] is deprecated"):
            assert s["slots_allocated"] == 1
        with pytest.warns(DeprecationWarning, match=r"stats\(\)\['page_slots_mapped'\] is deprecated"):
            assert s["page_slots_mapped"] == kv.config.num_buffers
        with pytest.raises(KeyError):
            s["no_such_counter"]  # noqa: B018
        with pytest.warns(DeprecationWarning, match="slot_bytes is deprecated"):
            assert kv.slot_bytes == kv.slice_bytes
    finally:
        kv.cleanup()


def test_attention_case_takes_and_reads_slot_stride_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"AttentionCase\(slot_stride=...\) is deprecated"):
        case = AttentionCase("cpu", 64, slot_stride=4096, row_stride=64)
    assert case.slice_stride == 4096 and case == AttentionCase("cpu", 64, slice_stride=4096, row_stride=64)
    with pytest.warns(DeprecationWarning, match=r"AttentionCase\.slot_stride is deprecated"):
        assert case.slot_stride == 4096
    assert case._replace(row_stride=32).slice_stride == 4096 and type(case._replace()) is AttentionCase


def test_retired_policy_knob_names_are_taken_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"policy\['max_batch_ids'\] is deprecated; use policy\['max_round_ids'\]"):
        kv = vattn.KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=16, dtype=torch.float32, max_batch_size=2,
                                  max_context_len=64, device="cpu", policy={"max_batch_ids": 3})
    try:
        assert kv.policy["max_round_ids"] == 3 and "max_batch_ids" not in kv.policy
    finally:
        kv.cleanup()


def test_block_mapper_is_block_placer_with_a_warning():
    from vattn.integrations import vllm as vllm_integration  # imports no vLLM until its hooks are installed
    from vattn.integrations.block_placer import BlockPlacer

    with pytest.warns(DeprecationWarning, match=r"BlockMapper is deprecated; use vattn\.integrations\.vllm\.BlockPlacer"):
        assert vllm_integration.BlockMapper is BlockPlacer


def test_a_deprecated_knob_through_a_wrapper_is_attributed_to_the_callers_line():
    """vattn.init forwards to KVCacheManager: the warning names this file, not vattn's."""
    with pytest.warns(DeprecationWarning, match=r"KVCacheManager\(background=\.\.\.\) is deprecated") as caught:
        vattn.init(num_layers=1, num_kv_heads=1, head_dim=16, dtype=torch.float32, max_batch_size=2,
                   max_context_len=64, device="cpu", background=False)
    try:
        assert [Path(w.filename).name for w in caught] == [Path(__file__).name]
    finally:
        vattn.cleanup()
