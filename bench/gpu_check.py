"""The device run of issue 30: every GPU acceptance check in one call (bench/gpu_check.sh starts it).

Writes $OUT/gpu_check.json after every phase (so a run cut short keeps what it measured); the
shell wrapper writes the log beside it. Phases, most valuable first; a phase that would start
after BUDGET_S is skipped and says so:

1. `fp32_vs_transformers`: `random:smollm2-135m` in float32 on CUDA with decode graphs, its
   matrices redrawn at std 0.15 (at transformers' 0.02 a random model's greedy choices sit on
   near-ties), against transformers' LlamaForCausalLM holding the same tensors: greedy tokens of
   8 ragged prompts, each with its own length so the batch shrinks through the buckets
   (8 -> 4 -> 2 -> 1, with padded rows). Then `graphs_on_vs_off`: the same engine with its graphs
   detached (eager), token for token.
2. `decode_prefill`: `random:llama-3-8b` bf16 (bench/gpu_roofline.py's measurements): measured
   HBM and matmul peaks, the Triton kernels against torch, decode at batch 1 and 64 with graphs
   on and off (wait per token, HBM floor, kernels per step, GPU-busy share), graphs on = off in
   bf16 (reported, not a gate: bf16 GEMMs of another row count round differently), prefill of
   2k tokens against the matmul rate, then transformers' generate at batch 64.
   Also in this phase: `graph_memory` (what the capture took, as `torch.cuda.mem_get_info` saw it
   across the capture: never negative) and `speculative_b1`: n-gram speculation (k=4) at batch 1
   against plain decoding on the same engine, greedy tokens and tokens/s, on copy-heavy prompts (a
   random 128-token run repeated; a random model's greedy output loops, so proposals from the
   prompt and the output get accepted; the acceptance rate is reported beside the speedup).
3. `pd` (bench/gpu_check_pd.py): P/D between worker processes on this one GPU for
   `random:llama-3.2-1b` and `random:llama-3-8b`, bf16 and fp32, 1k and 8k prompts: over CUDA IPC
   and over tcp, against a cold colocated worker; TTFT breakdown, tokens P/D = colocated (fp32 a
   gate), which path each transfer took; configurations run while the budget lasts.
4. `fp32_prefill`: why fp32 prefill is slow: an 8k prefill of `random:llama-3.2-1b` in fp32 with
   IEEE fp32 GEMMs and attention (the default) and with torch's TF32 switch on.
5. `kernel_tests`: the Triton kernel and device-sampler tests compiled on the GPU (pytest).
6. `tensor_parallel` (bench/gpu_check_tp.py): with two or more visible GPUs, TP 2 against TP 1 on
   `random:llama-3.2-1b`: greedy fp32 tokens equal, decode step at batch 1 and 64 (bf16); with
   fewer it records that it skipped and why.

`--smoke` runs phases 1-3 on CPU with `random:tiny` to check the script itself (no numbers).
Usage: OUT=dir python bench/gpu_check.py [--smoke]; `python bench/gpu_check.py worker ...` runs a
worker process (the console script needs every subcommand's packages; this needs the worker's).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time
import traceback

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check_pd  # noqa: E402  (phase 3)
import gpu_check_tp  # noqa: E402  (phase 6)

BUDGET_S = float(os.environ.get("GPU_CHECK_BUDGET_S", "380"))
HARD_STOP_S = float(os.environ.get("GPU_CHECK_HARD_STOP_S", "430"))  # gpu_check.sh cuts the process at 440 s
T0 = time.monotonic()


class Report:
    """The JSON result, rewritten after every phase."""

    def __init__(self, out: pathlib.Path):
        self.path = out / "gpu_check.json"
        self.data: dict = dict(started=time.strftime("%Y-%m-%d %H:%M:%S %Z"), phases={})
        out.mkdir(parents=True, exist_ok=True)

    def phase(self, name: str, fn, *args) -> None:
        elapsed = time.monotonic() - T0
        if elapsed > BUDGET_S:
            self.data["phases"][name] = dict(
                skipped=f"not started: {elapsed:.0f} s of the {BUDGET_S:.0f} s budget used"
            )
        else:
            log(f"== {name} (at {elapsed:.0f} s)")
            t = time.monotonic()
            try:
                result = fn(*args)
            except Exception as exc:  # a failed phase is a result too; the next phases still run
                result = dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
                log(result["traceback"])
            result["seconds"] = round(time.monotonic() - t, 1)
            self.data["phases"][name] = result
            log(json.dumps(result, default=str)[:4000])
        _free_memory()
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment() -> dict:
    import transformers
    import triton

    env = dict(
        python=sys.version.split()[0],
        torch=torch.__version__,
        triton=triton.__version__,
        transformers=transformers.__version__,
    )
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            sms=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    return env


# -- phase 1: fp32 against transformers, graphs on against off -------------------------------


def ragged_prompts(vocab: int, count: int, rng: random.Random) -> list[list[int]]:
    lengths = [5, 17, 33, 64, 96, 130, 170, 200][:count]
    return [[rng.randrange(100, vocab - 100) for _ in range(n)] for n in lengths]


def fp32_vs_transformers(device: str, model: str, num_prompts: int = 8) -> dict:
    from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
    from splitserve.platform.engine.llm_engine import LLMEngine
    from splitserve.platform.sampling.params import SamplingParams
    from splitserve.platform.weights.random_weights import iter_random_weights

    engine = LLMEngine(
        EngineConfig(
            model=model,
            device=DeviceConfig(device=device, dtype="float32", quantization="none"),
            cache=CacheConfig(kv_cache_memory_bytes=512 * 2**20),
            scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=512),
        )
    )
    cfg = engine.model_config
    # wider weights, copied in place: the captured graphs read the same addresses
    tensors = {
        name: t if name.endswith("norm.weight") else t * 7.5
        for name, t in iter_random_weights(cfg, torch.float32, device, seed=1)
    }
    engine.model.load_weights(tensors.items())
    prompts = ragged_prompts(cfg.vocab_size, num_prompts, random.Random(0))
    lengths = [24 - 2 * i for i in range(num_prompts)]  # the batch shrinks through the buckets
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    graphs = engine.runner.graphs
    batches: list[int] = []
    if graphs is not None:
        run = graphs.run
        graphs.run = lambda seqs: batches.append(len(seqs)) or run(seqs)
    ours = [o.output_token_ids for o in engine.generate(prompts, params)]
    engine.runner.graphs = None
    engine.pool.reset_prefix_cache()  # the eager run computes every prompt again
    eager = [o.output_token_ids for o in engine.generate(prompts, params)]
    engine.runner.graphs = graphs
    reference = transformers_greedy(cfg, tensors, prompts, lengths, device)
    del engine, tensors
    same = [a == b for a, b in zip(ours, reference)]
    return dict(
        model=model,
        graphs=graphs is not None,
        graph_batches=sorted(set(batches)),
        prompts_equal_transformers=f"{sum(same)}/{len(same)}",
        first_difference=[_first_diff(a, b) for a, b in zip(ours, reference)],
        graphs_on_equal_off=f"{sum(a == b for a, b in zip(ours, eager))}/{len(ours)}",
        ok=all(same) and ours == eager,
    )


def transformers_greedy(cfg, tensors: dict, prompts, lengths, device: str) -> list[list[int]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        eos_token_id=None,
        pad_token_id=0,
    )
    if isinstance(getattr(hf_cfg, "rope_parameters", None), dict):  # transformers 5 keeps rope here
        hf_cfg.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    assert cfg.rope_scaling is None, "the check's model has plain rope"
    with torch.device(device):
        model = LlamaForCausalLM(hf_cfg).to(torch.float32).eval()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and all("lm_head" in m or "rotary" in m for m in missing), (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    out = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, lengths):
            ids = torch.tensor([prompt], device=device)
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )
            out.append(gen[0, len(prompt) :].tolist())
    del model
    return out


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


# -- phase 2: decode and prefill against the floors ------------------------------------------


def decode_prefill(smoke: bool) -> dict:
    import gpu_roofline as roof

    sizes = (
        roof.Sizes("random:tiny", "cpu", "bfloat16", (1, 2), 32, 3, (64,), 16 * 2**20, 128, 2, 4, 1)
        if smoke
        else roof.Sizes("random:llama-3-8b", "cuda", "bfloat16", (1, 64), 1024, 24, (2048,), 2 * 2**30, 8192, 64, 24, 2)
    )
    device = torch.device(sizes.device)
    rng = random.Random(0)
    result: dict = dict(sizes=sizes.__dict__)
    result["peaks"] = dict(
        hbm_bytes_per_s=roof.measure_bandwidth(device, sizes.copy_bytes, sizes.repeats),
        matmul_flop_per_s=roof.measure_matmul_rate(device, sizes.matmul_n, torch.bfloat16, sizes.repeats),
    )
    result["kernel_check"] = roof.check_kernels(device) if device.type == "cuda" else "skipped (no CUDA)"
    t = time.monotonic()
    engine = roof.build_engine(sizes)
    result["engine_start_s"] = time.monotonic() - t
    graphs = engine.runner.graphs
    result["graphs"] = (
        None
        if graphs is None
        else dict(buckets=graphs.sizes, captured_bytes=graphs.captured_bytes, num_splits=graphs.num_splits)
    )
    result["graph_memory"] = graph_memory(graphs)
    cfg = engine.model_config
    peak_bw, peak_mm = result["peaks"]["hbm_bytes_per_s"], result["peaks"]["matmul_flop_per_s"]
    result["decode"] = [
        roof.decode_row(cfg, roof.measure_decode(engine, b, sizes, rng), sizes.dtype, peak_bw)
        for b in sizes.decode_batches
    ]
    result["bf16_graphs_on_vs_off"] = graphs_on_vs_off(engine, rng)
    result["prefill"] = [
        roof.prefill_row(cfg, n, roof.measure_prefill(engine, n, sizes, rng), peak_mm) for n in sizes.prefill_tokens
    ]
    try:
        result["speculative_b1"] = speculative_b1(engine, rng, max_tokens=24 if smoke else 128)
    except Exception as exc:  # reported; the rest of the phase stands
        result["speculative_b1"] = dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:])
    del engine, graphs
    _free_memory()
    hf_tok_s = roof.measure_hf(cfg, sizes, device, rng)
    ours = next(r for r in result["decode"] if r["batch"] == sizes.hf_batch)
    result["baseline"] = dict(
        batch=ours["batch"], ours_tok_s=ours["tok_s"], hf_tok_s=hf_tok_s, speedup=ours["tok_s"] / hf_tok_s
    )
    result["acceptance"] = roof.acceptance(result)
    result["targets"] = roof.TARGETS
    return result


def graph_memory(graphs) -> dict | str:
    """What the capture took: `captured_bytes` against the free memory before and after it."""
    if graphs is None or graphs.free_bytes_around_capture is None:
        return "no graphs captured on this device"
    before, after = graphs.free_bytes_around_capture
    seen = before - after
    return dict(
        captured_bytes=graphs.captured_bytes,
        free_before=before,
        free_after=after,
        mem_get_info_delta=seen,
        ok=graphs.captured_bytes >= 0 and abs(graphs.captured_bytes - max(seen, 0)) <= 0.05 * max(seen, 1),
    )


def speculative_b1(engine, rng: random.Random, k: int = 4, max_tokens: int = 128, num_prompts: int = 3) -> dict:
    """Batch 1, greedy: plain decoding, then n-gram speculation (k proposals), on the same engine
    and prompts (each a random 128-token run repeated 6 times); tokens/s per request, medians."""
    from splitserve.platform.config import SpeculativeConfig
    from splitserve.platform.sampling.params import SamplingParams
    from splitserve.platform.spec.speculator import Speculator

    vocab = engine.model_config.vocab_size
    run = min(128, (engine.max_model_len - max_tokens - 8) // 6)
    prompts = []
    for _ in range(num_prompts):
        unit = [rng.randrange(100, vocab - 100) for _ in range(run)]
        prompts.append(unit * 6)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    spec = Speculator(
        SpeculativeConfig(num_speculative_tokens=k, max_batch_size=1, min_acceptance_rate=0.0), engine.max_model_len
    )
    arms: dict = {"plain": None, "ngram": spec}
    out: dict = {arm: dict(tok_s=[], tokens=[]) for arm in arms}
    saved = engine.speculator
    try:
        for speculator in arms.values():  # warm-up: the verification buckets compile
            engine.speculator = speculator
            engine.pool.reset_prefix_cache()
            engine.generate([prompts[0][:64]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        spec.stats.num_drafts = spec.stats.num_draft_tokens = spec.stats.num_accepted_tokens = 0
        for prompt in prompts:
            for arm, speculator in arms.items():
                engine.speculator = speculator
                engine.pool.reset_prefix_cache()
                engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # the prefill, untimed
                t = time.perf_counter()
                [o] = engine.generate([prompt], params)
                _sync()
                out[arm]["tok_s"].append(max_tokens / (time.perf_counter() - t))
                out[arm]["tokens"].append(o.output_token_ids)
    finally:
        engine.speculator = saved
    plain, ngram = out["plain"], out["ngram"]
    equal = [a == b for a, b in zip(plain["tokens"], ngram["tokens"], strict=True)]
    stats = spec.stats
    return dict(
        k=k,
        max_tokens=max_tokens,
        prompt_tokens=len(prompts[0]),
        plain_tok_s=statistics.median(plain["tok_s"]),
        ngram_tok_s=statistics.median(ngram["tok_s"]),
        speedup=statistics.median(ngram["tok_s"]) / statistics.median(plain["tok_s"]),
        greedy_equal=f"{sum(equal)}/{len(equal)}",
        first_difference=[_first_diff(a, b) for a, b in zip(plain["tokens"], ngram["tokens"], strict=True)],
        acceptance_rate=stats.num_accepted_tokens / max(stats.num_draft_tokens, 1),
        accepted_per_step=stats.num_accepted_tokens / max(stats.num_drafts, 1),
    )


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def graphs_on_vs_off(engine, rng: random.Random) -> dict | str:
    """Greedy tokens of 5 prompts (bucket 8, three padded rows) with the graphs, then eager."""
    from splitserve.platform.sampling.params import SamplingParams

    graphs = engine.runner.graphs
    if graphs is None:
        return "no graphs on this device"
    prompts = [
        [rng.randrange(100, engine.model_config.vocab_size - 100) for _ in range(n)] for n in (40, 300, 700, 64, 1000)
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine.pool.reset_prefix_cache()
    on = [o.output_token_ids for o in engine.generate(prompts, params)]
    engine.runner.graphs = None
    engine.pool.reset_prefix_cache()
    try:
        off = [o.output_token_ids for o in engine.generate(prompts, params)]
    finally:
        engine.runner.graphs = graphs
    return dict(
        equal=f"{sum(a == b for a, b in zip(on, off))}/{len(on)}",
        first_difference=[_first_diff(a, b) for a, b in zip(on, off)],
    )


# -- phase 4: fp32 prefill, IEEE against TF32 -----------------------------------------------


def fp32_prefill(smoke: bool) -> dict:
    """One prefill of `n` tokens in fp32, timed with IEEE fp32 GEMMs and attention (the default)
    and with torch's TF32 switch on (the GEMMs, and attention with them: kernels/triton_attention)."""
    from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
    from splitserve.platform.engine.llm_engine import LLMEngine
    from splitserve.platform.sampling.params import SamplingParams

    model, device, n = ("random:tiny", "cpu", 256) if smoke else ("random:llama-3.2-1b", "cuda", 8192)
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device=DeviceConfig(device=device, dtype="float32", quantization="none", enforce_eager=True),
            cache=CacheConfig(kv_cache_memory_bytes=2 * 2**30 if not smoke else 2**26),
            scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=n + 64, max_model_len=n + 64),
        )
    )
    cfg = engine.model_config
    rng = random.Random(3)
    params = SamplingParams(temperature=0, max_tokens=1)
    flops = (
        2 * n * sum(p.numel() for name, p in engine.model.named_parameters() if "embed" not in name)
        + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * n / 2
    )
    result: dict = dict(model=model, tokens=n, flop=flops)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for arm, tf32 in (("ieee", False), ("tf32", True)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            times = []
            for _ in range(3):  # the first compiles this shape
                prompt = [rng.randrange(100, cfg.vocab_size - 100) for _ in range(n)]
                engine.pool.reset_prefix_cache()
                _sync()
                t = time.perf_counter()
                engine.generate([prompt], params)
                _sync()
                times.append(time.perf_counter() - t)
            best = min(times[1:])
            result[arm] = dict(seconds=best, tflop_per_s=flops / best / 1e12)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
        del engine
    result["tf32_speedup"] = result["ieee"]["seconds"] / result["tf32"]["seconds"]
    return result


# -- phase 5: the kernel tests, compiled -----------------------------------------------------


def kernel_tests() -> dict:
    left = max(20.0, HARD_STOP_S - (time.monotonic() - T0))
    files = [
        "tests/platform/test_triton_split_decode.py",
        "tests/platform/test_triton_ops.py",
        "tests/platform/test_device_sampler.py",
        "tests/platform/test_triton_attention.py",
    ]
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=left,
        )
    except subprocess.TimeoutExpired as exc:
        return dict(error=f"timed out after {left:.0f} s", tail=str(exc.stdout)[-2000:])
    return dict(returncode=proc.returncode, tail=proc.stdout[-2500:] + proc.stderr[-1000:], ok=proc.returncode == 0)


# -- entry points ----------------------------------------------------------------------------


def run_worker(argv: list[str]) -> int:
    """One worker process, the `splitserve worker` subcommand without the console script."""
    import logging

    from splitserve.workers.main import register

    parser = argparse.ArgumentParser(prog="gpu_check.py")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["worker", *argv])
    logging.basicConfig(level="INFO", stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return run_worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny models: check the script, measure nothing")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("error: no CUDA device; run on a GPU machine or pass --smoke", file=sys.stderr)
        return 2
    report = Report(pathlib.Path(os.environ.get("OUT") or ROOT / "bench-out" / "gpu-check"))
    report.data["environment"] = environment()
    report.data["smoke"] = args.smoke
    device = "cpu" if args.smoke else "cuda"
    report.phase(
        "fp32_vs_transformers",
        fp32_vs_transformers,
        device,
        "random:tiny" if args.smoke else "random:smollm2-135m",
        4 if args.smoke else 8,
    )
    report.phase("decode_prefill", decode_prefill, args.smoke)
    # P/D gets what is left before the hard stop, less ~60 s for the phases after it
    report.phase(
        "pd",
        gpu_check_pd.pd,
        args.smoke,
        lambda: HARD_STOP_S - 60 - (time.monotonic() - T0),
        report.path.with_name("gpu_check_pd_partial.json"),
    )
    report.phase("fp32_prefill", fp32_prefill, args.smoke)
    if not args.smoke:
        report.phase("kernel_tests", kernel_tests)
    report.phase("tensor_parallel", gpu_check_tp.tensor_parallel, args.smoke)
    report.data["total_s"] = round(time.monotonic() - T0, 1)
    report.path.write_text(json.dumps(report.data, indent=1, default=str))
    log(f"wrote {report.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
