"""What echo + prompt logprobs cost on a 2k-token prompt against a plain completion.

One SmolLM2-135M engine in this process, prefix caching off (a scoring request never reuses the
cache, so the plain arm computes its whole prompt too), a 2,000-token prompt, max_tokens 1. Arms,
interleaved round by round, timed in CPU seconds of this process (all its threads; on a shared
machine wall time mostly measures the other jobs) and the best round reported:
- plain: the prompt's prefill and one sampled token;
- prompt_logprobs 1 / 20: the same plus every prompt token's logprob and its top-k
  (what `echo: true, logprobs: k` asks for; lm-evaluation-harness sends k = 1).

The extra work is the lm_head over every prompt position (576 x 49,152 weights per token for
SmolLM2, about as many as 8 of its 30 layers), the log-softmax and the top-k; its memory is bounded by
the 256-row slices (platform/engine/prompt_logprobs.py): 256 x 49,152 x 4 B = 48 MiB of logits
at a time, instead of 2,000 x 49,152 x 4 B = 393 MB for the whole prompt.

Usage: python bench/echo_cost.py [--write docs/benchmarks.md] [--threads 2] [--rounds 3] [--quantization auto]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.sampling.params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import markers, write_section  # noqa: E402

NUM_PROMPT_TOKENS = 2000
ARMS = {"plain": None, "prompt_logprobs=1": 1, "prompt_logprobs=20": 20}


def prompt_ids(engine: LLMEngine) -> list[int]:
    text = " ".join(f"Sentence {i} of a long document about rivers, mountains and the weather." for i in range(400))
    ids = engine.tokenizer.encode(text)
    assert len(ids) >= NUM_PROMPT_TOKENS, len(ids)
    return ids[:NUM_PROMPT_TOKENS]


def one(engine: LLMEngine, ids: list[int], k: int | None) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    t0 = time.process_time()
    out = engine.generate([ids], params)[0]
    seconds = time.process_time() - t0
    assert (out.prompt_logprobs is not None) == (k is not None)
    return seconds


def render(times: dict[str, list[float]], args) -> str:
    begin, end = markers("echo-cost")
    base = min(times["plain"])
    rows = "\n".join(f"| {arm} | {min(t):.2f} s | {min(t) / base:.2f}x |" for arm, t in times.items())
    return f"""{begin}
## Echo and prompt logprobs on a 2k-token prompt (bench/echo_cost.py)

SmolLM2-135M, CPU, {args.threads} torch threads, --quantization {args.quantization}, prefix caching off,
{NUM_PROMPT_TOKENS}-token prompt, max_tokens 1; best of {args.rounds} interleaved rounds. The
machine (2 cores) was shared with other jobs while this ran (load average {os.getloadavg()[0]:.1f}),
so times are CPU seconds of the engine process rather than wall time; the ratios, measured in one
run, are the point, and under such load differences below about 10 % are within run-to-run noise
(an earlier attempt at load ~10 timed the plain arm at 15.5 and 26.1 s of wall time in two rounds).

| request | CPU time | vs plain |
|---|---|---|
{rows}

The extra cost is the lm_head over every prompt position plus a log-softmax and top-k; the
logits live 256 rows at a time (48 MiB for this vocabulary) rather than as one [2000, 49152]
matrix (393 MB). A scoring request also skips the prefix cache (every position needs its
logits), which this table does not charge to it because the plain arm runs without cache too.

Reproduce: `python bench/echo_cost.py --write docs/benchmarks.md`
{end}"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", metavar="MARKDOWN", help="write the results section into this file")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quantization", default="auto")
    args = p.parse_args()
    if args.threads < 1 or args.rounds < 1:
        p.error("--threads and --rounds must be >= 1")
    engine = LLMEngine(
        EngineConfig(
            model="smollm2-135m",
            cache=CacheConfig(enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_model_len=4096),
            device=DeviceConfig(num_threads=args.threads, quantization=args.quantization),
        )
    )
    ids = prompt_ids(engine)
    one(engine, ids, 1)  # warm up
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(args.rounds):
        for arm, k in ARMS.items():
            times[arm].append(one(engine, ids, k))
            print(f"{arm}: {times[arm][-1]:.2f} CPU s", file=sys.stderr, flush=True)
    section = render(times, args)
    print(section)
    if args.write:
        write_section(args.write, "echo-cost", section)


if __name__ == "__main__":
    main()
