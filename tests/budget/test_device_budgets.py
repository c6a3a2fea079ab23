"""Budgets per device: a GPU's budget named by its UUID (the fake driver's devices given UUIDs of
their own), one budget name's per-device segments, and one member charged over several devices
(an engine's tensor or pipeline parallel ranks), a grant made on every device or on none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from budget_helpers import _counter, stuck_lock_holder

import vattn
from vattn.budget import budget as vbudget
from vattn.budget import devices
from vattn.budget.membership import join_budget
from vattn.common.errors import DriverError
from vattn.integrations.vllm.engine_member import bytes_by_device, join_ranks
from vattn.integrations.vllm.worker_budget import RankCharge

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
from test_vllm import SCENARIO, needs_vllm, vllm_python  # noqa: E402

KiB = 1 << 10
RANK_BLOCK = 32 * 512  # vllm_device_budgets.py: a block of the test model on one of two ranks
UUID_A = "GPU-0a0a0a0a-1111-2222-3333-aaaaaaaaaaaa"
UUID_B = "GPU-0b0b0b0b-1111-2222-3333-bbbbbbbbbbbb"
HEX_A, HEX_B = (u[4:].replace("-", "") for u in (UUID_A, UUID_B))


@pytest.fixture
def family_name():
    """A name no other test uses; it and its per-device budgets are removed afterwards."""
    name = f"d{os.getpid()}-{next(_counter)}"
    yield name
    for each in devices.family(name):
        try:
            vbudget.remove(each, force=True)
        except vattn.BudgetError:
            pass


# ---- the device's UUID ------------------------------------------------------------------------


def test_two_fake_devices_have_the_uuids_a_test_gives_them(fake_cuda, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_DEVICE_COUNT", "2")
    monkeypatch.delenv("FAKE_CUDA_UUIDS", raising=False)
    assert vbudget.resolve_device("cuda:0") != vbudget.resolve_device("cuda:1")  # the default: by ordinal
    monkeypatch.setenv("FAKE_CUDA_UUIDS", f"{HEX_A},{HEX_B}")
    assert (vbudget.resolve_device("cuda:0"), vbudget.resolve_device("cuda:1")) == (UUID_A, UUID_B)
    monkeypatch.setenv("FAKE_CUDA_UUIDS", f"{HEX_B},{HEX_A}")  # another process's CUDA_VISIBLE_DEVICES=1,0
    assert (vbudget.resolve_device("cuda:0"), vbudget.resolve_device("cuda:1")) == (UUID_B, UUID_A)
    monkeypatch.setenv("FAKE_CUDA_UUIDS", f"{HEX_A},not-hex")
    with pytest.raises(DriverError, match="cuDeviceGetUuid failed: CUresult 1"):
        vbudget.resolve_device("cuda:1")


def test_processes_numbering_gpus_differently_share_each_gpus_budget(fake_cuda, monkeypatch, family_name):
    monkeypatch.setenv("FAKE_CUDA_DEVICE_COUNT", "2")
    monkeypatch.setenv("FAKE_CUDA_UUIDS", f"{HEX_A},{HEX_B}")
    made = devices.create_for_devices(family_name, 64 * KiB, ["cuda:0", "cuda:1"])
    assert [(b.name, b.device) for b in made] == [(f"{family_name}.GPU-aaaaaaaaaaaa", UUID_A),
                                                  (f"{family_name}.GPU-bbbbbbbbbbbb", UUID_B)]
    _, first = join_budget(family_name, torch.device("cuda:1"), "sees B as cuda:1")
    monkeypatch.setenv("FAKE_CUDA_UUIDS", f"{HEX_B},{HEX_A}")
    budget, second = join_budget(family_name, torch.device("cuda:0"), "sees B as cuda:0")
    assert budget.name == f"{family_name}.GPU-bbbbbbbbbbbb"
    assert sorted(m.label for m in budget.usage().members) == ["sees B as cuda:0", "sees B as cuda:1"]
    first.leave(), second.leave()


# ---- one name, a budget per device ---------------------------------------------------------------


def test_a_name_finds_each_devices_budget(family_name):
    assert devices.device_budget_name(family_name, "cpu") == family_name
    assert devices.device_budget_name("llm", UUID_A) == "llm.GPU-aaaaaaaaaaaa"
    with pytest.raises(ValueError, match="too long for a per-device budget"):
        devices.device_budget_name("x" * 48, UUID_A)
    with pytest.raises(vattn.BudgetError, match=rf"no budget '{family_name}', and there is no budget "
                                                 rf"'{family_name}.GPU-aaaaaaaaaaaa'.*--per-device"):
        devices.attach_for_device(family_name, UUID_A)
    vattn.Budget.create(family_name, 64 * KiB, device=UUID_A)  # a budget of one GPU: the name itself
    assert devices.attach_for_device(family_name, UUID_A).name == family_name
    with pytest.raises(ValueError, match=rf"budget '{family_name}' governs device {UUID_A}, and there is no "
                                         rf"budget '{family_name}.GPU-bbbbbbbbbbbb'"):
        devices.attach_for_device(family_name, UUID_B)
    with pytest.raises(ValueError, match="governs device GPU-0a0a.*lives on cpu"):
        devices.attach_for_device(family_name, "cpu")
    (added,) = devices.create_for_devices(family_name, 32 * KiB, [UUID_B], per_device=True)  # a second GPU
    assert devices.attach_for_device(family_name, UUID_B).name == added.name == f"{family_name}.GPU-bbbbbbbbbbbb"
    assert devices.family(family_name) == [family_name, added.name]
    # another UUID ending alike is told apart, not confused
    alike = "GPU-ffffffff-1111-2222-3333-bbbbbbbbbbbb"
    with pytest.raises(ValueError, match=f"governs device {UUID_B}, not {alike}"):
        devices.attach_for_device(family_name, alike)


def test_creating_per_device_budgets_is_all_or_nothing(family_name):
    with pytest.raises(ValueError, match="one device twice"):
        devices.create_for_devices(family_name, KiB, [UUID_A, UUID_A])
    with pytest.raises(ValueError, match="one per GPU"):
        devices.create_for_devices(family_name, KiB, [UUID_A, "cpu"])
    vattn.Budget.create(f"{family_name}.GPU-bbbbbbbbbbbb", KiB, device=UUID_B)
    with pytest.raises(vattn.BudgetError, match="exists"):
        devices.create_for_devices(family_name, KiB, [UUID_A, UUID_B])
    assert devices.family(family_name) == [f"{family_name}.GPU-bbbbbbbbbbbb"]  # A's was removed again


def test_the_command_line_creates_sets_lists_and_removes_a_names_device_budgets(family_name, capsys):
    from vattn.__main__ import main

    assert main(["budget", "create", family_name, "--limit", "1MiB", "--device", UUID_A, "--device", UUID_B]) == 0
    out = capsys.readouterr().out
    assert f"created budget {family_name}.GPU-aaaaaaaaaaaa: limit 1.00 MiB" in out and f"device {UUID_B}" in out
    assert main(["budget", "set", family_name, "--limit", "2MiB"]) == 0
    assert [vattn.Budget.attach(n).limit for n in devices.family(family_name)] == [2 << 20, 2 << 20]
    assert main(["budget", "ls"]) == 0
    listed = capsys.readouterr().out
    assert f"{family_name}.GPU-aaaaaaaaaaaa: device {UUID_A}, limit 2.00 MiB" in listed
    assert main(["top", family_name, "--once"]) == 0
    shown = capsys.readouterr().out
    assert f"budget {family_name}.GPU-aaaaaaaaaaaa  device {UUID_A}" in shown and f"device {UUID_B}" in shown
    assert main(["budget", "rm", family_name]) == 0
    assert devices.family(family_name) == []


# ---- one member over several devices -----------------------------------------------------------


def two_devices(name: str, limit: int, unit_a: int, unit_b: int) -> devices.DeviceMember:
    devices.create_for_devices(name, limit, [UUID_A, UUID_B])
    return devices.join_devices(name, {UUID_A: unit_a, UUID_B: unit_b}, "engine tp2")


def held(name: str) -> tuple[int, int]:
    return tuple(vattn.Budget.attach(devices.device_budget_name(name, u)).held_bytes for u in (UUID_A, UUID_B))


def test_each_device_is_charged_its_ranks_share_and_gets_it_back(family_name):
    member = two_devices(family_name, 64 * KiB, 4 * KiB, 2 * KiB)  # a block: 4 KiB on A, 2 KiB on B
    assert member.unit_bytes == 6 * KiB
    assert member.try_grant(3 * member.unit_bytes)
    assert held(family_name) == (12 * KiB, 6 * KiB) == tuple(member.held_by_device().values())
    assert member.held_bytes == 18 * KiB
    member.report(2 * member.unit_bytes, member.unit_bytes)
    usage_a = vattn.Budget.attach(f"{family_name}.GPU-aaaaaaaaaaaa").usage().members[0]
    assert (usage_a.in_use_bytes, usage_a.free_held_bytes) == (8 * KiB, 4 * KiB)
    member.release(2 * member.unit_bytes)
    assert held(family_name) == (4 * KiB, 2 * KiB)
    with pytest.raises(ValueError, match="whole units of 6144 bytes over 2 devices"):
        member.try_grant(KiB)
    assert held(family_name) == (4 * KiB, 2 * KiB)
    member.leave()
    assert held(family_name) == (0, 0)


def test_a_device_short_of_room_refuses_the_grant_and_the_other_devices_part_is_undone(family_name):
    member = two_devices(family_name, 64 * KiB, 4 * KiB, 4 * KiB)  # tensor parallel: equal halves
    view = member.budget
    assert view.available_bytes // member.unit_bytes == 16 and view.limit == 128 * KiB
    assert member.try_grant(4 * member.unit_bytes)
    b = vattn.Budget.attach(f"{family_name}.GPU-bbbbbbbbbbbb")
    b.set_limit(24 * KiB)  # B lowered: 2 more blocks fit there, 12 more on A
    assert view.available_bytes // member.unit_bytes == 2
    assert not member.try_grant(3 * member.unit_bytes)  # A could, B cannot: nothing granted anywhere
    assert held(family_name) == (16 * KiB, 16 * KiB)
    assert member.counters["grants_undone"] == 1
    a = vattn.Budget.attach(f"{family_name}.GPU-aaaaaaaaaaaa")
    assert (a.usage().waiting_bytes, b.usage().waiting_bytes) == (0, 12 * KiB)  # the wait is B's alone
    assert member.try_grant(2 * member.unit_bytes)  # what B has room for
    assert held(family_name) == (24 * KiB, 24 * KiB)
    b.set_limit(16 * KiB)  # B now 2 blocks over its limit, A well within its own
    assert -(-(view.held_bytes - view.limit) // member.unit_bytes) == 2  # the blocks owed on the worst device
    assert view.available_bytes == 0
    other = b.join("another engine")
    assert not other.try_grant(KiB)  # B's other member waits: pressure asks this one for blocks
    # B: 24 KiB held + 1 KiB waited for - 16 KiB = 9 KiB to give back there, 18 KiB over both devices
    assert member.pressure() == 18 * KiB and -(-member.pressure() // member.unit_bytes) == 3
    member.release(3 * member.unit_bytes)
    assert held(family_name) == (12 * KiB, 12 * KiB) and member.pressure() == 0
    other.leave(), member.leave()


def test_a_grant_that_one_device_refuses_leaves_nothing_charged_whichever_device_refuses(family_name):
    member = two_devices(family_name, 16 * KiB, 2 * KiB, 6 * KiB)  # pipeline parallel: unequal stages
    a = vattn.Budget.attach(f"{family_name}.GPU-aaaaaaaaaaaa")
    a.set_limit(4 * KiB)  # the first device asked refuses: nothing was granted
    assert not member.try_grant(3 * member.unit_bytes) and held(family_name) == (0, 0)
    a.set_limit(16 * KiB)  # now B refuses 18 KiB after A granted 6 KiB: undone
    assert not member.try_grant(3 * member.unit_bytes) and held(family_name) == (0, 0)
    assert member.try_grant(2 * member.unit_bytes) and held(family_name) == (4 * KiB, 12 * KiB)
    member.leave()


def test_a_budget_removed_on_one_device_raises_and_the_others_still_get_their_share_back(family_name):
    member = two_devices(family_name, 64 * KiB, 4 * KiB, 4 * KiB)
    assert member.try_grant(2 * member.unit_bytes)
    vbudget.remove(f"{family_name}.GPU-bbbbbbbbbbbb", force=True)
    with pytest.raises(vattn.BudgetError, match="removed"):
        member.try_grant(member.unit_bytes)  # A grants its part, B raises: A's part is undone
    a = vattn.Budget.attach(f"{family_name}.GPU-aaaaaaaaaaaa")
    assert a.held_bytes == 8 * KiB
    member.release(member.unit_bytes)  # B's release is quiet on a removed segment; A's goes through
    assert a.held_bytes == 4 * KiB
    member.leave()
    assert a.held_bytes == 0


def test_a_device_whose_budget_lock_is_stuck_refuses_and_is_owed_its_releases(family_name):
    """Another process holds device B's budget lock past lock_timeout_s (stopped, stuck): a grant is
    refused with A's part undone, a release keeps B's part owed (still charged there) and gives A its
    own, a report says it was not recorded; the calls after the first do not wait on B's lock again
    until ``recover`` finds it free, which gives B its part back. (Every call had raised the timeout as
    a BudgetError, which an engine took for a budget no one could use, and left.)"""
    devices.create_for_devices(family_name, 64 * KiB, [UUID_A, UUID_B])
    shares = []
    for uuid, unit in ((UUID_A, 4 * KiB), (UUID_B, 2 * KiB)):
        budget = vattn.Budget.attach(devices.device_budget_name(family_name, uuid), lock_timeout_s=0.2)
        shares.append(devices.DeviceShare(budget, budget.join("engine tp2"), unit))
    member = devices.DeviceMember(family_name, shares)
    assert member.try_grant(4 * member.unit_bytes)
    assert held(family_name) == (16 * KiB, 8 * KiB)
    with stuck_lock_holder(devices.device_budget_name(family_name, UUID_B)) as let_go:
        assert not member.try_grant(member.unit_bytes)  # A granted, B timed out: A's part undone
        assert held(family_name) == (16 * KiB, 8 * KiB) and member.refused is shares[1]
        assert member.counters["lock_timeouts"] == 1 and member.stalled
        member.release(2 * member.unit_bytes)  # A's part now, B's owed
        assert held(family_name) == (8 * KiB, 8 * KiB) and member.unreturned_bytes == 4 * KiB
        assert member.held_by_device() == {UUID_A: 8 * KiB, UUID_B: 8 * KiB}  # B still charged for it
        assert member.report(member.unit_bytes, member.unit_bytes) is False
        assert member.pressure() == 0
        member.clear_wait()
        assert not member.try_grant(member.unit_bytes)
        assert member.counters["lock_timeouts"] == 1  # no call since the first waited on B's lock
        member.recover()  # the keeper's look: B's lock still held
        assert member.counters["lock_timeouts"] == 2 and member.unreturned_bytes == 4 * KiB
        let_go()
    member.recover()
    assert not member.stalled and member.unreturned_bytes == 0
    assert held(family_name) == (8 * KiB, 4 * KiB)
    assert member.report(member.unit_bytes, member.unit_bytes) is True
    assert member.try_grant(member.unit_bytes) and held(family_name) == (12 * KiB, 6 * KiB)
    member.leave()
    assert held(family_name) == (0, 0)


def test_one_device_is_that_budgets_own_figures(family_name):
    budget = vattn.Budget.create(family_name, 10 * KiB + 512)  # not whole blocks: kept as is
    member = devices.join_devices(family_name, {"cpu": 3 * KiB}, "host engine")
    view = member.budget
    assert (view.limit, view.available_bytes, view.held_bytes) == (10 * KiB + 512, 10 * KiB + 512, 0)
    assert member.try_grant(5 * KiB)  # any amount, as a budget's own member takes
    assert (view.held_bytes, view.available_bytes) == (5 * KiB, 5 * KiB + 512) == (budget.held_bytes,
                                                                                     budget.available_bytes)
    member.leave()


# ---- an engine's ranks, grouped by device ----------------------------------------------------------


def test_ranks_are_grouped_by_device_and_join_each_devices_budget(family_name):
    # tp2 x pp2 on two GPUs: ranks 0 and 1 (stage 0) on A, ranks 2 and 3 (stage 1) on B
    ranks = [RankCharge(UUID_A, 4 * KiB, 4 * KiB), RankCharge(UUID_A, 4 * KiB, 4 * KiB),
             RankCharge(UUID_B, 2 * KiB, 2 * KiB), RankCharge(UUID_B, 2 * KiB, 2 * KiB)]
    assert bytes_by_device(ranks) == ({UUID_A: 8 * KiB, UUID_B: 4 * KiB}, 12 * KiB)
    assert bytes_by_device([RankCharge("cpu", 4 * KiB, 0)] * 4) == ({"cpu": 16 * KiB}, 0)  # the host: as one
    with pytest.raises(ValueError, match="padding is not the same number of blocks on every device"):
        bytes_by_device([RankCharge(UUID_A, 4 * KiB, 4 * KiB), RankCharge(UUID_B, 4 * KiB, 0)])
    with pytest.raises(vattn.BudgetError, match=f"VATTN_BUDGET={family_name}: no budget"):
        join_ranks(family_name, ranks, "vllm m ranks 0-3 tp2 pp2", f"VATTN_BUDGET={family_name}")
    devices.create_for_devices(family_name, 64 * KiB, [UUID_A])  # only A has one
    with pytest.raises(ValueError, match=f"VATTN_BUDGET={family_name}: budget '{family_name}' governs device "):
        join_ranks(family_name, ranks, "vllm m ranks 0-3 tp2 pp2", f"VATTN_BUDGET={family_name}")
    assert vattn.Budget.attach(family_name).usage().members == ()  # A's membership was left again
    vbudget.remove(family_name)
    devices.create_for_devices(family_name, 64 * KiB, [UUID_A, UUID_B])
    member = join_ranks(family_name, ranks, "vllm m ranks 0-3 tp2 pp2", "VATTN_BUDGET")
    assert member.try_grant(12 * KiB) and held(family_name) == (8 * KiB, 4 * KiB)
    member.leave()


# ---- vLLM's scheduler charging two devices -----------------------------------------------------------


@needs_vllm
def test_vllms_scheduler_grants_a_block_only_where_every_device_has_room(family_name, tmp_path):
    """Two tensor parallel ranks on two GPUs, vLLM's own scheduler under vattn's hooks without a model
    (vllm_device_budgets.py): each device's budget is charged its rank's half of every block; with
    one device's limit lowered a request waits although the other device has room, and nothing is
    left granted there; releases give each device its share back."""
    model = tmp_path / "model"
    subprocess.run([vllm_python(), str(SCENARIO), "make-model", str(model)], check=True, capture_output=True,
                   timeout=300)
    devices.create_for_devices(family_name, 64 * RANK_BLOCK, [UUID_A, UUID_B])
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("VATTN_VLLM", "VATTN_BUDGET"))}
    proc = subprocess.run([vllm_python(), str(Path(__file__).with_name("vllm_device_budgets.py")), str(model),
                           family_name], capture_output=True, text=True, timeout=600, env=environ, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    stages = result["stages"]
    assert stages["first admitted"]["held"] == [4 * RANK_BLOCK, 4 * RANK_BLOCK]
    refused = stages["second refused"]
    assert refused["scheduled"] == ["first"] and refused["held"] == [4 * RANK_BLOCK, 4 * RANK_BLOCK]
    assert refused["waiting"][0] == 0 and refused["waiting"][1] > 0  # the wait is on B, where room lacks
    assert result["grants_undone"] >= 1  # A granted its half of the refused blocks, and gave it back
    admitted = stages["second admitted"]
    assert admitted["scheduled"] == ["second"]
    assert admitted["held"][0] == admitted["held"][1] <= 5 * RANK_BLOCK  # B's limit held; A charged alike
    assert stages["released"]["held"] == [0, 0] and result["held_by_device"] == {UUID_A: 0, UUID_B: 0}


def test_ranks_on_other_machines_are_refused_under_a_budget(monkeypatch):
    from types import SimpleNamespace

    from vattn.integrations.vllm.engine_budget import check_config

    def config(nnodes: int) -> SimpleNamespace:
        return SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend="mp", world_size=4,
                                                               nnodes=nnodes),
                               scheduler_config=SimpleNamespace(async_scheduling=False))

    monkeypatch.setenv("VATTN_BUDGET", "llm")
    check_config(config(1))  # four ranks on this machine's devices
    with pytest.raises(ValueError, match="nnodes=2 ranks lie on other machines"):
        check_config(config(2))
