"""Offline engine benchmark (issue 2, acceptance 9): splitserve's engine against transformers.

Two measurements, each for fp32 and bf16, arms interleaved in one process with the same torch
thread count and the same weights (SmolLM2-135M dequantized from the same GGUF):

1. Offline throughput: 16 requests of exactly 128 prompt tokens and 128 output tokens
   (ignore_eos). splitserve runs all 16 at once (continuous batching); transformers'
   `generate` runs them one at a time, as a user without a serving engine would. Sequential
   requests take the same time each, so transformers is timed on the first HF_REQUESTS of them
   and its throughput is tokens / seconds over those.
2. Batch-1 decode: milliseconds per output token after the first, one request, 128-token
   prompt, 128 output tokens; transformers with its own KV cache (a plain loop over
   `model(..., past_key_values=...)`, which is leaner than `generate`).

Usage: python bench/engine_offline.py [--write docs/benchmarks.md] [--threads 2] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform as stdlib_platform
import random
import statistics
import sys
import time

import torch

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.model_source import resolve_model
from splitserve.platform.sampling.params import SamplingParams

NUM_REQUESTS = 16
PROMPT_LEN = 128
OUTPUT_LEN = 128
HF_REQUESTS = 4
REPEATS = 2
MARK_BEGIN = "<!-- engine-offline:begin -->"
MARK_END = "<!-- engine-offline:end -->"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import cpu_model, write_section  # noqa: E402


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(PROMPT_LEN)] for _ in range(NUM_REQUESTS)]


def ours_throughput(engine: LLMEngine, prompts) -> float:
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    engine.pool.reset_prefix_cache()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t
    assert all(len(o.output_token_ids) == OUTPUT_LEN for o in outs)
    return NUM_REQUESTS * OUTPUT_LEN / elapsed


def ours_decode_ms(engine: LLMEngine, prompt) -> float:
    engine.pool.reset_prefix_cache()
    engine.add_request(
        params=SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True), prompt_token_ids=prompt
    )
    engine.step()  # prefill + first token
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def hf_throughput(model, prompts) -> float:
    t = time.perf_counter()
    for prompt in prompts[:HF_REQUESTS]:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=OUTPUT_LEN,
                min_new_tokens=OUTPUT_LEN,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == PROMPT_LEN + OUTPUT_LEN
    return HF_REQUESTS * OUTPUT_LEN / (time.perf_counter() - t)


def hf_decode_ms(model, prompt) -> float:
    times = []
    with torch.inference_mode():
        step = model(input_ids=torch.tensor([prompt]), use_cache=True)
        past, token = step.past_key_values, step.logits[0, -1].argmax()
        for _ in range(OUTPUT_LEN - 1):
            t = time.perf_counter()
            step = model(input_ids=token.view(1, 1), past_key_values=past, use_cache=True)
            past, token = step.past_key_values, step.logits[0, -1].argmax()
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def load_hf(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(resolve_model("smollm2-135m").path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()


def run_dtype(dtype_name: str) -> dict:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    engine = LLMEngine(
        EngineConfig(
            model="smollm2-135m",
            device=DeviceConfig(dtype=dtype_name),
            cache=CacheConfig(kv_cache_memory_bytes=256 * 1024**2),
            scheduler=SchedulerConfig(max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=512, max_model_len=2048),
        )
    )
    hf = load_hf(dtype)
    prompts = make_prompts(engine.model_config.vocab_size)
    ours_tp, hf_tp, ours_ms, hf_ms = [], [], [], []
    ours_throughput(engine, prompts[:2])  # warm-up both arms
    hf_decode_ms(hf, prompts[0][:16])
    for _ in range(REPEATS):  # arms interleaved so drifting machine load hits both alike
        ours_tp.append(ours_throughput(engine, prompts))
        hf_tp.append(hf_throughput(hf, prompts))
        ours_ms.append(ours_decode_ms(engine, prompts[0]))
        hf_ms.append(hf_decode_ms(hf, prompts[0]))
    r = dict(
        dtype=dtype_name,
        ours_tok_s=max(ours_tp),
        hf_tok_s=max(hf_tp),
        ours_decode_ms=min(ours_ms),
        hf_decode_ms=min(hf_ms),
    )
    r["throughput_ratio"] = r["ours_tok_s"] / r["hf_tok_s"]
    r["decode_ratio"] = r["ours_decode_ms"] / r["hf_decode_ms"]
    print(json.dumps(r), flush=True)
    return r


def machine() -> str:
    cpu = cpu_model()
    flags = open("/proc/cpuinfo").read()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f" {f}" in flags]
    import transformers

    return (
        f"{os.cpu_count()} vCPU {cpu} ({', '.join(isa)}), torch {torch.__version__}, "
        f"transformers {transformers.__version__}, Python {stdlib_platform.python_version()}, "
        f"{torch.get_num_threads()} torch threads"
    )


def render(results: list[dict], cmd: str) -> str:
    lines = [
        MARK_BEGIN,
        "",
        f"Machine: {machine()}.",
        "",
        f"Command: `{cmd}`",
        "",
        "| dtype | splitserve 16 concurrent (tok/s) | transformers one at a time (tok/s) | ratio (target ≥ 3×) "
        "| splitserve batch-1 decode (ms/token) | transformers + KV cache (ms/token) | ratio (target ≤ 1.2×) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['dtype']} | {r['ours_tok_s']:.1f} | {r['hf_tok_s']:.1f} | {r['throughput_ratio']:.2f}× "
            f"| {r['ours_decode_ms']:.1f} | {r['hf_decode_ms']:.1f} | {r['decode_ratio']:.2f}× |"
        )
    lines += ["", MARK_END]
    return "\n".join(lines)


def write(path: str, section: str) -> None:
    write_section(path, "engine-offline", section)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", help="update this markdown file's engine-offline section")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = [run_dtype(d) for d in args.dtypes.split(",")]
    cmd = "make bench  # = python bench/engine_offline.py --write docs/benchmarks.md --threads 2"
    section = render(results, cmd)
    print(section)
    if args.write:
        write(args.write, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
