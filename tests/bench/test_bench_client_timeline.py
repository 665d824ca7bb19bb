"""`splitserve bench` against a scripted server: known token times give known metrics.

The server writes chunks on a scripted timeline and records when each one actually left (the
same perf_counter clock as the client). Client measurements are compared with those wire times:
gaps within GAP_TOL; TTFT and E2E also include the client's own send path and the server's
request parsing (about 2 ms a request here, more when several leave at once), so they may exceed
the wire times by up to SEND_TOL. The scripted nominal times are checked more loosely (asyncio
sleeps overshoot on a busy machine). The machine is shared, so a timing scenario is retried when
a scheduling stall spoils it (benchkit.retry_timing)."""

import asyncio

import numpy as np
import pytest
from benchkit import Script, retry_timing

from splitserve.bench.loadgen import metrics, workloads
from splitserve.bench.loadgen.arrivals import arrival_offsets
from splitserve.bench.loadgen.report import _record, from_record
from splitserve.bench.loadgen.runner import RunConfig, run
from splitserve.bench.loadgen.workloads import BenchRequest, Workload

GAP_TOL = 0.004  # client vs wire, between two chunks
SEND_TOL = 0.035  # client vs wire, from send: the client's send path and the server's parsing (below the
# scripts' smallest gap, 0.05 s, so TTFT cannot be confused with the second token)
NOMINAL = 0.04  # wire vs script: sleep overshoot on a busy machine


def hand_workload(max_tokens: list[int], prompt_len: int = 8, warmup: int = 0) -> Workload:
    """Requests with the given output lengths; `warmup` warm-ups (which also open the pooled
    connections, so that no measured request pays for a TCP connect)."""
    wl = workloads.build("random", {"input_len": str(prompt_len)}, num_requests=len(max_tokens), num_warmup=warmup)
    sessions = [(BenchRequest(s[0].prompt_token_ids, m),) for s, m in zip(wl.sessions, max_tokens)]
    warm = [
        BenchRequest(w.prompt_token_ids, max_tokens[i % len(max_tokens)], "warmup") for i, w in enumerate(wl.warmup)
    ]
    return Workload("random", wl.params, sessions, warm)


def bench(server, wl: Workload, **cfg):
    cfg.setdefault("concurrency", None if "rate" in cfg else 8)
    return asyncio.run(run(RunConfig(url=server.url, model="m", progress=False, **cfg), wl))


def test_metrics_follow_the_scripted_token_times(server):
    # The usage event comes 0.2 s after the last token: an E2E that ran to it (or to [DONE])
    # would be 0.2 s too long.
    scripts = {
        3: Script(0.20, (0.05, 0.10), usage_delay_s=0.2),
        5: Script(0.10, (0.05, 0.15, 0.05, 0.10)),
        1: Script(0.15, usage_delay_s=0.2),
    }

    def scenario():
        server.reset(lambda n, p: scripts[p["max_tokens"]] if n >= 3 else Script(0.05))
        result = bench(server, hand_workload([3, 5, 1], warmup=3))
        check_timeline(server, result, scripts)
        return result

    result = retry_timing(scenario)
    by_len = {r.max_tokens: r for r in result.results}
    assert metrics.tpot(by_len[5]) == (by_len[5].e2e_s - by_len[5].ttft_s) / 4
    assert metrics.tpot(by_len[5]) == pytest.approx(0.35 / 4, abs=NOMINAL / 4)
    assert metrics.tpot(by_len[1]) is None

    s = metrics.compute(result.results, result.duration_s, None)
    assert (s["completed"], s["failed"], s["total_output_tokens"], s["total_input_tokens"]) == (3, 0, 9, 24)
    itls = [g for r in result.results for g in r.itl_s]
    assert len(itls) == 6  # pooled over requests, 1-token request adds none
    assert s["itl_ms"]["mean"] == pytest.approx(1000 * np.mean(itls))
    assert s["itl_ms"]["p90"] == pytest.approx(1000 * np.percentile(itls, 90))
    assert s["tpot_ms"]["mean"] == pytest.approx(1000 * np.mean([metrics.tpot(by_len[3]), metrics.tpot(by_len[5])]))
    assert s["ttft_ms"]["p50"] == pytest.approx(1000 * by_len[1].ttft_s)  # the median of 0.10, 0.15, 0.20
    assert s["e2e_ms"]["p99"] == pytest.approx(1000 * np.percentile([r.e2e_s for r in result.results], 99))
    assert s["request_throughput"] == 3 / result.duration_s
    assert s["output_throughput"] == 9 / result.duration_s
    assert result.duration_s == pytest.approx(0.55, abs=NOMINAL)  # the 3-token request's stream ends at 0.55 s
    assert s["request_goodput"] is None


def check_timeline(server, result, scripts) -> None:
    served = {s.payload["max_tokens"]: s for s in server.served[3:]}
    for r in result.results:
        wire, script = served[r.max_tokens], scripts[r.max_tokens]
        assert r.success and r.output_tokens == r.max_tokens
        assert 0 <= r.ttft_s - (wire.sent[0] - wire.arrived) <= SEND_TOL
        assert r.ttft_s == pytest.approx(script.ttft_s, abs=NOMINAL)
        assert r.itl_s == pytest.approx(np.diff(wire.sent).tolist(), abs=GAP_TOL)
        assert r.itl_s == pytest.approx(list(script.gaps_s), abs=NOMINAL)
        assert 0 <= r.e2e_s - (wire.sent[-1] - wire.arrived) <= SEND_TOL
        assert r.e2e_s == pytest.approx(r.ttft_s + sum(r.itl_s), abs=1e-9)


def test_goodput_counts_only_requests_meeting_every_slo(server):
    scripts = [
        Script(0.05, (0.02,) * 3),  # meets all
        Script(0.25, (0.02,) * 3),  # TTFT too slow
        Script(0.05, (0.10,) * 3),  # TPOT too slow
        Script(0.05, (0.04,) * 14),  # E2E too slow (0.61 s), TTFT and TPOT fine
        Script(0.02, (0.01,) * 3),
    ]  # meets all

    def scenario():
        server.reset(lambda n, p: scripts[n - 1] if n else Script())
        result = bench(server, hand_workload([4, 4, 4, 15, 4], warmup=1), concurrency=1)
        every = metrics.compute(result.results, result.duration_s, metrics.parse_slo("ttft=0.15,tpot=0.06,e2e=0.5"))
        assert every["request_goodput"] * result.duration_s == pytest.approx(2)
        assert every["slo_attainment"] == pytest.approx(2 / 5)
        ttft_only = metrics.compute(result.results, result.duration_s, metrics.parse_slo("ttft=0.15"))
        assert ttft_only["request_goodput"] * result.duration_s == pytest.approx(4)
        tpot_e2e = metrics.compute(result.results, result.duration_s, metrics.parse_slo("tpot=0.06,e2e=0.5"))
        assert tpot_e2e["request_goodput"] * result.duration_s == pytest.approx(3)

    retry_timing(scenario)


def test_concurrency_limit_is_respected(server):
    server.reset(lambda n, p: Script(0.03, (0.03,) * 3))
    result = bench(server, hand_workload([4] * 12), concurrency=3)
    assert server.max_in_flight == 3
    assert metrics.peak_in_flight(result.results) == 3
    assert sorted(r.client_queue_s > 0.05 for r in result.results).count(True) >= 6  # later ones waited


def test_warmup_requests_are_sent_first_and_excluded(server):
    def scenario():
        server.reset(lambda n, p: Script(0.3) if n < 2 else Script(0.02, (0.01,)))
        result = bench(server, hand_workload([2] * 4, warmup=2), concurrency=4)
        assert len(server.served) == 6 and len(result.warmup) == 2 and len(result.results) == 4
        assert all(w.ttft_s > 0.25 for w in result.warmup)
        assert all(r.ttft_s < 0.2 for r in result.results)
        assert result.duration_s < 0.25  # the measured phase starts after the warm-up

    retry_timing(scenario)
    measured = {tuple(s.payload["prompt"]) for s in server.served[2:]}
    assert not measured & {tuple(s.payload["prompt"]) for s in server.served[:2]}
    assert [s.payload["max_tokens"] for s in server.served[:2]] == [2, 2]  # shaped like the measured ones


def test_poisson_arrivals_reach_the_server_on_schedule(server):
    expected = arrival_offsets(30, 25.0, 1.0, np.random.default_rng([7, 1]))
    assert expected[-1] == pytest.approx(30 / 25.0)  # rescaled: n requests span n/rate

    def scenario():
        server.reset(lambda n, p: Script(0.0))
        result = bench(server, hand_workload([1] * 30, warmup=1), rate=25.0, seed=7)
        tol = 0.01
        assert result.offsets_s == expected
        assert [r.start_s for r in result.results] == pytest.approx(expected, abs=tol)
        arrived = np.array([s.arrived for s in server.served[1:]])
        assert (arrived - arrived[0]) == pytest.approx(np.array(expected) - expected[0], abs=2 * tol)

    retry_timing(scenario)


def test_requests_carry_exact_token_ids_and_streaming_fields(server):
    server.reset(lambda n, p: Script(0.0, (0.0,) * (p["max_tokens"] - 1)))
    wl = workloads.build("w3", {"long_min": "40", "long_max": "60"}, num_requests=10)
    bench(server, wl, concurrency=2)
    sent = sorted(server.served, key=lambda s: s.arrived)
    flat = [r for s in wl.sessions for r in s]
    assert sorted(tuple(s.payload["prompt"]) for s in sent) == sorted(r.prompt_token_ids for r in flat)
    for s in sent:
        p = s.payload
        assert p["stream"] is True and p["stream_options"] == {"include_usage": True}
        assert p["ignore_eos"] is True and p["model"] == "m"
        assert all(isinstance(t, int) for t in p["prompt"])


def test_failures_missing_usage_and_cached_tokens(server):
    def script(n, p):
        return [
            Script(),
            Script(status=500),
            Script(0.01, (0.01,), completion_tokens=-1),
            Script(0.01, (0.01,), cached_tokens=6, decode_worker="10.0.0.7:50051"),
            Script(0.01, (0.01,), cached_tokens=2, pulled_tokens=4),
        ][n]

    server.reset(script)
    result = bench(server, hand_workload([2] * 4, warmup=1), concurrency=1)
    failed, no_usage, cached6, cached2 = result.results
    assert not failed.success and "HTTP 500" in failed.error
    assert no_usage.success and no_usage.num_output_tokens is None and no_usage.output_tokens == 2
    s = metrics.compute(result.results, result.duration_s, metrics.parse_slo("ttft=10"))
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["request_goodput"] * result.duration_s == pytest.approx(3)  # a failed request is never good
    assert s["prefix_cache_hit_rate"] == pytest.approx((6 + 2) / (8 + 8))  # only requests that report it
    # the worker the gateway names is kept with the request (and read back from its record)
    assert (cached6.decode_worker, cached2.decode_worker) == ("10.0.0.7:50051", "")
    assert from_record(_record(cached6)).decode_worker == "10.0.0.7:50051"
    # so are the prompt tokens it pulled from another worker: apart from the hits, out of the same prompts
    assert (cached6.num_pulled_tokens, from_record(_record(cached2)).num_pulled_tokens) == (0, 4)
    assert s["prefix_pull_rate"] == pytest.approx(4 / (8 + 8))


def test_a_closing_chunk_without_text_is_not_a_token(server):
    """llama-cpp-python ends a stream with an empty-text chunk carrying finish_reason, and sends no
    usage: it must count neither as a token nor as an inter-token gap (the 0.3 s before it would
    otherwise be an ITL and stretch E2E)."""

    def scenario():
        server.reset(lambda n, p: Script(0.01, (0.02, 0.02), completion_tokens=-1, closing_chunk_s=0.3))
        result = bench(server, hand_workload([3]))
        (r,) = result.results
        assert r.success and r.output_tokens == 3 and len(r.itl_s) == 2
        assert max(r.itl_s) < 0.2 and r.e2e_s < 0.25
        return result

    retry_timing(scenario)


def test_text_with_unicode_line_separators_stays_one_sse_line(server):
    """SSE ends a line at CR or LF only. A server writing model text as raw UTF-8 JSON may put
    U+2028, U+2029 or U+0085 inside a chunk (SmolLM2 did, in a sweep): read with
    str.splitlines rules (httpx's aiter_lines) the chunk broke mid-string and the request failed."""
    server.reset(lambda n, p: Script(0.01, (0.01, 0.01), token_text="a\u2028b\u2029c\x85d{i}"))
    result = bench(server, hand_workload([3, 3]))
    assert [(r.success, r.error, r.output_tokens) for r in result.results] == [(True, "", 3), (True, "", 3)]


def test_sse_lines_end_only_at_cr_or_lf_across_any_chunking():
    import httpx

    from splitserve.bench.loadgen.client import sse_lines

    stream = 'data: {"t":"x\u2028y"}\r\n\r\ndata: 2\rdata: 3\n\ndata: [DONE]'
    want = ['data: {"t":"x\u2028y"}', "", "data: 2", "data: 3", "", "data: [DONE]"]
    body = stream.encode()
    for size in (1, 2, 3, 7, len(body)):  # every cut, a CR LF and a UTF-8 character split across reads

        async def chunks(size=size):
            for i in range(0, len(body), size):
                yield body[i : i + size]

        async def lines():
            return [line async for line in sse_lines(httpx.Response(200, content=chunks()))]

        assert asyncio.run(lines()) == want, size
