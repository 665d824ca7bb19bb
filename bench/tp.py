"""Tensor parallelism on this host: per-rank weight memory, decode step, collectives, plan cost.

    python bench/tp.py [--model random:llama-3.2-1b] [--steps 8] [--write docs/benchmarks.md]

One engine at TP 1 (all the host's cores) and one at TP 2 (the cores split over the two ranks),
one after the other, fp32, quantization none. For each it reports

- the weight bytes each rank holds (its parameters; rank 1's as it reported them when ready),
  and TP 2's largest rank over TP 1 (target <= 0.55x: everything but the norms is split);
- the decode step at batch 1 and 8 (prompts of --context tokens, the median of --steps steps
  after the prefill), through LLMEngine.step(), so scheduling and sampling are in it;
- per TP 2 step: the all-reduces and gathers rank 0 ran and the seconds it spent in them (the
  collective plus the wait for the slower rank), and what shipping the plan cost rank 0
  (pickling, the shared-memory write and one pipe write per rank) and its size.

On a CPU the two ranks share the host's memory bandwidth, so TP 2 does not make a step faster
here; what it buys is a model twice the size of one device. The figures are a ratio measured in
one run on one host.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from report import cpu_model, write_section  # noqa: E402

from splitserve.platform.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
)
from splitserve.platform.engine.llm_engine import LLMEngine  # noqa: E402
from splitserve.platform.sampling.params import SamplingParams  # noqa: E402


def build(model: str, tp: int, threads: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=model,
            cache=CacheConfig(num_blocks=160),
            scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=16),
            device=DeviceConfig(dtype="float32", quantization="none", num_threads=threads),
            parallel=ParallelConfig(tensor_parallel_size=tp),
        )
    )


def weight_bytes(engine: LLMEngine) -> list[int]:
    """Each rank's parameter bytes, rank 0 first."""
    own = sum(p.nbytes for p in engine.model.parameters())
    return [own] + (engine.executor.rank_weight_bytes if engine.executor else [])


def decode(engine: LLMEngine, batch: int, context: int, steps: int) -> dict:
    """Median decode step (ms) of `batch` requests, and per-step collective and plan figures."""
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(params=params, prompt_token_ids=[(31 * i + 7 * j) % 30000 + 10 for j in range(context)])
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    group = engine.executor.group if engine.executor else None
    sender = engine.executor.sender if engine.executor else None
    if group:
        group.stats.take(), sender.stats.take()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    out = {"step_ms": 1000 * statistics.median(times)}
    if group:
        calls, seconds = group.stats.take()
        messages, nbytes, plan_s = sender.stats.take()
        out |= {
            "collectives": calls / steps,
            "collective_ms": 1000 * seconds / steps,
            "plan_us": 1e6 * plan_s / messages,
            "plan_bytes": nbytes / messages,
        }
    for req_id in list(engine.scheduler.requests):
        engine.abort(req_id)
    engine.step()
    return out


def measure(model: str, tp: int, threads: int, context: int, steps: int) -> dict:
    t0 = time.perf_counter()
    engine = build(model, tp, threads)
    try:
        result = {"start_s": time.perf_counter() - t0, "weights": weight_bytes(engine)}
        for batch in (1, 8):
            result[batch] = decode(engine, batch, context, steps)
            print(f"tp {tp} batch {batch}: {result[batch]}", flush=True)
        return result
    finally:
        engine.close()


def section(model: str, context: int, steps: int, tp1: dict, tp2: dict, cores: int) -> str:
    gib = 1024**3
    ratio = max(tp2["weights"]) / tp1["weights"][0]
    rows = [
        "| | TP 1 | TP 2 |",
        "|---|---|---|",
        f"| weights per rank (GiB) | {tp1['weights'][0] / gib:.2f} | "
        f"{' + '.join(f'{b / gib:.2f}' for b in tp2['weights'])} (largest {ratio:.2f}x TP 1) |",
        f"| start (s, random weights drawn) | {tp1['start_s']:.1f} | {tp2['start_s']:.1f} |",
    ]
    for batch in (1, 8):
        a, b = tp1[batch], tp2[batch]
        rows.append(f"| decode step, batch {batch} (ms) | {a['step_ms']:.1f} | {b['step_ms']:.1f} |")
        rows.append(
            f"| batch {batch}: collectives per step / ms in them (rank 0) | - | "
            f"{b['collectives']:.0f} / {b['collective_ms']:.1f} |"
        )
        rows.append(
            f"| batch {batch}: plan to the other rank per step (rank 0) | - | "
            f"{b['plan_us']:.0f} us, {b['plan_bytes'] / 1024:.1f} KiB |"
        )
    command = f"python bench/tp.py --model {model} --context {context} --steps {steps} --write docs/benchmarks.md"
    return "\n".join(
        [
            "<!-- tp:begin -->",
            "## Tensor parallelism: per-rank weights, decode step, collectives, plan (bench/tp.py)",
            "",
            f"{datetime.date.today().isoformat()}, {cpu_model()}, {cores} cores (TP 1: {cores} torch threads; "
            f"TP 2: {max(1, cores // 2)} per rank), load average {os.getloadavg()[0]:.1f}. `{command}`: "
            f"`{model}` fp32, quantization none, prompts of {context} tokens, median of {steps} decode steps "
            "through LLMEngine.step(). Target: TP 2's largest rank holds <= 0.55x TP 1's weights. The "
            "collective time is rank 0's time inside all-reduce and all-gather, the wait for the other rank "
            "included (gloo on loopback); the plan cost is rank 0's pickling, shared-memory write and pipe "
            "write (platform/parallel/channel.py). On one CPU host both ranks share the memory bandwidth, so "
            "TP 2 is not faster here: it exists for models larger than one device.",
            "",
            *rows,
            "<!-- tp:end -->",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llama-3.2-1b")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--write", default=None, help="docs/benchmarks.md to update")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    tp1 = measure(args.model, 1, cores, args.context, args.steps)
    tp2 = measure(args.model, 2, max(1, cores // 2), args.context, args.steps)
    text = section(args.model, args.context, args.steps, tp1, tp2, cores)
    print(text)
    if args.write:
        write_section(args.write, "tp", text)


if __name__ == "__main__":
    main()
