"""WorkerMetrics' load-derived counters (vllm:prefix_cache_queries/hits, prefix waits) are exact
at every scrape: rendering with the engine's latest snapshot brings them up to date, however the
scrape interleaves with the periodic load report, and a snapshot older than one already counted
never moves them (the cause of a flake that counted one request's 40 prompt tokens twice)."""

import threading

from splitserve.platform.engine.llm_engine import LoadSnapshot
from splitserve.workers.metrics import WorkerMetrics


def counter(metrics: WorkerMetrics, name: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + "_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def snapshot(queries: int, hits: int) -> LoadSnapshot:
    return LoadSnapshot(0, 0, 0.0, 0, 0, 0, prefix_cache_queries=queries, prefix_cache_hits=hits)


def test_a_scrape_reflects_the_latest_snapshot_without_double_counting():
    m = WorkerMetrics("decode", "smollm2-135m")
    m.update_load(snapshot(40, 0))  # the periodic report after request 1
    m.render(snapshot(80, 32))  # a scrape after request 2, before the report
    assert (counter(m, "vllm:prefix_cache_queries"), counter(m, "vllm:prefix_cache_hits")) == (80, 32)
    m.update_load(snapshot(80, 32))  # the late periodic report adds nothing
    m.update_load(snapshot(40, 0))  # nor does an older snapshot
    assert (counter(m, "vllm:prefix_cache_queries"), counter(m, "vllm:prefix_cache_hits")) == (80, 32)


def test_concurrent_updates_count_each_token_once():
    m = WorkerMetrics("decode", "smollm2-135m")
    snaps = [snapshot(40 * i, 32 * i) for i in range(1, 201)]
    threads = [threading.Thread(target=lambda: [m.update_load(s) for s in snaps]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (counter(m, "vllm:prefix_cache_queries"), counter(m, "vllm:prefix_cache_hits")) == (8000, 6400)


def test_kv_tier_counters_follow_the_tier_stats():
    from splitserve.platform.kv.tier import TierStats

    m = WorkerMetrics("both", "smollm2-135m")
    stats = TierStats(num_stored=5, num_hits=2, num_evictions=1, num_rejected=0, num_bytes=4096, num_blocks=4)
    m.render(None, (stats, 1024))
    stats.num_stored, stats.num_hits = 7, 3
    m.render(None, (stats, 2048))
    text = m.render().decode()
    assert 'splitserve_kv_tier_blocks_total{event="stored"} 7.0' in text
    assert 'splitserve_kv_tier_blocks_total{event="hit"} 3.0' in text
    assert 'splitserve_kv_tier_blocks_total{event="evicted"} 1.0' in text
    assert 'splitserve_kv_tier_bytes{tier="1"} 2048.0' in text and 'splitserve_kv_tier_bytes{tier="2"} 4096.0' in text
