"""Which capacity profile `splitserve up --planner` plans with when no --profile is given
(launch/up_profile.py): the shipped one for the default model, else one measured on this machine
on first use and cached. The measurement itself (`splitserve profile`) is tested on the real
worker in tests/planner/test_profile_cmd.py; here `run` stands in for the subprocess, writing
the profile a real run writes, so the choice, the cache and the progress lines are checked."""

from __future__ import annotations

import json
import pathlib

import pytest

from splitserve.launch.up_profile import cache_path, resolve_profile
from splitserve.planner.profile import CapacityProfile, DecodePoint, PrefillPoint
from splitserve.planner.shipped import SOURCES, shipped_profile

ROOT = pathlib.Path(__file__).resolve().parents[2]
MEASURED = CapacityProfile(
    prefill=(PrefillPoint(128, 900.0), PrefillPoint(1024, 700.0)),
    decode=(DecodePoint(256, 1, 20.0, 0.05), DecodePoint(256, 4, 40.0, 0.1)),
    kv_tokens=10000,
    meta={"cpu_count": 8, "threads": 1, "measured": "2026-11-26T08:00:00Z"},
)


def test_the_default_model_has_a_shipped_profile_identical_to_the_benchmarked_one():
    for model, source in SOURCES.items():
        shipped = shipped_profile(model)
        assert shipped is not None, f"planner/profiles/{model}.json is missing"
        assert json.loads(shipped.read_text()) == json.loads((ROOT / "bench" / "profiles" / source).read_text())
        CapacityProfile.load(str(shipped))
    assert shipped_profile("random:llama-3-8b") is None


class FakeProfileRun:
    """Stands in for `splitserve profile`: records argv, writes MEASURED to --out (or fails)."""

    def __init__(self, returncode=0):
        self.calls, self.returncode = [], returncode

    def __call__(self, argv, **kw):
        self.calls.append(argv)
        if self.returncode == 0:
            pathlib.Path(argv[argv.index("--out") + 1]).write_text(MEASURED.to_json())

        class Done:
            returncode, stderr = self.returncode, "profile: out of memory\n"

        return Done()


def test_the_default_model_plans_with_the_shipped_profile_and_says_so(tmp_path, capsys):
    run = FakeProfileRun()
    path = resolve_profile("smollm2-135m", None, cores=2, cache_home=str(tmp_path), run=run)
    assert path == str(shipped_profile("smollm2-135m")) and run.calls == []
    err = capsys.readouterr().err
    assert (
        "splitserve up: planner: using the capacity profile shipped for smollm2-135m (measured on 2 CPU cores, "
        "1 thread(s) at 2026-11-23T09:12:33Z)" in err
    )
    assert resolve_profile("smollm2-135m", "/mine.json", run=run) == "/mine.json"


def test_another_model_is_measured_once_with_a_progress_line_then_cached(tmp_path, capsys):
    run = FakeProfileRun()
    model = "/models/qwen2-0.5b-instruct-q4_0.gguf"
    first = resolve_profile(model, None, cores=8, cache_home=str(tmp_path), worker_args=["--threads", "1"], run=run)
    assert first == str(cache_path(model, 8, str(tmp_path))) and pathlib.Path(first).is_file()
    assert CapacityProfile.load(first) == MEASURED
    (argv,) = run.calls
    assert argv[3:6] == ["profile", "--model", model] and argv[-2:] == ["--threads", "1"]
    err = capsys.readouterr().err
    assert f"no capacity profile for {model}: measuring one on this machine" in err
    assert f"capacity profile measured and cached: {first}" in err
    again = resolve_profile(model, None, cores=8, cache_home=str(tmp_path), run=run)
    assert again == first and len(run.calls) == 1
    assert "using the capacity profile measured earlier on this machine" in capsys.readouterr().err
    # another core count is another machine: measured again
    assert resolve_profile(model, None, cores=4, cache_home=str(tmp_path), run=run) != first


def test_a_failed_measurement_says_what_to_do_and_caches_nothing(tmp_path):
    with pytest.raises(
        SystemExit,
        match=r"measuring a capacity profile for m failed \(exit 1\):\n"
        r"profile: out of memory\n\npass one with --profile",
    ):
        resolve_profile("m", None, cores=2, cache_home=str(tmp_path), run=FakeProfileRun(returncode=1))
    assert list(tmp_path.rglob("*.json")) == [] and list(tmp_path.rglob("*.partial")) == []
