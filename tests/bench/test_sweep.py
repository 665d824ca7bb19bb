"""bench/sweep.py's search and goodput on synthetic results (the sweep itself is a benchmark)."""

import dataclasses
import json
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import sweep  # noqa: E402


def point(arm, rate, p90_s, tps=None, failed=0, hit=0.5):
    return sweep.Point(arm, rate, p90_s * 500, p90_s * 1000, 50.0, 900.0, 1200.0, tps or rate * 16, hit, 24, failed)


def test_goodput_is_the_highest_rate_meeting_the_slo_below_the_first_miss():
    points = [point("a", 0.5, 0.4), point("a", 1.0, 1.9), point("a", 1.5, 2.1), point("a", 2.0, 1.0)]
    assert sweep.goodput(points, "a", 2.0).rate == 1.0  # 2.0 met again after a miss: not counted
    assert sweep.goodput(points, "a", 3.0).rate == 2.0
    assert sweep.goodput(points, "a", 0.3) is None  # met at no rate
    assert sweep.goodput([point("a", 0.5, 2.0)], "a", 2.0).rate == 0.5  # the SLO itself meets it
    assert sweep.goodput(points, "b", 2.0) is None


def test_a_failed_request_misses_the_slo_whatever_the_latency():
    assert not point("a", 1.0, 0.1, failed=1).meets(2.0)
    empty = sweep.Point("a", 1.0, None, None, None, None, None, 0.0, None, 0, 24)
    assert not empty.meets(2.0)


def test_an_arm_leaves_the_search_at_its_first_miss_and_the_order_rotates():
    points = [point("rr", 0.5, 1.0), point("pq", 0.5, 0.3), point("rr", 1.0, 2.5), point("pq", 1.0, 0.4)]
    assert not sweep.still_searching("rr", points, 2.0)
    assert sweep.still_searching("pq", points, 2.0) and sweep.still_searching("new", points, 2.0)
    arms = ("a", "b", "c")
    assert [sweep.step_order(arms, k) for k in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


def test_the_sweep_runs_each_rate_for_the_arms_still_in_and_stops_when_none_is(monkeypatch):
    p90 = {"round-robin": {0.5: 1.5, 1.0: 3.0}, "prefix+queue": {0.5: 0.3, 1.0: 0.5, 2.0: 2.5}}
    ran = []

    def fake_run(arm, rate, setup, raw):
        ran.append((arm, rate))
        return point(arm, rate, p90[arm][rate]), [28, 28]

    monkeypatch.setattr(sweep, "run_point", fake_run)
    setup = sweep.Setup({}, 28, 256, 24, 2.0)
    points, kv = sweep.sweep(("round-robin", "prefix+queue"), [0.5, 1.0, 2.0, 4.0], setup, pathlib.Path("."))
    assert ran == [
        ("round-robin", 0.5),
        ("prefix+queue", 0.5),
        ("prefix+queue", 1.0),  # step 1 starts with the second arm
        ("round-robin", 1.0),
        ("prefix+queue", 2.0),  # round robin has left; prefix+queue leaves here and 4.0 never runs
    ]
    assert kv == [28] and len(points) == 5


def test_a_resumed_sweep_reads_back_the_points_whose_seeds_all_finished(monkeypatch, tmp_path):
    """--resume after a crash: a point with every seed's JSON in --raw is read back, not run; one
    with a seed missing (the run the crash ended) runs again, as does everything after it."""
    p90 = {"round-robin": {0.5: 1.5, 1.0: 3.0}, "prefix+queue": {0.5: 0.3, 1.0: 0.5, 2.0: 2.5}}
    ran = []

    def fake_run(arm, rate, setup, raw):
        ran.append((arm, rate))
        return point(arm, rate, p90[arm][rate]), [28, 28]

    def seed_doc(arm, rate):
        ms = {"p50": 100.0, "p90": p90[arm][rate] * 1000}
        summary = {"ttft_ms": ms, "itl_ms": ms, "e2e_ms": ms, "output_throughput": 8.0}
        summary.update(prefix_cache_hit_rate=0.8, completed=24, failed=0)
        return json.dumps({"config": {"rate": rate}, "summary": summary})

    for arm, rate, seeds in (("round-robin", 0.5, (0,)), ("prefix+queue", 0.5, (0,)), ("prefix+queue", 1.0, (0,))):
        for seed in seeds:
            (tmp_path / f"{sweep.tag_of(arm, rate, seed)}.json").write_text(seed_doc(arm, rate))
    monkeypatch.setattr(sweep, "run_point", fake_run)
    setup = sweep.Setup({}, 28, 256, 24, 2.0, seeds=1)
    points, _ = sweep.sweep(("round-robin", "prefix+queue"), [0.5, 1.0, 2.0], setup, tmp_path, resume=True)
    assert ran == [("round-robin", 1.0), ("prefix+queue", 2.0)]
    assert [(p.arm, p.rate, p.ttft_p90_ms) for p in points][:3] == [
        ("round-robin", 0.5, 1500.0),
        ("prefix+queue", 0.5, 300.0),
        ("prefix+queue", 1.0, 500.0),
    ]
    ran.clear()
    two_seeds = sweep.Setup({}, 28, 256, 24, 2.0, seeds=2)  # seed 1 never finished: all run again
    sweep.sweep(("round-robin", "prefix+queue"), [0.5], two_seeds, tmp_path, resume=True)
    assert ran == [("round-robin", 0.5), ("prefix+queue", 0.5)]


def test_the_verdict_reads_goodput_and_throughput_ratios():
    points = [
        point("round-robin", 0.5, 1.0, tps=8.0),
        point("round-robin", 1.0, 2.5, tps=12.0),
        point("prefix+queue", 0.5, 0.3, tps=8.1),
        point("prefix+queue", 1.0, 0.6, tps=16.0),
        point("prefix+queue", 2.0, 1.5, tps=31.0),
        point("epp", 0.5, 0.3),
        point("epp", 1.0, 0.7),
        point("epp", 2.0, 2.2),
    ]
    v = sweep.verdict(points, 2.0)
    assert v.goodput_ratio == pytest.approx(4.0)
    assert v.tps_at_goodput_ratio == pytest.approx(31.0 / 8.0)
    assert v.tps_at_rr_rate_ratio == pytest.approx(8.1 / 8.0)
    assert v.epp_vs_gateway == pytest.approx(0.5)
    assert sweep.verdict(points[:2], 0.1) == sweep.Verdict(None, None, None, None)
    # another arm against round robin; the EPP still against prefix+queue, the profile it runs
    other = [point("expected-latency", 0.5, 0.2, tps=8.0), point("expected-latency", 1.0, 0.5, tps=16.5)]
    e = sweep.verdict(points + other, 2.0, "expected-latency")
    assert e.goodput_ratio == pytest.approx(2.0) and e.tps_at_goodput_ratio == pytest.approx(16.5 / 8.0)
    assert e.epp_vs_gateway == pytest.approx(0.5)
    # prefix+queue against round robin with the KV pull, reported beside the cache-blind baseline
    pull = [point("round-robin+pull", 0.5, 0.8, tps=8.0), point("round-robin+pull", 1.0, 1.9, tps=15.0)]
    b = sweep.verdict(points + pull, 2.0, base="round-robin+pull")
    assert b.goodput_ratio == pytest.approx(2.0) and b.tps_at_goodput_ratio == pytest.approx(31.0 / 15.0)
    assert any("round-robin+pull **2.00×**" in line for line in sweep.verdict_lines(points + pull, 2.0))


def test_the_kv_budget_holds_the_prefixes_asked_for_and_room_for_four_requests():
    # 64-token prompts are 4 blocks; a request's own 16 + 16 tokens are 2 more blocks
    assert sweep.kv_budget(64, 16, 16, 5) == 5 * 4 + 4 * 2
    # a prompt that ends mid-block: its last partial block is the request's own
    assert sweep.kv_budget(1536, 300, 64, 3) == 3 * 96 + 4 * (119 - 96)


def test_arguments_are_checked_before_any_run(capsys):
    for argv, message in [
        (["--rates", "1,0.5"], "distinct and ascending"),
        (["--rates", "0,1"], "> 0"),
        (["--arms", "round-robin,magic"], "unknown ['magic']"),
        (["--requests", "3"], "--requests must be >= 10"),
    ]:
        with pytest.raises(SystemExit):
            sweep.parse_args(argv)
        assert message in capsys.readouterr().err
    args = sweep.parse_args(["--workload-param", "groups=4", "--kv-prefixes", "4"])
    with pytest.raises(SystemExit, match=r"--kv-prefixes must be in \[1, groups - 1 = 3\]"):
        sweep.make_setup(args)
    setup, holds = sweep.make_setup(sweep.parse_args(["--workload-param", "groups=8"]))
    # the CPU default shape, 192 + 32 -> 16: a system prompt is 12 blocks, a request's own 3
    assert setup.kv_blocks == 5 * 12 + 4 * 3 and holds.startswith("5 of the 8 system prompts")
    assert setup.max_model_len == 256 and setup.params["groups"] == "8"


def test_the_section_has_every_point_the_goodputs_and_the_ratios():
    points = [
        point("round-robin", 0.5, 1.0, tps=8.0),
        point("round-robin", 1.0, 2.5, tps=12.0, hit=0.31),
        point("prefix+queue", 0.5, 0.3, tps=8.1),
        point("prefix+queue", 1.0, 0.6, tps=16.0),
    ]
    meta = {
        "slos": [2.0, 8.0],
        "machine": "2 vCPU test",
        "loadavg": "1.0",
        "date": "2026-11-28",
        "minutes": 3,
        "command": "python bench/sweep.py",
        "shape": "8 groups",
        "requests": 24,
        "kv_blocks_asked": 28,
        "kv_blocks": "28",
        "kv_holds": "5 of the 8 system prompts",
        "miss_s": 1.5,
        "hit_s": 0.4,
    }
    text = sweep.render(points, ("round-robin", "prefix+queue"), meta, {"ttft": "t.png", "goodput": "g.png"})
    assert text.startswith("<!-- sweep:begin -->") and text.endswith("<!-- sweep:end -->")
    assert "| round-robin | 1 | 24/24 | 1250 | 2500 | 50 | 900 | 1200 | 12.0 | 31 % | – | **no** / yes |" in text
    pulled = dataclasses.replace(points[1], prefix_pulled=0.12)  # a run that recorded pulled tokens
    assert "| 12.0 | 31 % | 12 % | **no** / yes |" in sweep.point_row(pulled, [2.0, 8.0])
    assert "| arm | goodput at p90 TTFT ≤ 2 s | goodput at p90 TTFT ≤ 8 s |" in text
    assert "| round-robin | 0.5; 8.0 tok/s | 1 (the ladder's top: at least); 12.0 tok/s |" in text
    assert "- at 2 s: goodput prefix+queue ÷ round robin **2.00×**" in text
    assert "- at 8 s: goodput prefix+queue ÷ round robin **1.00×**" in text and "![TTFT vs load](t.png)" in text
    assert "after a warm-up of each group's system prompt once." in text  # a raw run from before WARM_ROUNDS
    twice = sweep.render(
        points, ("round-robin", "prefix+queue"), {**meta, "warm_rounds": 2}, {"ttft": "t", "goodput": "g"}
    )
    assert "after a warm-up of each group's system prompt twice." in twice


def test_each_point_warms_every_group_twice_before_measuring(monkeypatch, tmp_path):
    """Each run's warm-up reuses every group's system prompt once after caching it (a pool that
    protects hit blocks is then in its steady state), on a fresh cluster that is stopped after."""
    import serving_suite

    from splitserve.bench.loadgen import workloads

    runs, stopped = [], []

    class Cluster:
        url, kv_blocks = "http://x", [72, 72]

        def stop(self):
            stopped.append(True)

    def bench(run, url, raw, tag):
        runs.append(run)
        return {
            "summary": {
                "ttft_ms": None,
                "itl_ms": None,
                "e2e_ms": None,
                "output_throughput": 1.0,
                "prefix_cache_hit_rate": 0.8,
                "completed": 48,
                "failed": 0,
            }
        }

    monkeypatch.setattr(sweep, "start_cluster", lambda arm, setup, raw: Cluster())
    monkeypatch.setattr(serving_suite, "bench", bench)
    setup = sweep.Setup({"groups": "8", "per_group": "6"}, 72, 256, 48, 2.0)
    sweep.run_point("prefix+queue", 2.0, setup, tmp_path)
    assert [r.seed for r in runs] == [0] and stopped == [True]
    wl = workloads.build("shared-prefix", dict(runs[0].params), num_requests=48, num_warmup=runs[0].warmup)
    assert sorted(r.tag for r in wl.warmup) == sorted([f"group-{g}" for g in range(8)] * 2)


def test_search_slo_must_not_be_below_the_slo(capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args(["--slo", "2", "--search-slo", "1"])
    assert "--search-slo must be a number of seconds >= --slo (2)" in capsys.readouterr().err
    args = sweep.parse_args(["--search-slo", "8"])
    assert args.slos == [2.0, 8.0] and sweep.make_setup(args)[0].slo_s == 8.0


def test_an_interrupted_run_is_reported_from_its_raw_folder(tmp_path):
    def bench_doc(rate, p90_ms, hit):
        ms = {"p50": p90_ms / 2, "p90": p90_ms}
        summary = {"ttft_ms": ms, "itl_ms": ms, "e2e_ms": ms, "output_throughput": rate * 16}
        summary.update(prefix_cache_hit_rate=hit, completed=24, failed=0)
        return {"config": {"rate": rate}, "summary": summary}

    write = {
        "sweep-prefix-queue-r0.5.json": bench_doc(0.5, 900.0, 0.78),
        "sweep-prefix-queue-r0.5.kv.json": [28, 28],
        "sweep-round-robin-r0.35.json": bench_doc(0.35, 2100.0, 0.43),
        "sweep-epp-r1.json": bench_doc(1.0, 1500.0, 0.7),
        "sweep-meta.json": {"arms": ["round-robin"]},
    }
    for name, doc in write.items():
        (tmp_path / name).write_text(sweep.json.dumps(doc))
    points, kv = sweep.points_from_raw(tmp_path)
    assert [(p.arm, p.rate, p.ttft_p90_ms, p.prefix_hit) for p in points] == [
        ("epp", 1.0, 1500.0, 0.7),
        ("prefix+queue", 0.5, 900.0, 0.78),
        ("round-robin", 0.35, 2100.0, 0.43),
    ]
    assert kv == [28]
    assert sweep.tag_arm("sweep-least-queue-r1.5") == "least-queue"


def test_a_points_seeds_are_pooled_into_one_set_of_requests(tmp_path):
    """--seeds N: the runs of one arm and rate count as one set of requests (the p90 over all of
    them, throughput over their summed time), read back from the raw folder the same way."""
    from splitserve.bench.loadgen.client import RequestResult
    from splitserve.bench.loadgen.report import _record

    def run_doc(rate, ttfts, duration_s, cached, pulled=0):
        results = [
            RequestResult(i, "", "g", 224, 16, success=True, ttft_s=t, itl_s=[0.02] * 15, e2e_s=t + 0.3)
            for i, t in enumerate(ttfts)
        ]
        for r in results:
            r.num_output_tokens, r.num_cached_tokens, r.num_pulled_tokens = 16, cached, pulled
        return {"config": {"rate": rate}, "duration_s": duration_s, "requests": [_record(r) for r in results]}

    quiet = run_doc(3.0, [0.2] * 10, 4.0, 192)  # seed 0: every request fast, every prompt a hit
    burst = run_doc(3.0, [0.2] * 8 + [3.0] * 2, 6.0, 0, 192)  # seed 1: a queue built, spills pulled; its p90 3 s
    assert sweep.pooled_summary([{"summary": {"one": 1}}]) == {"one": 1}  # one run: its own summary
    pooled = sweep.Point.from_summary("epp", 3.0, sweep.pooled_summary([quiet, burst]))
    assert pooled.completed == 20 and pooled.failed == 0
    assert pooled.ttft_p90_ms == pytest.approx(float(np.percentile([0.2] * 18 + [3.0] * 2, 90)) * 1000)
    assert 200 < pooled.ttft_p90_ms < 3000  # neither run's own p90 (200 ms, 3 s)
    assert pooled.output_tps == pytest.approx(20 * 16 / 10.0)
    assert pooled.prefix_hit == pytest.approx(192 / 448) and pooled.prefix_pulled == pytest.approx(192 / 448)
    before = {"ttft_ms": None, "itl_ms": None, "e2e_ms": None, "output_throughput": 1.0, "completed": 1, "failed": 0}
    before["prefix_cache_hit_rate"] = 0.8  # a raw run from before pulled tokens were recorded
    assert sweep.Point.from_summary("epp", 3.0, before).prefix_pulled is None
    for name, doc in {"sweep-epp-r3.json": quiet, "sweep-epp-r3-s1.json": burst}.items():
        (tmp_path / name).write_text(sweep.json.dumps(doc))
    (tmp_path / "sweep-epp-r3-s1.kv.json").write_text("[72, 72]")
    points, kv = sweep.points_from_raw(tmp_path)
    assert points == [pooled] and kv == [72]
    assert sweep.tag_arm("sweep-prefix-queue-r0.5-s2") == "prefix+queue"


def test_seeds_are_checked(capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args(["--seeds", "0"])
    assert "--seeds must be in [1, 16], got 0" in capsys.readouterr().err
    assert sweep.make_setup(sweep.parse_args(["--seeds", "3"]))[0].seeds == 3


def test_round_robin_is_cache_blind_and_the_pull_arm_is_round_robin_with_the_pull():
    """The baseline places without the prefix index: its router has the KV pull off (a worker
    without the prefix computes it, as a vLLM pod behind a round-robin balancer does); the
    `round-robin+pull` arm is the same placement with the router's default pull."""
    from splitserve.router.config.file import from_dict

    configs = {
        arm: from_dict(sweep.arm_of(arm).router_config(8000, ["127.0.0.1:1", "127.0.0.1:2"]))
        for arm in ("round-robin", "round-robin+pull", "prefix+queue")
    }
    assert [s.name for s in configs["round-robin"].placement.decode.scorers] == ["round-robin"]
    assert [s.name for s in configs["round-robin+pull"].placement.decode.scorers] == ["round-robin"]
    assert not configs["round-robin"].placement.kv_pull.enabled
    assert configs["round-robin+pull"].placement.kv_pull.enabled
    assert configs["prefix+queue"].placement.kv_pull.enabled
    assert sweep.tag_arm("sweep-round-robin-pull-r2.5-s1") == "round-robin+pull"
    assert sweep.tag_arm("sweep-round-robin-r2.5") == "round-robin"
