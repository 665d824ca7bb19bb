"""Smoke of bench/planner_sim.py on a short trace: it runs, writes its section, and the planner
serves the trace better than the smallest fixed configuration."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_simulator_smoke_writes_its_section(tmp_path):
    md, js = tmp_path / "benchmarks.md", tmp_path / "rows.json"
    md.write_text("# Benchmarks\n\n<!-- other:begin -->\nkept\n<!-- other:end -->\n")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "planner_sim.py"),
            "--hours",
            "0.5",
            "--budget",
            "4",
            "--write",
            str(md),
            "--json",
            str(js),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    page, text = md.read_text(), (tmp_path / "benchmarks" / "planner-sim.md").read_text()
    assert "kept" in page and "](benchmarks/planner-sim.md) | `bench/planner_sim.py` |" in page
    assert "<!-- planner-sim:begin -->" in text and "| planner |" in text
    rows = json.loads(js.read_text())["rows"]
    assert {"planner", "queue depth 1", "fixed 1P:1D", "fixed 2P:2D", "fixed 1P:3D"} <= set(rows)
    assert "fixed 2P:3D" not in rows  # over the budget of 4
    for r in rows.values():
        assert 0.0 <= r["attainment"] <= 1.0 and r["replica_hours"] > 0
    assert rows["planner"]["attainment"] > rows["fixed 1P:1D"]["attainment"]
    assert rows["fixed 1P:1D"]["events"] == 0 and rows["planner"]["events"] > 0


def test_trace_is_seeded_and_shifts_its_mix():
    sys.path.insert(0, str(ROOT / "bench"))
    from planner_trace import generate

    a, b = generate(3, 1.0), generate(3, 1.0)
    assert a == b and a != generate(4, 1.0)
    morning = [r for r in a if r.arrival_s < 8 * 3600]
    evening = [r for r in a if r.arrival_s > 16 * 3600]
    share = lambda rs: sum(r.kind == "chat" for r in rs) / len(rs)  # noqa: E731
    assert share(morning) < 0.3 < 0.7 < share(evening)
    noon = sum(11 * 3600 < r.arrival_s < 13 * 3600 for r in a)
    night = sum(r.arrival_s < 2 * 3600 or r.arrival_s > 22 * 3600 for r in a)
    assert noon > 2 * night  # the diurnal curve


def test_the_trace_is_sized_from_the_profile_and_the_budget_from_the_trace():
    """The peak rate depends on the profile and the load, never on the budget; the budget sized from
    the trace covers its busiest window at the planned utilisation with headroom."""
    sys.path.insert(0, str(ROOT / "bench"))
    from planner_sim import DEFAULT_PROFILE, compare
    from planner_sizing import busiest, peak_rps_for_load, platform_budget
    from planner_trace import generate

    from splitserve.planner.profile import CapacityProfile

    prof = CapacityProfile.load(DEFAULT_PROFILE)
    peak = peak_rps_for_load(prof, 0.25, 3.0)
    assert peak_rps_for_load(prof, 0.25, 6.0) == pytest.approx(2 * peak)  # load is linear in the rate
    trace = generate(0, peak)
    budget, busy = platform_budget(trace, prof, 0.25)
    assert busy == busiest(trace, prof, 0.25, 900.0)
    assert budget >= (busy["prefill"] + busy["decode"]) / 0.8 * 1.25
    small = compare(prof, duration_s=1800, day_s=1800, budget=3, fixed_configs=[(1, 1)], thresholds=(1,))
    large = compare(prof, duration_s=1800, day_s=1800, budget=9, fixed_configs=[(1, 1)], thresholds=(1,))
    assert small["trace"]["requests"] == large["trace"]["requests"]
    assert small["trace"]["peak_rps"] == large["trace"]["peak_rps"]
    assert small["cfg"].budget == 3 and large["cfg"].budget == 9
    with pytest.raises(ValueError, match="load"):
        peak_rps_for_load(prof, 0.25, 0.0)
