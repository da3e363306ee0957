"""``scripts/bench --targets``: each speed target beside what a run measured.

The figures here are given, not measured (timings are for ``scripts/bench``, not tests):
the report picks each target's line and field, compares it with its bound, and says
which were met, which were not, and which were not measured.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("bench_under_test", ROOT / "scripts/bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_under_test", module)
    spec.loader.exec_module(module)
    return module


def _report(bench: ModuleType, lines: list[dict[str, Any]], capsys: Any) -> tuple[int, Any]:
    bench._EMITTED[:] = lines
    missed = bench.report_targets()
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["bench"] == "targets" and summary["of"] == len(bench.TARGETS)
    return missed, (summary, err)


def test_each_target_is_read_from_its_own_line_and_field(bench: ModuleType, capsys: Any) -> None:
    lines = [
        {"bench": "turn_overhead_ratio", "value": 1.1},
        {"bench": "turns_workload", "value": 9.0, "p50_ms": 0.6},  # p50_ms, not value
        {"bench": "floor_ratio", "value": 7.3},
        # printed for two sizes: the one at 1,061 messages counts, not the last printed
        {"bench": "first_token_added_ms", "value": 2.5, "messages": 1061},
        {"bench": "first_token_added_ms", "value": 0.1, "messages": 141},
        # in one process (reported, not the target), then over worker processes: >= 1, met
        {"bench": "many_sessions_turns_per_s", "value": 800.0, "ratio": 0.8},
        {"bench": "many_sessions_processes_turns_per_s", "value": 1100.0, "ratio": 1.0},
        {"bench": "stored_bytes_per_turn", "value": 1024.0},  # <= 1024: met
    ]
    missed, (summary, err) = _report(bench, lines, capsys)
    met = {row["target"].split()[0]: row["met"] for row in summary["rows"]}
    assert met == {
        "turn_overhead_ratio": True,
        "turns_workload": True,
        "floor_ratio": False,
        "first_token_added_ms": False,
        "many_sessions_processes_turns_per_s": True,
        "stored_bytes_per_turn": True,
        "replay_eps": None,  # not run
    }
    assert missed == 3 and summary["value"] == 4
    assert "NOT MET" in err and "not measured" in err


def test_all_met(bench: ModuleType, capsys: Any) -> None:
    fields = {"turns_workload": "p50_ms", "many_sessions_processes_turns_per_s": "ratio"}
    lines = []
    for _name, line, field, op, bound, _what, where in bench.TARGETS:
        value = bound * (2 if op == ">=" else 0.5)
        assert field == fields.get(line, "value")
        lines.append({"bench": line, "value": value, field: value, **where})
    missed, (summary, err) = _report(bench, lines, capsys)
    assert missed == 0 and summary["value"] == len(bench.TARGETS)
    assert "NOT MET" not in err and "not measured" not in err


@pytest.mark.parametrize("turns", ["0", "-3", "many"])
def test_turns_must_be_a_positive_integer(bench: ModuleType, turns: str, capsys: Any) -> None:
    """``--turns 0`` ran no turn and then failed in the median (a traceback); now the
    option is refused before any benchmark runs, naming it and the value."""
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--turns", turns, "turns_workload"])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing measured
    assert "argument --turns: expected a positive integer, got" in err
    assert turns.lstrip("-") in err
