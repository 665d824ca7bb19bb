"""`splitserve profile`: measure one worker's capacity on this machine and model, as JSON.

The engine a worker runs is driven directly (no gRPC in the way, so the numbers are the
worker's, not the transport's):
- prefill: for each prompt length L, one prompt of L random tokens with max_tokens=1 on an
  empty prefix cache; tokens/s = L / time to the first token (best of `repeats`);
- decode: for each concurrency c, c prompts of `context` tokens are prefilled, then
  `decode_steps` engine steps are timed (the least disturbed of `repeats` runs); ITL p90 =
  the 90th percentile step time, tokens/s = c / mean step time;
- kv_tokens = KV blocks × block size.
The result is planner/profile.py's CapacityProfile; the planner and bench/planner_sim.py read it.
"""

from __future__ import annotations

import argparse
import os
import platform as stdlib_platform
import random
import statistics
import time

from splitserve.planner.profile import CapacityProfile, DecodePoint, PrefillPoint
from splitserve.platform.cli import add_engine_args, engine_config


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sorted(set(vals))


def register(subparsers) -> None:
    p = subparsers.add_parser("profile", help="measure one worker's prefill/decode capacity and write JSON")
    add_engine_args(p)
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--prompt-lens", type=_ints, default=_ints("128,512,1024,2048"))
    p.add_argument("--concurrency", type=_ints, default=_ints("1,4,8,16,32"))
    p.add_argument("--context", type=int, default=512, help="prompt tokens of each decode sequence")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--notes", default="", help="free text stored with the profile (e.g. the machine was shared)")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args) -> int:
    from splitserve.platform.engine.llm_engine import LLMEngine

    if args.context <= 0 or args.decode_steps < 2 or args.repeats < 1:
        raise SystemExit("profile: --context must be > 0, --decode-steps >= 2, --repeats >= 1")
    if args.max_num_seqs < max(args.concurrency):
        args.max_num_seqs = max(args.concurrency)
    need_len = max(max(args.prompt_lens) + 1, args.context + args.decode_steps + 3)
    if args.max_model_len is None or args.max_model_len < need_len:
        args.max_model_len = need_len
    engine = LLMEngine(engine_config(args))
    prof = measure(
        engine, args.prompt_lens, args.concurrency, args.context, args.decode_steps, args.repeats, notes=args.notes
    )
    with open(args.out, "w") as f:
        f.write(prof.to_json() + "\n")
    print(prof.to_json())
    return 0


def measure(engine, prompt_lens, concurrencies, context, decode_steps, repeats=2, notes="") -> CapacityProfile:
    from splitserve.platform.sampling.params import SamplingParams

    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    tokens = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
    prefill = []
    for n in prompt_lens:
        best = 0.0
        for _ in range(repeats):
            engine.pool.reset_prefix_cache()
            t = time.perf_counter()
            engine.add_request(
                params=SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), prompt_token_ids=tokens(n)
            )
            while engine.has_unfinished_requests():
                engine.step()
            best = max(best, n / (time.perf_counter() - t))
        prefill.append(PrefillPoint(n, round(best, 1)))
    decode = []
    for c in concurrencies:
        runs = [_decode_steps(engine, tokens, c, context, decode_steps) for _ in range(repeats)]
        times = min(runs, key=statistics.mean)  # least disturbed run, like prefill's best-of
        decode.append(
            DecodePoint(context, c, round(c / statistics.mean(times), 2), round(times[int(0.9 * (len(times) - 1))], 5))
        )
    cfg = engine.config
    return CapacityProfile(
        prefill=tuple(prefill),
        decode=tuple(decode),
        kv_tokens=engine.pool.num_blocks * cfg.cache.block_size,
        notes=notes,
        meta={
            "model": cfg.model,
            "dtype": cfg.device.dtype,
            "threads": cfg.device.num_threads,
            "cpu_count": os.cpu_count(),
            "machine": stdlib_platform.processor() or stdlib_platform.machine(),
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    )


def _decode_steps(engine, tokens, c: int, context: int, steps: int) -> list[float]:
    """Sorted step times of `steps` decode steps with c sequences of `context` tokens in flight."""
    from splitserve.platform.sampling.params import SamplingParams

    engine.pool.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for _ in range(c):
        engine.add_request(params=params, prompt_token_ids=tokens(context))
    started: set[str] = set()
    while len(started) < c:  # prefill all (and their first token)
        started.update(o.req_id for o in engine.step() if o.new_token_ids)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished_requests():
        engine.step()
    return sorted(times)
