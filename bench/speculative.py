"""Speculative decoding (n-gram prompt lookup) against itself without it, and against
llama-cpp-python's prompt-lookup decoding on the same GGUF and cores. One process, arms
interleaved round by round, so drifting machine load hits them alike.

    python bench/speculative.py [--write docs/benchmarks.md] [--threads 2] [--k 4 8]
                                [--peer-python .venv-peer/bin/python]

Workloads, greedy, chat-templated, up to MAX_TOKENS output tokens (EOS ends a request):
- copy-heavy: edit a function and return it whole, rewrite a paragraph with one change,
  extract fields into JSON: answers that copy long runs of the prompt;
- chat: short questions whose answers copy little.
Single stream: each prompt alone, output tokens over wall time per request (median over
prompts and rounds). Concurrency 8: eight requests at once in one engine, output tokens over
the batch's wall time. The speculation arm reports its mean accepted proposals per verification
step and the acceptance rate. The peer runs llama_cpp.Llama with and without
LlamaPromptLookupDecoding(num_pred_tokens=K) through create_chat_completion (single stream).
"""

from __future__ import annotations

import argparse
import json
import os
import platform as stdlib_platform
import statistics
import subprocess
import sys
import time

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.model_source import resolve_model
from splitserve.platform.quant.cpu import cpu_model
from splitserve.platform.sampling.params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_section  # noqa: E402

K = 4
MAX_TOKENS = 128
ROUNDS = 2
CODE = """def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)
"""
COPY_HEAVY = [
    f"Rename the variable `total` to `acc` in this function and return the whole function:\n\n{CODE}",
    "Rewrite this paragraph, changing only 'Tuesday' to 'Friday':\n\nThe team meets every Tuesday at nine in "
    "the small room by the kitchen. Bring your notes, your questions and a cup of coffee; we finish by ten.",
    "Extract the fields as JSON with keys name, city and role:\n\nName: Ada Lovelace. City: London. "
    "Role: mathematician. Return only the JSON object.",
    f"Add a docstring to this function and return the whole function:\n\n{CODE}",
]
CHAT = [
    "What is the capital of France?",
    "Give me three tips for better sleep.",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
]


def build(threads: int, speculative, model=None) -> LLMEngine:
    config = EngineConfig(
        model="smollm2-135m",
        device=DeviceConfig(num_threads=threads, quantization="auto"),
        cache=CacheConfig(kv_cache_memory_bytes=256 * 1024**2),
        scheduler=SchedulerConfig(max_model_len=2048),
        speculative=speculative,
    )
    return LLMEngine(config, model=model)


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)


def single_stream(engine: LLMEngine, prompts: list[list[int]]) -> list[float]:
    """Output tokens per second of each prompt run alone."""
    rates = []
    for ids in prompts:
        t0 = time.perf_counter()
        [out] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
        rates.append(len(out.output_token_ids) / (time.perf_counter() - t0))
    return rates


def concurrent(engine: LLMEngine, prompts: list[list[int]], n: int = 8) -> float:
    batch = [prompts[i % len(prompts)] for i in range(n)]
    t0 = time.perf_counter()
    outs = engine.generate(batch, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return sum(len(o.output_token_ids) for o in outs) / (time.perf_counter() - t0)


PEER_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
path = sys.argv[1]
threads, k, max_tokens, rounds = (int(a) for a in sys.argv[2:6])
prompts = json.loads(sys.stdin.read())
arms = {"peer": Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False),
        "peer + lookup": Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False,
                               draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k))}
out = {name: {kind: [] for kind in prompts} for name in arms}
for _ in range(rounds):
    for name, llm in arms.items():
        for kind, texts in prompts.items():
            for text in texts:
                t0 = time.perf_counter()
                r = llm.create_chat_completion([{"role": "user", "content": text}], max_tokens=max_tokens,
                                               temperature=0.0)
                out[name][kind].append(r["usage"]["completion_tokens"] / (time.perf_counter() - t0))
print(json.dumps(out))
"""


def run_peer(python: str, threads: int, k: int) -> dict:
    path = resolve_model("smollm2-135m").path
    proc = subprocess.run(
        [python, "-c", PEER_SCRIPT, path, str(threads), str(k), str(MAX_TOKENS), str(ROUNDS)],
        input=json.dumps({"copy-heavy": COPY_HEAVY, "chat": CHAT}),
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"peer failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer-python", default=None)
    ap.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=[K],
        help="num_speculative_tokens of each speculating arm (the peer's lookup uses the first)",
    )
    args = ap.parse_args()
    off = build(args.threads, None)
    arms = {
        "off": off,
        **{f"k={k}": build(args.threads, SpeculativeConfig(num_speculative_tokens=k), model=off.model) for k in args.k},
    }
    prompts = {"copy-heavy": [chat_ids(off, t) for t in COPY_HEAVY], "chat": [chat_ids(off, t) for t in CHAT]}
    for engine in arms.values():  # warm-up: every prompt shape once
        engine.generate([prompts["chat"][0]], SamplingParams(temperature=0, max_tokens=8))
    single = {arm: {kind: [] for kind in prompts} for arm in arms}
    conc = {arm: {kind: [] for kind in prompts} for arm in arms}
    for _ in range(ROUNDS):
        for arm, engine in arms.items():
            for kind, ids in prompts.items():
                single[arm][kind] += single_stream(engine, ids)
                conc[arm][kind].append(concurrent(engine, ids))
    stats = {arm: engine.speculator.stats for arm, engine in arms.items() if engine.speculator}
    peer = run_peer(args.peer_python, args.threads, args.k[0]) if args.peer_python else None
    report = render(single, conc, stats, peer, args)
    print(report)
    if args.write:
        write_section(args.write, "speculative", report)


def render(single, conc, stats, peer, args) -> str:
    med = statistics.median
    cmd = f"python bench/speculative.py --threads {args.threads} --k {' '.join(map(str, args.k))}" + (
        " --peer-python .venv-peer/bin/python" if peer else ""
    )
    spec_arms = list(stats)
    lines = [
        "<!-- speculative:begin -->",
        "## Speculative decoding: n-gram prompt lookup",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {cpu_model()} "
        f"({os.cpu_count()} cores, {stdlib_platform.machine()}), {args.threads} threads, default "
        f"`--quantization auto`, SmolLM2-135M, greedy, up to {MAX_TOKENS} tokens, "
        f"num_speculative_tokens {', '.join(a.removeprefix('k=') for a in spec_arms)} (k adapts per request up "
        f"to it), {ROUNDS} rounds interleaved. Command: `{cmd}`.",
        "",
        "| workload | arm | single stream (tok/s) | vs off | concurrency 8 (tok/s) | vs off |",
        "|---|---|---|---|---|---|",
    ]
    for kind in ("copy-heavy", "chat"):
        s_off, c_off = med(single["off"][kind]), med(conc["off"][kind])
        for arm in single:
            s_on, c_on = med(single[arm][kind]), med(conc[arm][kind])
            lines.append(f"| {kind} | {arm} | {s_on:.1f} | {s_on / s_off:.2f}x | {c_on:.1f} | {c_on / c_off:.2f}x |")
    lines.append("")
    for arm, st in stats.items():
        rate = st.num_accepted_tokens / max(1, st.num_draft_tokens)
        lines.append(
            f"Acceptance ({arm}, whole run): {st.num_accepted_tokens} of {st.num_draft_tokens} proposed "
            f"tokens ({rate:.0%}), {st.num_drafts} verification steps, mean accepted per step "
            f"{st.num_accepted_tokens / max(1, st.num_drafts):.2f}; by accepted count "
            f"{dict(enumerate(st.accepted_lengths))}."
        )
    if peer:
        lines += [
            "",
            "llama-cpp-python on the same GGUF and threads, single stream (tok/s, median):",
            "",
            f"| workload | peer | peer + prompt lookup | lookup / plain | splitserve {spec_arms[0]} / peer + lookup |",
            "|---|---|---|---|---|",
        ]
        for kind in ("copy-heavy", "chat"):
            p_off, p_on = med(peer["peer"][kind]), med(peer["peer + lookup"][kind])
            lines.append(
                f"| {kind} | {p_off:.1f} | {p_on:.1f} | {p_on / p_off:.2f}x | "
                f"{med(single[spec_arms[0]][kind]) / p_on:.2f}x |"
            )
    lines += [
        "",
        "Targets (reported, not asserted): copy-heavy single stream >= 2x without speculation and ahead of "
        "the peer's lookup; chat >= 0.97x; concurrency 8 >= 0.95x.",
        "",
        "<!-- speculative:end -->",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
