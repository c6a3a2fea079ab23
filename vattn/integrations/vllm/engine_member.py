"""The engine core's membership of a budget: how it appears in ``python -m
vattn top`` (its label: served model, data-parallel rank, tensor and
pipeline ranks), and which devices' budgets it joins for its ranks (each
device's budget is charged the pages of the ranks on that device)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from typing import Any

from vattn.budget.devices import DeviceMember, join_devices
from vattn.common.errors import BudgetError

from .worker_budget import RUNNER_ATTRIBUTE, RankCharge, rank_charge

LABEL_CHARACTERS = 40  # what `python -m vattn top` shows of a label
DP_ENGINE_PROCESS = "EngineCore_DP"  # vLLM's process name for a data-parallel engine core (v1/engine/utils.py)


def member_label(served_model_name: Any, tensor_parallel: int, pipeline_parallel: int,
                 data_parallel_rank: int | None = None) -> str:
    """What ``python -m vattn top`` shows for an engine: its served model name, its data-parallel rank
    when it is one engine core of several, and its ranks, e.g. ``vllm llama-8b rank 0``,
    ``vllm llama-8b dp1 rank 0`` or ``vllm llama-8b ranks 0-3 tp2 pp2``."""
    if isinstance(served_model_name, (list, tuple)):
        served_model_name = served_model_name[0] if served_model_name else ""
    name = os.path.basename(str(served_model_name).rstrip("/")) or "model"
    world = tensor_parallel * pipeline_parallel
    ranks = " rank 0" if world == 1 else f" ranks 0-{world - 1}"
    ranks += (f" tp{tensor_parallel}" if tensor_parallel > 1 else "") + (
        f" pp{pipeline_parallel}" if pipeline_parallel > 1 else "")
    if data_parallel_rank is not None:
        ranks = f" dp{data_parallel_rank}{ranks}"
    name = "".join(c if " " <= c <= "~" else "?" for c in name)  # a label is printable ASCII
    room = LABEL_CHARACTERS - len("vllm ") - len(ranks)
    if len(name) > room:
        name = name[: room - 1] + "~"
    return f"vllm {name}{ranks}"


def data_parallel_rank(parallel_config: Any) -> int | None:
    """The engine core's data-parallel rank when it is one of several (``--data-parallel-size``);
    None otherwise. vLLM 0.32 sets a dense model's DP engine cores to ``data_parallel_size`` 1, as
    independent engines, and keeps the rank in ``data_parallel_index``, so rank 0's config reads as a
    lone engine's (whose ``data_parallel_rank_local`` is vLLM's environment default, 0, too); vLLM
    names a DP engine core's process ``EngineCore_DP<rank>`` and a lone one's ``EngineCore``."""
    index = getattr(parallel_config, "data_parallel_index", 0)
    if parallel_config.data_parallel_size > 1 or index:
        return int(index)
    if multiprocessing.current_process().name.startswith(DP_ENGINE_PROCESS):
        return int(index)
    return None


def worker_rank_charge(worker: Any) -> RankCharge | None:
    """Run on every rank by ``collective_rpc(worker_rank_charge)`` at start-up: the rank's device and
    bytes (:class:`RankCharge`); None without vattn's cache."""
    cache = getattr(worker.model_runner, RUNNER_ATTRIBUTE, None)
    return None if cache is None else rank_charge(cache)


def bytes_by_device(charges: Sequence[RankCharge]) -> tuple[dict[str, int], int]:
    """The ranks grouped by device: (device -> bytes one block id holds on it, every rank there
    together; the padding's bytes over every rank). With several devices each device must hold
    the same number of padding blocks (the same kernel on every rank), so that the padding splits
    among them as blocks do; ValueError otherwise."""
    block: dict[str, int] = {}
    padding: dict[str, int] = {}
    for charge in charges:
        block[charge.device] = block.get(charge.device, 0) + charge.block_bytes
        padding[charge.device] = padding.get(charge.device, 0) + charge.padding_bytes
    if len(block) > 1:
        blocks = {device: divmod(padding[device], block[device]) for device in block}
        if len({b for b, _ in blocks.values()}) > 1 or any(rest for _, rest in blocks.values()):
            raise ValueError(f"vattn: the ranks' padding is not the same number of blocks on every device "
                             f"({padding} bytes of padding, {block} bytes a block); a budget per device cannot "
                             f"split it")
    return block, sum(padding.values())


def join_ranks(name: str, charges: Sequence[RankCharge], label: str, source: str) -> DeviceMember:
    """The engine core's membership for ranks ``charges`` (one per rank, from the workers): budget
    ``name`` on every device a rank lies on, each charged that device's ranks' bytes. ``source``
    says where ``name`` came from, for errors (BudgetError: a device without a budget; ValueError)."""
    block, _ = bytes_by_device(charges)
    try:
        return join_devices(name, block, label)
    except (BudgetError, ValueError) as e:
        raise type(e)(f"{source}: {e}") from None
