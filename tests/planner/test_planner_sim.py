"""Smoke of bench/planner_sim.py on a short trace: it runs, writes its section, and the planner
serves the trace better than the smallest fixed configuration."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_simulator_smoke_writes_its_section(tmp_path):
    md, js = tmp_path / "benchmarks.md", tmp_path / "rows.json"
    md.write_text("# Benchmarks\n\n<!-- other:begin -->\nkept\n<!-- other:end -->\n")
    subprocess.run([sys.executable, str(ROOT / "bench" / "planner_sim.py"), "--hours", "0.5", "--budget", "4",
                    "--write", str(md), "--json", str(js)], check=True, capture_output=True, text=True, timeout=300)
    text = md.read_text()
    assert "kept" in text and "<!-- planner-sim:begin -->" in text and "| planner |" in text
    rows = json.loads(js.read_text())["rows"]
    assert {"planner", "queue depth 1", "fixed 1P:1D", "fixed 2P:2D", "fixed 1P:3D"} <= set(rows)
    assert "fixed 2P:3D" not in rows                       # over the budget of 4
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
    assert noon > 2 * night                                # the diurnal curve
