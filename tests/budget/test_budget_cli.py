"""`python -m vattn budget ...` and `python -m vattn top`: the real entry point
in subprocesses (which start without torch), every path in-process."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from budget_helpers import budget_name, patch_prefix  # noqa: F401 (fixture)

import vattn
from vattn.budget import top as budget_top
from vattn.cli.main import main

GiB = 1 << 30


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vattn", *args], capture_output=True, text=True, timeout=120)


def test_create_then_top_json_and_rm_in_subprocesses(budget_name, capsys):
    assert main(["budget", "create", budget_name, "--limit", "4GiB"]) == 0  # in-process: the same parser
    assert f"created budget {budget_name}: limit 4.00 GiB (4294967296 bytes), device cpu" in capsys.readouterr().out
    m = vattn.Budget.attach(budget_name).join("engine:test")
    assert m.try_grant(GiB)
    m.report(GiB // 4, GiB // 2)
    proc = cli("top", budget_name, "--once", "--json")
    assert proc.returncode == 0, proc.stderr
    (snap,) = json.loads(proc.stdout)["budgets"]
    assert (snap["name"], snap["limit_bytes"], snap["held_bytes"], snap["available_bytes"]) == (
        budget_name, 4 * GiB, GiB, 3 * GiB)
    assert snap["processes"] == [{"pid": os.getpid(), "managers": ["engine:test"], "held_bytes": GiB,
                                  "in_use_bytes": GiB // 4, "free_held_bytes": GiB // 2, "waiting_bytes": 0}]
    assert [(x["label"], x["in_use_bytes"]) for x in snap["members"]] == [("engine:test", GiB // 4)]
    m.leave()
    proc = cli("budget", "rm", budget_name)
    assert proc.returncode == 0, proc.stderr
    assert budget_name not in vattn.budget.names()


def test_set_changes_the_limit_live_and_says_what_exceeds_it(budget_name, capsys):
    assert main(["budget", "create", budget_name, "--limit", "2e9"]) == 0
    b = vattn.Budget.attach(budget_name)
    assert b.limit == 2_000_000_000
    m = b.join("m")
    assert m.try_grant(GiB)
    assert main(["budget", "set", budget_name, "--limit", "512MiB"]) == 0
    out = capsys.readouterr().out
    assert b.limit == 512 << 20
    assert "-> 512.0 MiB (536870912 bytes); members hold 1.00 GiB" in out
    assert "512.0 MiB more than the new limit: grants are refused" in out
    assert not m.try_grant(1)


def imported_modules(stderr: str) -> set[str]:
    """The modules ``python -X importtime`` says were imported."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_budget_commands_and_top_start_without_torch(budget_name):
    """The operator's tools must start at once on a loaded machine: torch alone takes seconds to import."""
    vattn.Budget.create(budget_name, GiB)
    for args in (["budget", "ls"], ["top", budget_name, "--once", "--json"], ["budget", "set", budget_name,
                                                                               "--limit", "2GiB"]):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "vattn", *args], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        modules = imported_modules(proc.stderr)
        assert {"vattn", "vattn.budget.cli", "vattn._C"} <= modules  # the scan sees the command's imports
        assert not {m for m in modules if m == "torch" or m.startswith("torch.")}, args
    assert vattn.Budget.attach(budget_name).limit == 2 * GiB


def test_set_warns_when_the_limit_is_below_what_members_cannot_give_back(budget_name, capsys):
    b = vattn.Budget.create(budget_name, 4 * GiB)
    m = b.join("vllm llama rank 0")
    assert m.try_grant(GiB)
    m.report(GiB // 2, GiB // 4)  # the rest, 256 MiB, held but neither in use nor free: padding
    assert main(["budget", "set", budget_name, "--limit", "2GiB"]) == 0
    assert capsys.readouterr().err == ""  # above what members hold: nothing to say
    assert main(["budget", "set", budget_name, "--limit", "800MiB"]) == 0
    out, err = capsys.readouterr()
    assert "members hold 224.0 MiB more than the new limit" in out
    assert err == ""  # 800 MiB is not below the 768 MiB members cannot give back
    assert main(["budget", "set", budget_name, "--limit", "512MiB"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: the new limit 512.0 MiB is below the 768.0 MiB (805306368 bytes) members cannot "
                          "give back now (held minus free-held, as they last reported): 512.0 MiB under requests "
                          "and 256.0 MiB of padding"), err
    assert err.rstrip().endswith("until requests finish and their pages are released")
    assert main(["budget", "set", budget_name, "--limit", "100MiB"]) == 0  # below the padding alone
    err = capsys.readouterr().err
    assert "below the 768.0 MiB" in err and err.rstrip().endswith("for as long as those members run")
    m.leave()
    assert main(["budget", "set", budget_name, "--limit", "0"]) == 0  # nobody holds anything
    assert capsys.readouterr().err == ""


def test_set_help_states_the_padding_rule(capsys):
    with pytest.raises(SystemExit) as info:
        main(["budget", "set", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Padding is charged whatever the limit" in text
    assert "a limit below what members hold as padding leaves the budget above its limit" in text


@pytest.mark.parametrize("args", [["budget", "create", "-x", "--limit", "1GiB"], ["budget", "rm", "-x"],
                                  ["budget", "set", "-x", "--limit", "1GiB"], ["top", "--once", "-x"]])
def test_a_name_starting_with_a_dash_is_said_to_be_no_name(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    (line,) = [l for l in capsys.readouterr().err.splitlines() if "error:" in l]
    assert f"'-x' is not an option of python -m vattn {' '.join(args[:2]) if args[0] == 'budget' else 'top'}" \
        in line, line
    assert "a budget name cannot start with '-' (names: 1-64 characters of A-Z a-z 0-9 . _ -, not starting with " \
        "'.' or '-')" in line


def test_a_dash_name_after_double_dash_reaches_the_name_check(capsys):
    assert main(["budget", "create", "--limit", "1GiB", "--", "-x"]) == 1
    assert "budget name '-x' is invalid" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["top", "--once", "-n", "2", "--bogus"])  # known short options are not taken for names
    assert "is not an option" not in capsys.readouterr().err


def test_errors_are_reported_not_raised(budget_name, capsys):
    assert main(["budget", "set", budget_name, "--limit", "1GiB"]) == 1
    assert f"no budget '{budget_name}'" in capsys.readouterr().err
    assert main(["budget", "rm", budget_name]) == 1
    assert main(["budget", "create", budget_name, "--limit", "1GiB", "--device", "tpu"]) == 1
    assert "device must be" in capsys.readouterr().err
    assert main(["budget", "create", "bad/name", "--limit", "1GiB"]) == 1
    assert "budget name 'bad/name' is invalid" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["budget", "create", budget_name, "--limit", "four"])
    assert "size 'four' is not understood" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["top", "--interval", "0"])
    for interval in ("inf", "nan", "1e300"):  # time.sleep would raise after the first snapshot
        with pytest.raises(SystemExit):
            main(["top", "--interval", interval])
        assert "must be in (0, 86400]" in capsys.readouterr().err
    assert main(["budget", "create", budget_name, "--limit", "1GiB"]) == 0
    assert main(["budget", "create", budget_name, "--limit", "1GiB"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["top", "--once", budget_name + "-missing"]) == 1


def test_top_table_per_process_and_manager(budget_name, capsys):
    b = vattn.Budget.create(budget_name, 4 * GiB)
    a, c = b.join("engine:a"), b.join("engine:c")
    assert a.try_grant(GiB) and c.try_grant(GiB)
    a.report(GiB // 2, GiB // 2)
    assert not c.try_grant(3 * GiB)  # waits
    assert main(["top", "--once", budget_name]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(f"budget {budget_name}  device cpu  limit 4.00 GiB  held 2.00 GiB (50.0%)" in line for line in lines)
    (proc_line,) = [line for line in lines if line.lstrip().startswith(str(os.getpid()))]
    assert "process (2 managers)" in proc_line and "2.00 GiB" in proc_line and "50.0%" in proc_line
    (a_line,) = [line for line in lines if "engine:a" in line]
    assert a_line.split()[1:] == ["512.0", "MiB", "512.0", "MiB", "1.00", "GiB", "25.0%", "-"]
    (c_line,) = [line for line in lines if "engine:c" in line]
    assert "3.00 GiB for" in c_line  # what it waits for, and since when


def test_top_redraws_on_a_terminal_and_appends_elsewhere(budget_name, monkeypatch):
    vattn.Budget.create(budget_name, GiB)

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    assert budget_top.run_top(budget_name, False, False, 0.01, 3, screen) == 0
    assert screen.getvalue().count(budget_top.CLEAR) == 3
    plain = io.StringIO()
    assert budget_top.run_top(budget_name, False, False, 0.01, 2, plain) == 0
    assert budget_top.CLEAR not in plain.getvalue() and plain.getvalue().count(f"budget {budget_name} ") == 2

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(budget_top.time, "sleep", interrupted)  # Ctrl-C during the wait
    screen = Terminal()
    assert budget_top.run_top(budget_name, False, False, 1.0, None, screen) == 0
    assert screen.getvalue().endswith("\n")


def test_top_and_ls_show_every_budget_and_survive_a_corrupt_one(budget_name, capsys):
    vattn.Budget.create(budget_name + "-ok", GiB)
    vattn.Budget.create(budget_name, GiB)
    try:
        patch_prefix(budget_name, magic=1)
        assert main(["top", "--once", "--json"]) == 0
        snap = json.loads(capsys.readouterr().out)
        assert budget_name + "-ok" in [u["name"] for u in snap["budgets"]]
        assert any(e["name"] == budget_name and "bad magic" in e["error"] for e in snap["errors"])
        assert main(["top", "--once"]) == 0
        assert f"budget {budget_name}: budget '{budget_name}'" in capsys.readouterr().out
        assert main(["budget", "ls"]) == 0
        out = capsys.readouterr().out
        assert f"{budget_name}-ok: device cpu, limit 1.00 GiB" in out and f"{budget_name}: unreadable" in out
        assert main(["budget", "rm", budget_name]) == 0  # a corrupt budget is removed all the same
    finally:
        vattn.budget.remove(budget_name + "-ok")


@pytest.mark.parametrize("args, says", [
    (["create", "{n}", "--limit", "1e9999999"], "size '1e9999999' must be in [1, 2**64 - 1] bytes"),
    (["set", "{n}", "--limit", "1e999999GiB"], "size '1e999999GiB' must be in [0, 2**64 - 1] bytes"),
    (["create", "{n}", "--limit", "-1GiB"], "size '-1GiB' must be in [1, 2**64 - 1] bytes"),
    (["set", "{n}", "--limit", "-5"], "size '-5' must be in [0, 2**64 - 1] bytes"),
    (["create", "{n}", "--size", "1GiB"], "unrecognized arguments: --size 1GiB"),
    (["create", "{n}", "--limit", "0"], "a budget of 0 bytes grants nothing"),
])
def test_bad_sizes_and_arguments_say_what_is_wrong(budget_name, capsys, args, says):
    """Each ends in one line naming the argument and what it accepts, never a traceback."""
    with pytest.raises(SystemExit) as info:
        main(["budget", *[a.format(n=budget_name) for a in args]])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "--limit" in err, err
    assert budget_name not in vattn.budget.names()


def test_rm_refuses_a_budget_in_use_unless_forced(budget_name, capsys):
    b = vattn.Budget.create(budget_name, GiB)
    m = b.join("engine:live")
    assert m.try_grant(GiB // 2)
    assert main(["budget", "rm", budget_name]) == 1
    err = capsys.readouterr().err
    assert f"budget '{budget_name}' has 1 live member" in err and "--force" in err
    assert budget_name in vattn.budget.names() and m.try_grant(1)
    assert main(["budget", "rm", "--force", budget_name]) == 0
    assert "1 member(s) in 1 process(es) were told it is gone" in capsys.readouterr().out
    assert budget_name not in vattn.budget.names()
    with pytest.raises(vattn.BudgetError, match="was removed"):
        m.try_grant(1)
