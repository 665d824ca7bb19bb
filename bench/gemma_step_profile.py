"""Where a Gemma 3 270M decode step spends its time: the LM head, each linear by kernel, the rest
of the layers (attention, norms, rope, Python) and what runs outside the model (scheduler,
sampler), for several builds of `--quantization auto` in one process, rounds alternating.

    python bench/gemma_step_profile.py [--threads 1] [--builds fp16,auto-exact] [--rounds 3]

A build is what Gemma 3's `auto` builds its linears as (models/gemma3.AUTO_MODE): `fp16` (every
linear float16, the head a 4-bit pass re-scored) or `auto-exact` (each linear on the file's own
codes, quant/kernels.exact_kernel). Each part is wall time around its calls, summed over the
timed tokens of one greedy completion per round; parts are comparable within one run only.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.models import gemma3
from splitserve.platform.models.layers import MergedLinear
from splitserve.platform.sampling.params import SamplingParams

TOKENS = 24
PROMPT = "The history of the printing press begins"


class Timer:
    def __init__(self):
        self.on = False
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def wrap(self, key: str, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[key] += time.perf_counter() - t0
            return out

        return timed


def build(mode: str) -> tuple[LLMEngine, Timer]:
    gemma3.AUTO_MODE = mode
    engine = LLMEngine(
        EngineConfig(
            model="gemma3-270m",
            cache=CacheConfig(num_blocks=192),
            scheduler=SchedulerConfig(max_model_len=2048),
            device=DeviceConfig(quantization="auto"),
        )
    )
    timer, model = Timer(), engine.model
    for name, module in model.named_modules():
        if isinstance(module, MergedLinear) and module.kernel is not None:
            module.kernel = timer.wrap(f"linear {name.rsplit('.', 1)[-1]} ({module.kernel.name})", module.kernel)
    model.compute_logits = timer.wrap(f"head ({getattr(model.lm_head_kernel, 'name', 'dense')})", model.compute_logits)
    model.forward = timer.wrap("body", model.forward)
    return engine, timer


def report(mode: str, walls: list[float], seconds: dict[str, float], tokens: int) -> None:
    ms = {k: 1e3 * v / tokens for k, v in seconds.items()}
    total = 1e3 * sum(walls) / tokens
    linears = sum(v for k, v in ms.items() if k.startswith("linear"))
    head = sum(v for k, v in ms.items() if k.startswith("head"))
    parts = {k: v for k, v in ms.items() if k != "body"}
    parts["rest of the layers (attention, norms, rope, Python)"] = ms["body"] - linears
    parts["outside the model (scheduler, sampler)"] = total - ms["body"] - head
    print(f"\n{mode}: {total:.2f} ms/token (median round {1e3 * statistics.median(walls) / TOKENS:.2f})")
    for key, value in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {key:56s} {value:7.2f} ms  {100 * value / total:5.1f} %")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--builds", default="fp16,auto-exact")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engines = {mode: build(mode) for mode in args.builds.split(",")}
    sampling = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    ids = next(iter(engines.values()))[0].tokenizer.encode(PROMPT)
    walls: dict[str, list[float]] = collections.defaultdict(list)
    for engine, timer in engines.values():
        engine.generate([ids], sampling)  # warm-up, untimed
        timer.on = True
    for _ in range(args.rounds):
        for mode, (engine, _) in engines.items():
            t0 = time.perf_counter()
            engine.generate([ids], sampling)
            walls[mode].append(time.perf_counter() - t0)
    print(
        f"{args.threads} thread(s), {TOKENS} tokens x {args.rounds} rounds per build; ms per generated token "
        "(the wall includes the short prompt's prefill)"
    )
    for mode, (_, timer) in engines.items():
        report(mode, walls[mode], timer.seconds, TOKENS * args.rounds)


if __name__ == "__main__":
    main()
