"""The engine before and after a change that should not move its speed (a refactor): a git
revision's code against the working tree's, each in its own process, arms interleaved.

Each arm is a fresh `python -S` process whose `splitserve` package is a folder of links to that
arm's code folders (bench/revision_arms.py: the revision from `git worktree add`, the working
tree as it is), so both run the same interpreter, torch and model file, and the editable install
does not leak the working tree into the revision's arm. Each process loads SmolLM2 (the default `--quantization auto`,
float16 KV), prefills BATCH sequences of 256 random tokens and reports the median of 12 decode
steps, wall clock and the thread's CPU clock. Rounds alternate the arms' order, so drifting
machine load hits both alike; the report gives each arm's median over rounds and the ratio.

    python bench/engine_ab.py --base b2899e0 [--rounds 4] [--threads 2] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from report import cpu_model, write_section  # noqa: E402
from revision_arms import alternating, arm_env, base_and_head, head_revision  # noqa: E402

BATCHES = (1, 8, 32)

ARM = r"""
import json, random, statistics, sys, time
import torch
from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.sampling.params import SamplingParams
threads, batches = int(sys.argv[1]), [int(b) for b in sys.argv[2].split(",")]
engine = LLMEngine(EngineConfig(model="smollm2-135m", device=DeviceConfig(num_threads=threads, quantization="auto"),
                                cache=CacheConfig(kv_cache_memory_bytes=768 * 1024**2),
                                scheduler=SchedulerConfig(max_model_len=2048)))   # room for 32 x 296 tokens
out = {}
for batch in batches:
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=[rng.randrange(100, 40000) for _ in range(256)], params=params)
           for _ in range(batch)]
    while any(engine.scheduler.requests[i].num_output_tokens == 0 for i in ids):
        engine.step()
    wall, cpu = [], []
    for _ in range(12):
        t, c = time.perf_counter(), time.thread_time()
        engine.step()
        wall.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    for i in ids:
        engine.abort(i)
    while engine.has_work():
        engine.step()
    out[batch] = [statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3]
print(json.dumps(out))
"""


def run_arm(path: pathlib.Path, threads: int) -> dict[int, list[float]]:
    proc = subprocess.run(
        [sys.executable, "-S", "-c", ARM, str(threads), ",".join(map(str, BATCHES))],
        capture_output=True,
        text=True,
        env=arm_env(path),
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write", default=None)
    args = ap.parse_args()
    results = {name: {b: [] for b in BATCHES} for name in ("base", "head")}
    with base_and_head(args.base) as arms:
        for r, name in alternating(args.rounds):
            for batch, times in run_arm(arms[name].path, args.threads).items():
                results[name][batch].append(times)
            print(f"round {r + 1} {name}: {results[name]}", file=sys.stderr, flush=True)
    report = render(results, args)
    print(report)
    if args.write:
        write_section(args.write, "engine-ab", report)


def render(results, args) -> str:
    head = head_revision()
    lines = [
        "<!-- engine-ab:begin -->",
        "## Engine decode step: a revision against the working tree",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} vCPU {cpu_model()}, {args.threads} "
        f"threads, SmolLM2-135M `--quantization auto`, 256 tokens of context, median of 12 steps per process, "
        f"{args.rounds} rounds alternating. Base `{args.base}`, head `{head}` (and its uncommitted changes). "
        f"Command: `python bench/engine_ab.py --base {args.base} --rounds {args.rounds}`.",
        "",
        "| batch | base wall ms | head wall ms | head / base | base CPU ms | head CPU ms | head / base |",
        "|---|---|---|---|---|---|---|",
    ]
    med = statistics.median
    for batch in BATCHES:
        bw, hw = med(t[0] for t in results["base"][batch]), med(t[0] for t in results["head"][batch])
        bc, hc = med(t[1] for t in results["base"][batch]), med(t[1] for t in results["head"][batch])
        lines.append(f"| {batch} | {bw:.2f} | {hw:.2f} | {hw / bw:.3f} | {bc:.2f} | {hc:.2f} | {hc / bc:.3f} |")
    lines += ["", "<!-- engine-ab:end -->"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
