"""Gemma 3 270M single stream: splitserve's engine against llama-cpp-python on the same GGUF and
threads, arms alternating round by round in one run.

    python bench/gemma_peer.py --peer-python .venv-peer/bin/python [--threads 2] [--rounds 3] [--prompts 3]
                               [--tokens 128] [--write docs/benchmarks.md]

Each round times one greedy completion of TOKENS tokens (EOS ignored on ours; the peer's
`logit_bias` bans Gemma's EOS ids so it generates as many) for each of three plain prompts (or the first --prompts) (the
model is a base model: no chat template), in the engine's default `--quantization auto` (for
Gemma 3 every linear on the file's own codes and a re-scored 4-bit head, docs/models.md) and in
llama.cpp's Q4_K_M as stored. Decode rate: tokens
after the first over the time after the first token; ours is timed from engine steps in this
process, the peer's from llama_cpp's streaming iterator in its own process, so neither pays HTTP.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.model_source import resolve_model
from splitserve.platform.quant.cpu import cpu_model
from splitserve.platform.quant.report import describe_kernels
from splitserve.platform.sampling.params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_section  # noqa: E402

TOKENS = 128
PROMPTS = ["The history of the printing press begins", "def quicksort(items):", "Once upon a time, in a small village,"]

PEER = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompts = json.loads(sys.stdin.readline())
llm = Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
bias = {t: -1e9 for t in {llm.token_eos()}}
print("ready", flush=True)
for line in sys.stdin:
    out = []
    for prompt in prompts:
        t0, first, n = time.perf_counter(), None, 0
        for chunk in llm.create_completion(prompt, max_tokens=tokens, temperature=0.0, stream=True, logit_bias=bias):
            n += 1
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        out.append([first - t0, (n - 1) / (end - first) if n > 1 else 0.0])
    print(json.dumps(out), flush=True)
"""


def ours(engine: LLMEngine, prompts: list[str], tokens: int) -> list[list[float]]:
    out = []
    for prompt in prompts:
        t0 = time.perf_counter()
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        first, n = None, 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                n += len(o.new_token_ids)
                if first is None and o.new_token_ids:
                    first = time.perf_counter()
        end = time.perf_counter()
        out.append([first - t0, (n - 1) / (end - first)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer-python", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--prompts",
        type=int,
        default=len(PROMPTS),
        choices=range(1, len(PROMPTS) + 1),
        help="how many of the prompts each round runs (fewer: a shorter run on a busy host)",
    )
    ap.add_argument("--tokens", type=int, default=TOKENS, help="greedy tokens per completion")
    ap.add_argument("--write", default=None)
    args = ap.parse_args()
    prompts = PROMPTS[: args.prompts]
    path = resolve_model("gemma3-270m").path
    engine = LLMEngine(
        EngineConfig(
            model="gemma3-270m",
            device=DeviceConfig(num_threads=args.threads, quantization="auto"),
            cache=CacheConfig(kv_cache_memory_bytes=256 * 1024**2),
            scheduler=SchedulerConfig(max_model_len=1024),
        )
    )
    peer = subprocess.Popen(
        [args.peer_python, "-c", PEER, path, str(args.threads), str(args.tokens)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    peer.stdin.write(json.dumps(prompts) + "\n")
    peer.stdin.flush()
    assert peer.stdout.readline().strip() == "ready"
    ours(engine, prompts, args.tokens)  # warm-up of both, untimed
    peer.stdin.write("go\n")
    peer.stdin.flush()
    peer.stdout.readline()
    results = {"splitserve": [], "llama-cpp-python": []}
    for r in range(args.rounds):
        for arm in ("splitserve", "llama-cpp-python") if r % 2 == 0 else ("llama-cpp-python", "splitserve"):
            if arm == "splitserve":
                results[arm] += ours(engine, prompts, args.tokens)
            else:
                peer.stdin.write("go\n")
                peer.stdin.flush()
                results[arm] += json.loads(peer.stdout.readline())
    peer.stdin.close()
    peer.wait(timeout=60)
    report = render(results, args, f"{engine.model.quantization}: {describe_kernels(engine.model)}")
    print(report)
    if args.write:
        write_section(args.write, "gemma-peer", report)


def render(results, args, mode: str) -> str:
    med = statistics.median
    rate = {arm: med(r[1] for r in rows) for arm, rows in results.items()}
    ttft = {arm: med(r[0] for r in rows) for arm, rows in results.items()}
    lines = [
        "<!-- gemma-peer:begin -->",
        "## Gemma 3 270M single stream against llama-cpp-python",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {cpu_model()} ({os.cpu_count()} cores), "
        f"{args.threads} threads each, the `gemma3-270m` GGUF (Q4_K_M); ours `--quantization auto` "
        f"(resolved: {mode}), {args.tokens} greedy tokens per prompt, {args.prompts} prompts x {args.rounds} "
        f"rounds alternating, medians. Command: `python bench/gemma_peer.py --peer-python "
        f".venv-peer/bin/python --rounds {args.rounds} --prompts {args.prompts} --tokens {args.tokens}`.",
        "",
        "| arm | decode tok/s | TTFT s |",
        "|---|---|---|",
    ]
    for arm in results:
        lines.append(f"| {arm} | {rate[arm]:.1f} | {ttft[arm]:.3f} |")
    lines += [
        "",
        f"splitserve / llama-cpp-python decode rate: **{rate['splitserve'] / rate['llama-cpp-python']:.2f}x** "
        "(target, reported: >= 1.0x).",
        "",
        "<!-- gemma-peer:end -->",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
