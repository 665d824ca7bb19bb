"""Serving metrics as `vllm bench serve` computes them (its `calculate_metrics`).

Over the successful requests of the measured phase (warm-ups excluded):
- TTFT, E2E: one value per request.
- TPOT: per request (E2E − TTFT) / (output_tokens − 1), only for requests with ≥ 2 output
  tokens; for goodput a 1-token request counts as TPOT 0.
- ITL: every gap between consecutive token chunks, pooled over all requests (token-weighted).
- throughputs: completed requests, Σ output tokens and Σ (prompt + output) tokens divided by
  the duration of the measured phase (first send scheduled → last request finished).
- goodput: requests meeting every given SLO (each `value ≤ limit`) divided by the duration.
Statistics: mean, std (population), p50 (the median), p90, p99 with numpy's linear
interpolation; values in milliseconds. An empty set gives None, where vLLM prints 0.
Beyond vLLM: the server-reported prefix-cache hit rate (Σ cached_tokens / Σ prompt tokens, of
the requests whose usage has `prompt_tokens_details`), the pull rate (Σ pulled tokens, from
splitserve's x-splitserve-pulled-tokens header, / Σ prompt tokens, of the same), the peak
number of requests in flight, and the number of requests whose output length differs from
max_tokens (ignore_eos not honoured).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from splitserve.bench.loadgen.client import RequestResult
from splitserve.platform.errors import ConfigError

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True)
class SLO:
    """Per-request limits in seconds; None: not part of the goodput condition."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def is_met(self, r: RequestResult) -> bool:
        limits = ((self.ttft_s, r.ttft_s), (self.tpot_s, tpot(r) or 0.0), (self.e2e_s, r.e2e_s))
        return all(value <= limit for limit, value in limits if limit is not None)

    def describe(self) -> str:
        parts = [f"{k}<={v:g}s" for k, v in zip(SLO_KEYS, (self.ttft_s, self.tpot_s, self.e2e_s)) if v is not None]
        return ", ".join(parts)


def parse_slo(text: str) -> SLO:
    """`ttft=0.5,tpot=0.1,e2e=10` (seconds; any subset, each key once) -> SLO."""
    values: dict[str, float] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise ConfigError(
                f"bad SLO item {item.strip()!r} in {text!r}: expected KEY=SECONDS with KEY one of "
                f"{', '.join(SLO_KEYS)}, e.g. ttft=0.5,tpot=0.1,e2e=10"
            )
        if key in values:
            raise ConfigError(f"SLO key {key!r} given twice in {text!r}")
        try:
            seconds = float(value)
        except ValueError:
            raise ConfigError(f"SLO {key}={value!r} is not a number of seconds") from None
        if not 0 < seconds < float("inf"):
            raise ConfigError(f"SLO {key}={value} must be a positive, finite number of seconds")
        values[key] = seconds
    return SLO(values.get("ttft"), values.get("tpot"), values.get("e2e"))


def tpot(r: RequestResult) -> float | None:
    n = r.output_tokens
    return (r.e2e_s - r.ttft_s) / (n - 1) if n > 1 else None


def stats_ms(values_s: list[float]) -> dict | None:
    if not values_s:
        return None
    ms = np.asarray(values_s) * 1000.0
    out = {"mean": float(ms.mean()), "std": float(ms.std())}
    out.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    return out


def peak_in_flight(results: list[RequestResult]) -> int:
    """Most requests in flight at once: a sweep over half-open [start, end) intervals."""
    events = sorted([(r.start_s, 1) for r in results] + [(r.start_s + r.e2e_s, -1) for r in results])
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def _share_of_prompts(results: list[RequestResult], tokens) -> float | None:
    """Σ tokens(r) / Σ prompt tokens over `results`; None when there are none."""
    if not results:
        return None
    return sum(map(tokens, results)) / max(1, sum(r.num_prompt_tokens for r in results))


def compute(results: list[RequestResult], duration_s: float, slo: SLO | None) -> dict:
    """The summary of one set of requests (a whole run or one category) over `duration_s`."""
    ok = [r for r in results if r.success]
    total_in = sum(r.num_prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [t for t in map(tpot, ok) if t is not None]
    with_cache = [r for r in ok if r.num_cached_tokens is not None]
    good = sum(slo.is_met(r) for r in ok) if slo else None
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "request_goodput": None if good is None else good / duration_s,
        "slo_attainment": None if good is None or not ok else good / len(ok),
        "ttft_ms": stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": stats_ms(tpots),
        "itl_ms": stats_ms([gap for r in ok for gap in r.itl_s]),
        # Each request's longest pause between tokens: the freeze its user sees. Pooled ITL
        # percentiles hide a rare stall (a 1 s prefill that stops one stream once among thousands
        # of gaps sits below p99), this one counts it once per request that met it.
        "max_itl_ms": stats_ms([max(r.itl_s) for r in ok if r.itl_s]),
        "e2e_ms": stats_ms([r.e2e_s for r in ok]),
        "prefix_cache_hit_rate": _share_of_prompts(with_cache, lambda r: r.num_cached_tokens),
        # Prompt tokens whose KV the decode worker pulled from another worker (splitserve's
        # x-splitserve-pulled-tokens): neither computed nor in its own cache, so apart from the hits.
        "prefix_pull_rate": _share_of_prompts(with_cache, lambda r: r.num_pulled_tokens),
        "peak_in_flight": peak_in_flight(ok),
        "output_len_mismatch": sum(r.output_tokens != r.max_tokens for r in ok),
    }
