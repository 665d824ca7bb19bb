"""The results of a run: a JSON document and a short text table.

JSON layout (times in ms unless the key says `_s`):
    {"config": {...}, "workload": {"name", "params", "num_requests", "num_warmup"},
     "duration_s", "client_cpu_s", "client_cpu_fraction",
     "summary": {metrics.compute(...)}, "categories": {name: {...}},   # e.g. turn-1…, long/interactive
     "warmup": {"completed", "failed", "ttft_ms", "e2e_ms"},
     "errors": [first 10 error strings], "requests": [per-request records, seconds]}
"""

from __future__ import annotations

import dataclasses

from splitserve.bench.loadgen import metrics
from splitserve.bench.loadgen.client import RequestResult
from splitserve.bench.loadgen.runner import RunConfig, RunResult
from splitserve.bench.loadgen.workloads import Workload


def _record(r: RequestResult) -> dict:
    return {
        "index": r.index,
        "category": r.category,
        "tag": r.tag,
        "prompt_tokens": r.num_prompt_tokens,
        "max_tokens": r.max_tokens,
        "output_tokens": r.output_tokens if r.success else 0,
        "cached_tokens": r.num_cached_tokens,
        "decode_worker": r.decode_worker,
        "pulled_tokens": r.num_pulled_tokens,
        "start_s": r.start_s,
        "client_queue_s": r.client_queue_s,
        "success": r.success,
        "ttft_s": r.ttft_s,
        "e2e_s": r.e2e_s,
        "tpot_s": metrics.tpot(r),
        "itl_s": r.itl_s,
        "error": r.error,
    }


def from_record(d: dict) -> RequestResult:
    """A request back from its record in a report (what metrics.compute reads of it)."""
    return RequestResult(
        d["index"],
        d["category"],
        d["tag"],
        d["prompt_tokens"],
        d["max_tokens"],
        start_s=d["start_s"],
        client_queue_s=d["client_queue_s"],
        success=d["success"],
        ttft_s=d["ttft_s"],
        itl_s=list(d["itl_s"]),
        e2e_s=d["e2e_s"],
        num_output_tokens=d["output_tokens"],
        num_cached_tokens=d["cached_tokens"],
        decode_worker=d.get("decode_worker", ""),  # absent from reports before it was recorded
        num_pulled_tokens=d.get("pulled_tokens", 0),  # likewise
        error=d["error"],
    )


def build_report(cfg: RunConfig, wl: Workload, run: RunResult, slo: metrics.SLO | None) -> dict:
    categories = sorted({r.category for r in run.results if r.category}, key=_natural)
    warm = metrics.compute(run.warmup, 1.0, None) if run.warmup else None
    return {
        "config": {
            **{k: _json_number(v) for k, v in dataclasses.asdict(cfg).items()},
            "api_key": None,
            "slo": dataclasses.asdict(slo) if slo else None,
        },
        "workload": {
            "name": wl.name,
            "params": dataclasses.asdict(wl.params),
            "num_requests": wl.num_requests,
            "num_sessions": len(wl.sessions),
            "num_warmup": len(wl.warmup),
        },
        "duration_s": run.duration_s,
        "client_cpu_s": run.client_cpu_s,
        "client_cpu_fraction": run.client_cpu_s / run.duration_s,
        "summary": metrics.compute(run.results, run.duration_s, slo),
        "categories": {
            c: metrics.compute([r for r in run.results if r.category == c], run.duration_s, slo) for c in categories
        },
        "warmup": None if warm is None else {k: warm[k] for k in ("completed", "failed", "ttft_ms", "e2e_ms")},
        "errors": [f"request {r.index}: {r.error}" for r in run.results if not r.success][:10],
        "requests": [_record(r) for r in run.results],
    }


def _json_number(v):
    """JSON has no infinity: rate/burstiness `inf` are written as the string "inf"."""
    return "inf" if isinstance(v, float) and v == float("inf") else v


def _natural(name: str):
    head, _, num = name.rpartition("-")
    return (head, int(num), "") if num.isdigit() else (name, -1, name)


def _fmt(stats: dict | None, key: str) -> str:
    return "-" if stats is None else f"{stats[key]:.1f}"


def text_table(report: dict) -> str:
    cfg, s = report["config"], report["summary"]
    load = (
        f"concurrency {cfg['concurrency']}"
        if cfg["concurrency"]
        else f"rate {cfg['rate']}/s, burstiness {cfg['burstiness']}"
    )
    lines = [
        f"workload {report['workload']['name']}  ({load}, seed {cfg['seed']}, model {cfg['model']})",
        f"requests: {s['completed']} completed, {s['failed']} failed in {report['duration_s']:.2f} s; "
        f"client CPU {report['client_cpu_s']:.2f} s ({100 * report['client_cpu_fraction']:.1f}% of one core)",
        f"throughput: {s['request_throughput']:.3f} req/s, {s['output_throughput']:.1f} output tok/s, "
        f"{s['total_token_throughput']:.1f} total tok/s; peak in flight {s['peak_in_flight']}",
    ]
    if s["request_goodput"] is not None:
        lines.append(
            f"goodput: {s['request_goodput']:.3f} req/s ({100 * (s['slo_attainment'] or 0):.1f}% of "
            f"completed requests meet {metrics.SLO(**cfg['slo']).describe()})"
        )
    if s["prefix_cache_hit_rate"] is not None:
        lines.append(f"prefix cache (server-reported): {100 * s['prefix_cache_hit_rate']:.1f}% of prompt tokens")
    if s["output_len_mismatch"]:
        lines.append(f"WARNING: {s['output_len_mismatch']} requests got an output length other than max_tokens")
    lines += ["", f"{'ms':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        st = s[f"{name}_ms"]
        lines.append(f"{name.upper():<14}" + "".join(f"{_fmt(st, k):>10}" for k in ("mean", "p50", "p90", "p99")))
    if report["categories"]:
        lines += [
            "",
            f"{'category':<14}{'n':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
            f"{'TPOT p99':>10}{'ITL p99':>10}{'E2E p50':>10}",
        ]
        for name, c in report["categories"].items():
            cells = [
                (c["ttft_ms"], "p50"),
                (c["ttft_ms"], "p99"),
                (c["tpot_ms"], "p50"),
                (c["tpot_ms"], "p99"),
                (c["itl_ms"], "p99"),
                (c["e2e_ms"], "p50"),
            ]
            lines.append(f"{name:<14}{c['completed']:>5}" + "".join(f"{_fmt(st, k):>10}" for st, k in cells))
    for err in report["errors"][:3]:
        lines.append(f"error: {err}")
    return "\n".join(lines)
