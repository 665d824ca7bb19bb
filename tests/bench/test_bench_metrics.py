"""Metric definitions on hand-made request records (vLLM's calculate_metrics), and SLO parsing."""

import re

import numpy as np
import pytest

from splitserve.bench.loadgen import metrics
from splitserve.bench.loadgen.client import RequestResult
from splitserve.platform.errors import ConfigError


def req(ttft, itl=(), start=0.0, out=None, max_tokens=None, prompt=10, cached=None, ok=True):
    n = 1 + len(itl)
    return RequestResult(
        index=0,
        category="",
        tag="",
        num_prompt_tokens=prompt,
        max_tokens=max_tokens or (out or n),
        start_s=start,
        success=ok,
        ttft_s=ttft,
        itl_s=list(itl),
        e2e_s=ttft + sum(itl),
        num_output_tokens=out,
        num_cached_tokens=cached,
    )


def test_tpot_excludes_the_first_token_and_uses_the_usage_count():
    r = req(0.5, [0.1, 0.2, 0.3])
    assert metrics.tpot(r) == pytest.approx(0.6 / 3)
    bundled = req(0.5, [0.1, 0.2, 0.3], out=7)  # the server bundled 7 tokens into 4 chunks
    assert metrics.tpot(bundled) == pytest.approx(0.6 / 6)
    assert metrics.tpot(req(0.5)) is None


def test_summary_pools_itl_and_uses_numpy_percentiles():
    rs = [req(0.1, [0.01, 0.03]), req(0.4, [0.02] * 5), req(0.2), req(9.0, ok=False)]
    s = metrics.compute(rs, duration_s=2.0, slo=None)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 3 + 6 + 1)
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 5.0 and s["total_token_throughput"] == 20.0
    itl = [0.01, 0.03] + [0.02] * 5
    assert s["itl_ms"] == pytest.approx(
        {
            "mean": 1000 * np.mean(itl),
            "std": 1000 * np.std(itl),
            **{f"p{p}": 1000 * np.percentile(itl, p) for p in (50, 90, 99)},
        }
    )
    # the longest gap per request, over the requests that have a gap at all
    assert s["max_itl_ms"]["p50"] == pytest.approx(1000 * np.percentile([0.03, 0.02], 50))
    assert s["max_itl_ms"]["p99"] == pytest.approx(1000 * np.percentile([0.03, 0.02], 99))
    assert s["tpot_ms"]["mean"] == pytest.approx(1000 * np.mean([0.02, 0.02]))  # the 1-token request has none
    assert s["ttft_ms"]["p50"] == pytest.approx(200) and s["ttft_ms"]["p90"] == pytest.approx(1000 * 0.36)
    assert s["e2e_ms"]["p99"] == pytest.approx(1000 * np.percentile([0.14, 0.5, 0.2], 99))


def test_goodput_needs_every_slo_and_counts_one_token_requests_as_tpot_zero():
    rs = [
        req(0.1, [0.01] * 4),  # good
        req(0.6, [0.01] * 4),  # TTFT
        req(0.1, [0.2] * 4),  # TPOT
        req(0.1, [0.09] * 40),  # E2E (3.7 s), TPOT 0.09 fine
        req(0.3),  # one token: TPOT counts as 0
        req(0.1, ok=False),
    ]  # failed: never good
    slo = metrics.parse_slo("ttft=0.5,tpot=0.1,e2e=2")
    assert [slo.is_met(r) for r in rs[:5]] == [True, False, False, False, True]
    s = metrics.compute(rs, duration_s=4.0, slo=slo)
    assert s["request_goodput"] == 2 / 4.0 and s["slo_attainment"] == 2 / 5
    assert metrics.compute(rs, 4.0, metrics.parse_slo("tpot=0.1"))["request_goodput"] == 4 / 4.0
    assert metrics.SLO(ttft_s=0.1).is_met(req(0.1))  # a limit is inclusive, as in vLLM


def test_empty_sets_peak_in_flight_cache_rate_and_length_mismatch():
    s = metrics.compute([req(0.1, ok=False)], 1.0, None)
    assert s["ttft_ms"] is None and s["itl_ms"] is None and s["prefix_cache_hit_rate"] is None
    assert s["max_itl_ms"] is None
    back_to_back = [req(0.5, start=0.0), req(0.5, start=0.5), req(0.2, start=0.6)]
    assert metrics.peak_in_flight(back_to_back) == 2  # [0, 0.5) and [0.5, 1.0) do not overlap
    cached = [req(0.1, prompt=100, cached=64), req(0.1, prompt=50, cached=0), req(0.1, prompt=30)]
    assert metrics.compute(cached, 1.0, None)["prefix_cache_hit_rate"] == pytest.approx(64 / 150)
    short = [req(0.1, [0.1], max_tokens=16), req(0.1, [0.1])]
    assert metrics.compute(short, 1.0, None)["output_len_mismatch"] == 1


def test_parse_slo():
    assert metrics.parse_slo("ttft=0.5,tpot=0.1,e2e=10") == metrics.SLO(0.5, 0.1, 10.0)
    assert metrics.parse_slo(" tpot = 0.05 ") == metrics.SLO(tpot_s=0.05)
    assert metrics.SLO(0.5, None, 10.0).describe() == "ttft<=0.5s, e2e<=10s"


@pytest.mark.parametrize(
    "text, message",
    [
        ("ttft:0.5", "bad SLO item 'ttft:0.5' in 'ttft:0.5': expected KEY=SECONDS with KEY one of ttft, tpot, e2e"),
        ("itl=0.1", "bad SLO item 'itl=0.1'"),
        ("ttft=fast", "SLO ttft='fast' is not a number of seconds"),
        ("ttft=-1", "SLO ttft=-1 must be a positive, finite number of seconds"),
        ("e2e=inf", "must be a positive, finite number"),
        ("ttft=1,ttft=2", "SLO key 'ttft' given twice"),
        ("ttft=1,", "bad SLO item ''"),
    ],
)
def test_bad_slo_syntax_is_explained(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        metrics.parse_slo(text)
