"""The control law (planner/law.py) on hand-computed cases, driven tick by tick on plain objects."""

from __future__ import annotations

import random

import pytest

from splitserve.planner.capacity import OnlineCapacity, ReplicaSample
from splitserve.planner.config import PlannerConfig, PoolBounds
from splitserve.planner.law import Observation, Planner, PoolObservation
from splitserve.planner.profile import CapacityProfile, DecodePoint, PrefillPoint
from splitserve.platform.errors import ConfigError

# One replica: 8,000 prefill tokens/s at any length; decode at 1,000 context: ITL 40 ms at
# 64 sequences giving 1,600 tokens/s; 200k KV tokens.
PROFILE = CapacityProfile(
    prefill=(PrefillPoint(128, 8000.0), PrefillPoint(8192, 8000.0)),
    decode=(
        DecodePoint(1000, 1, 50.0, 0.020),
        DecodePoint(1000, 8, 320.0, 0.025),
        DecodePoint(1000, 64, 1600.0, 0.040),
        DecodePoint(1000, 128, 2000.0, 0.064),
    ),
    kv_tokens=200_000,
)
BIG = PoolBounds(min_replicas=1, max_replicas=64)


def cfg(**kw) -> PlannerConfig:
    base = dict(itl_p90_s=0.040, headroom=0.0, prefill=BIG, decode=BIG)
    base.update(kw)
    return PlannerConfig(**base)


def obs(t, prompt_tps, output_tps, ready=None, pending=(0, 0), pending_age=(0.0, 0.0), **kw):
    ready = ready or (1, 1)
    return Observation(
        now=t,
        uncached_prompt_tokens_per_s=prompt_tps,
        output_tokens_per_s=output_tps,
        prefill=PoolObservation(ready[0], pending[0], pending_age[0]),
        decode=PoolObservation(ready[1], pending[1], pending_age[1]),
        **kw,
    )


def traffic(rps, isl, osl, cached=0.0):
    """(uncached prompt tokens/s, output tokens/s, mean prompt, mean output) of a request mix."""
    return rps * isl * (1 - cached), rps * osl, isl, osl


def run(planner, t, rates, ticks, **kw):
    """Ticks with pods becoming ready at once; returns the list of targets after each tick."""
    out = []
    for _ in range(ticks):
        cur = planner.targets()
        d = planner.tick(
            obs(
                t,
                rates[0],
                rates[1],
                ready=(cur["prefill"], cur["decode"]),
                mean_prompt_tokens=rates[2],
                mean_output_tokens=rates[3],
                **kw,
            )
        )
        out.append(d.desired())
        t += planner.cfg.tick_s
    return out


def test_formula_example_gives_three_prefill_replicas():
    # 10 req/s × 2,000 tokens × 70 % uncached = 14,000 tokens/s; 8,000 × 0.8 = 6,400 per replica
    # → ceil(2.19) = 3.
    p = Planner(cfg(), PROFILE)
    d = p.tick(obs(0.0, *traffic(10, 2000, 100, cached=0.3)[:2], mean_prompt_tokens=2000, mean_output_tokens=100))
    assert d.prefill.need == 3 and d.prefill.desired == 2  # doubling per tick from 1
    d = p.tick(obs(15.0, 14000.0, 1000.0, ready=(2, 1), mean_prompt_tokens=2000, mean_output_tokens=100))
    assert d.prefill.desired == 3 and d.prefill.reason == "scale_up"
    assert d.prefill.capacity == 8000.0
    # Decode: 1,000 output tokens/s over 1,600 × 0.8 = 1,280 → 1 replica.
    assert d.decode.desired == 1


def test_ratio_follows_the_length_mix():
    def steady(mix):
        p = Planner(cfg(), PROFILE)
        return run(p, 0.0, traffic(10, *mix), 8)[-1]

    a, b = steady((4000, 100)), steady((100, 1000))
    ratio_a, ratio_b = a["prefill"] / a["decode"], b["prefill"] / b["decode"]
    assert ratio_a >= 2 * ratio_b, (a, b)
    # 40,000 / 6,400 → 7 prefill, 1,000 / 1,280 → 1 decode; 1,000 / 6,400 → 1, 10,000 / 1,280 → 8.
    assert a == {"prefill": 7, "decode": 1} and b == {"prefill": 1, "decode": 8}


def test_load_step_reaches_target_within_two_ticks_overshoot_at_most_one():
    p = Planner(cfg(), PROFILE)
    low = traffic(4, 2000, 300)  # 8,000 / 6,400 → 2 prefill; 1,200 / 1,280 → 1 decode
    assert run(p, 0.0, low, 6)[-1] == {"prefill": 2, "decode": 1}
    high = traffic(8, 2000, 600)  # 16,000 / 6,400 → 3; 4,800 / 1,280 → 4
    # The first tick after the step sees latency over the SLO as well (queues built up).
    first = run(p, 100.0, high, 1, ttft_p90_s=5.0, itl_p90_s=0.2)
    rest = run(p, 115.0, high, 40)
    seq = first + rest
    for k, target in {"prefill": 3, "decode": 4}.items():
        assert seq[1][k] >= target, seq[:3]
        assert max(s[k] for s in seq) <= target + 1, seq
        assert seq[-1][k] == target  # the trim's extra replica is given back


@pytest.mark.parametrize("seed", range(6))
def test_noise_of_five_percent_for_an_hour_makes_at_most_one_scale_event_per_pool(seed):
    rng = random.Random(seed)
    rps = rng.uniform(2, 20)  # anywhere, including near a replica boundary
    base = traffic(rps, 2000, 400)
    p = Planner(cfg(headroom=0.1), PROFILE)
    run(p, 0.0, base, 10)  # converge without noise
    t, events, last = 150.0, {"prefill": 0, "decode": 0}, p.targets()
    for _ in range(240):  # one hour of 15 s ticks
        noisy = (base[0] * rng.uniform(0.95, 1.05), base[1] * rng.uniform(0.95, 1.05), *base[2:])
        now = run(p, t, noisy, 1)[0]
        for k in events:
            events[k] += now[k] != last[k]
        last, t = now, t + 15.0
    assert events["prefill"] <= 1 and events["decode"] <= 1, (rps, events)


def test_zero_traffic_drains_each_pool_to_its_minimum_in_bounded_time():
    c = cfg(prefill=PoolBounds(1, 64), decode=PoolBounds(0, 64))
    p = Planner(c, PROFILE)
    run(p, 0.0, traffic(20, 2000, 600), 8)
    start = p.targets()
    assert start["prefill"] >= 5 and start["decode"] >= 5
    # Bound: one peak window to see sustained zero, the scale-down window, then one replica a tick.
    bound = c.peak_window_s + c.scale_down_window_s + (max(start.values()) + 1) * c.tick_s
    seq = run(p, 200.0, (0.0, 0.0, 2000, 600), int(bound / c.tick_s) + 1)
    assert seq[-1] == {"prefill": 1, "decode": 0}


def test_pods_stuck_pending_cause_at_most_one_replica_beyond_the_ready_ones():
    c = cfg()
    p = Planner(c, PROFILE, initial={"prefill": 2, "decode": 1})
    heavy = traffic(20, 2000, 100)  # needs 7 prefill
    asked, t, first_pending = [], 0.0, None
    for _ in range(40):  # 10 minutes: the new pods never start
        cur = p.targets()["prefill"]
        pending = cur - 2
        first_pending = t if pending and first_pending is None else first_pending
        age = t - first_pending if pending else 0.0
        d = p.tick(
            obs(
                t,
                heavy[0],
                heavy[1],
                ready=(2, 1),
                pending=(pending, 0),
                pending_age=(age, 0.0),
                mean_prompt_tokens=2000,
                mean_output_tokens=100,
            )
        )
        asked.append(d.prefill.desired)
        t += c.tick_s
    assert max(asked) <= 4  # one doubling, then no more while pods are Pending
    assert asked[-1] == 3 and p.tick(
        obs(
            t,
            heavy[0],
            heavy[1],
            ready=(2, 1),
            pending=(1, 0),
            pending_age=(999.0, 0.0),
            mean_prompt_tokens=2000,
            mean_output_tokens=100,
        )
    ).prefill.reason in ("capped_pending", "wait_pending")
    # Load falls: scale-down still works although a pod is stuck.
    seq = run(p, t + 15, (0.0, 0.0, 2000, 100), 60)
    assert seq[-1]["prefill"] == 1


def test_warm_up_samples_do_not_change_capacity():
    online = OnlineCapacity(warmup_s=60.0)
    cold = [ReplicaSample("decode", f"d{i}", age_s=5.0, tokens_per_s=200.0, within_slo=False) for i in range(10)]
    assert online.observe(cold) == 0
    assert online.capacity("decode", 1600.0) == 1600.0
    warm = [ReplicaSample("decode", "d1", age_s=300.0, tokens_per_s=1000.0, within_slo=False)]
    assert online.observe(warm) == 1
    assert online.capacity("decode", 1600.0) == 1000.0  # saturated and missing the SLO at 1,000
    ok = [ReplicaSample("prefill", "p1", age_s=300.0, tokens_per_s=9000.0, within_slo=True)]
    online.observe(ok)
    assert online.capacity("prefill", 8000.0) == 9000.0  # served more within the SLO


def test_warm_up_samples_do_not_change_the_decision():
    load = traffic(4, 2000, 600)
    cold = tuple(ReplicaSample("decode", "d", age_s=1.0, tokens_per_s=100.0, within_slo=False) for _ in range(20))
    a, b = Planner(cfg(), PROFILE), Planner(cfg(), PROFILE)
    assert run(a, 0.0, load, 6) == run(b, 0.0, load, 6, samples=cold)


def test_missing_metrics_hold_the_last_target():
    p = Planner(cfg(), PROFILE)
    run(p, 0.0, traffic(10, 2000, 600), 6)
    before = p.targets()
    for i in range(100):  # 25 minutes without metrics
        d = p.tick(obs(200.0 + 15 * i, None, None, ready=(before["prefill"], before["decode"])))
        assert d.desired() == before
        assert d.prefill.reason == d.decode.reason == "hold_missing_metrics"


def test_two_decode_replicas_at_seventy_percent_do_not_flap_to_one():
    # 2 replicas × 1,600 × 0.7 = 2,240 output tokens/s: one survivor would run at 140 %.
    p = Planner(cfg(scale_down_window_s=0.0), PROFILE, initial={"prefill": 1, "decode": 2})
    seq = run(p, 0.0, (100.0, 2240.0, 500, 500), 40)
    assert all(s["decode"] == 2 for s in seq)


def test_budget_splits_in_proportion_to_need():
    p = Planner(cfg(budget=6), PROFILE)
    seq = run(p, 0.0, traffic(10, 4000, 500), 8)  # needs 7 prefill + 4 decode
    assert seq[-1]["prefill"] + seq[-1]["decode"] == 6
    assert seq[-1]["prefill"] > seq[-1]["decode"] >= 1


def test_decode_kv_need_adds_replicas():
    p = Planner(cfg(), PROFILE)
    # 400 sequences × 1,000 context / (200,000 × 0.8) = 2.5 → 3 replicas, though tokens/s needs 1.
    seq = run(p, 0.0, (100.0, 100.0, 500, 1000), 4, inflight_decode_seqs=400)
    assert seq[-1]["decode"] == 3


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(utilization=1.5), "utilization must be in (0, 1]"),
        (dict(down_threshold=0.9, utilization=0.8), "down_threshold"),
        (dict(ttft_p90_s=0), "ttft_p90_s must be > 0"),
        (dict(budget=1), "budget"),
        (dict(prefill=PoolBounds(3, 64), decode=PoolBounds(3, 64), budget=5), "budget"),
    ],
)
def test_bad_config_is_rejected_with_a_clear_message(kw, msg):
    with pytest.raises(
        ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
    ):
        PlannerConfig(**kw)


def test_bad_bounds_are_rejected():
    with pytest.raises(ConfigError, match="max_replicas must be >="):
        PoolBounds(min_replicas=4, max_replicas=2)


def test_profile_round_trips_through_json_and_rejects_garbage():
    assert CapacityProfile.from_json(PROFILE.to_json()) == PROFILE
    with pytest.raises(ConfigError, match="not a capacity profile"):
        CapacityProfile.from_json('{"prefill": []}')
    with pytest.raises(ConfigError, match="at least one prefill"):
        CapacityProfile.from_json('{"prefill": [], "decode": [], "kv_tokens": 1}')


def test_profile_interpolates_and_clamps():
    prof = CapacityProfile(
        prefill=(PrefillPoint(100, 1000.0), PrefillPoint(300, 3000.0)), decode=PROFILE.decode, kv_tokens=1
    )
    assert prof.prefill_tokens_per_s(200) == 2000.0
    assert prof.prefill_tokens_per_s(10_000) == 3000.0
    # ITL target 52 ms lies halfway between 40 ms (1,600 tok/s) and 64 ms (2,000): 1,800.
    assert prof.decode_tokens_per_s(0.052, 1000) == pytest.approx(1800.0)
