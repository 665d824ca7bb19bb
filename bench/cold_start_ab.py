"""A model's cold start before and after a change: the seconds `LLMEngine(...)` takes (config,
tokenizer, weights, kernels' packing) for a git revision's code against the working tree's, each
load a fresh `python -S` process on that arm's code (bench/revision_arms.py), arms alternating.

    python bench/cold_start_ab.py --base f80e7dc [--model gemma3-270m] [--rounds 3] [--threads 2]

Both quantization modes are timed: "none" (fp32, every tensor dequantized) and "auto" (the
default fast mode). The model file must be resolved already (the first load assembles it).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from revision_arms import Arm, alternating, arm_env, base_and_head, head_revision  # noqa: E402

ARM = r"""
import sys, time, torch
model, quantization, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(threads)
from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from splitserve.platform.engine.llm_engine import LLMEngine
t = time.perf_counter()
LLMEngine(EngineConfig(model=model, cache=CacheConfig(num_blocks=192), scheduler=SchedulerConfig(max_model_len=2048),
                       device=DeviceConfig(dtype="float32", quantization=quantization, num_threads=threads)))
print(time.perf_counter() - t)
"""
MODES = ("none", "auto")


def load_seconds(arm: Arm, model: str, quantization: str, threads: int) -> float:
    proc = subprocess.run(
        [sys.executable, "-S", "-c", ARM, model, quantization, str(threads)],
        env=arm_env(arm.path),
        cwd=arm.path,  # not the repository root, whose egg-info would name the working tree's commands
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return float(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    seconds = {(name, mode): [] for name in ("base", "head") for mode in MODES}
    with base_and_head(args.base) as arms:
        for r, name in alternating(args.rounds):
            for mode in MODES:
                seconds[name, mode].append(load_seconds(arms[name], args.model, mode, args.threads))
            print(f"round {r + 1} {name}: {seconds}", file=sys.stderr, flush=True)
    print(f"{args.model} cold start, base {args.base} vs head {head_revision()}, {args.rounds} rounds alternating")
    print("| --quantization | base s | head s | head / base |\n|---|---|---|---|")
    for mode in MODES:
        base, head = statistics.median(seconds["base", mode]), statistics.median(seconds["head", mode])
        print(f"| {mode} | {base:.2f} | {head:.2f} | {head / base:.2f} |")


if __name__ == "__main__":
    main()
