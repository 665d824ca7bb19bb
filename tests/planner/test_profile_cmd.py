"""`splitserve profile` on the real model with a tiny sweep: it writes a profile the planner loads."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from splitserve.planner.profile import CapacityProfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPLITSERVE = pathlib.Path(sys.executable).parent / "splitserve"


@pytest.mark.slow
def test_profile_measures_the_real_worker_and_writes_json(tmp_path):
    out = tmp_path / "profile.json"
    subprocess.run(
        [
            str(SPLITSERVE),
            "profile",
            "--threads",
            "1",
            "--out",
            str(out),
            "--prompt-lens",
            "32,96",
            "--concurrency",
            "1,3",
            "--context",
            "32",
            "--decode-steps",
            "3",
            "--repeats",
            "1",
            "--notes",
            "test",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    prof = CapacityProfile.load(str(out))
    assert [p.prompt_tokens for p in prof.prefill] == [32, 96]
    assert [(d.concurrency, d.context_tokens) for d in prof.decode] == [(1, 32), (3, 32)]
    assert all(p.tokens_per_s > 0 for p in prof.prefill) and all(d.itl_p90_s > 0 for d in prof.decode)
    assert prof.kv_tokens > 0 and prof.meta["model"] == "smollm2-135m" and prof.notes == "test"
    assert json.loads(out.read_text())["meta"]["threads"] == 1


def test_profile_rejects_bad_lists():
    r = subprocess.run(
        [str(SPLITSERVE), "profile", "--out", "/dev/null", "--concurrency", "0,4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "expected positive integers" in r.stderr
