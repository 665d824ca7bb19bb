"""Phase `tensor_parallel` of bench/gpu_check.py: TP 2 against TP 1 on two GPUs.

With fewer than two visible GPUs the phase says so and measures nothing. Otherwise, on
`random:llama-3.2-1b` (32 heads and 8 KV heads split over two ranks, NCCL, decode graphs
captured on both ranks in lockstep):

- `greedy_fp32`: greedy tokens of 6 prompts at TP 1 and TP 2 in float32, the number equal
  (reported, and the first differing position of any that are not);
- `decode_bf16`: the decode step at batch 1 and 64 (256-token prompts, median of 16 steps through
  LLMEngine.step()) at TP 1 and TP 2, and rank 0's collectives per step.
`--smoke` (bench/gpu_check.py --smoke) runs the same on the CPU with gloo and `random:tiny`.
"""

from __future__ import annotations

import statistics
import time

import torch

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, ParallelConfig, SchedulerConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.sampling.params import SamplingParams


def engine(model: str, device: str, dtype: str, tp: int, max_num_seqs: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=model,
            cache=CacheConfig(kv_cache_memory_bytes=2 * 2**30 if device == "cuda" else 64 * 2**20),
            scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=max_num_seqs),
            device=DeviceConfig(device=device, dtype=dtype, quantization="none"),
            parallel=ParallelConfig(tensor_parallel_size=tp),
        )
    )


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    return [[(97 * i + 31 * j) % (vocab - 10) + 5 for j in range(length + 7 * i)] for i in range(count)]


def greedy(model: str, device: str, tp: int) -> list[list[int]]:
    eng = engine(model, device, "float32", tp, 8)
    try:
        ids = prompts(6, 24, eng.model_config.vocab_size)
        return [o.output_token_ids for o in eng.generate(ids, SamplingParams(temperature=0, max_tokens=32))]
    finally:
        eng.close()


def decode_steps(model: str, device: str, tp: int, batches: tuple[int, ...], steps: int) -> dict:
    eng = engine(model, device, "bfloat16" if device == "cuda" else "float32", tp, max(batches))
    out = {}
    try:
        for batch in batches:
            params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
            for p in prompts(batch, 256 if device == "cuda" else 16, eng.model_config.vocab_size):
                eng.add_request(params=params, prompt_token_ids=p[:256])
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
                eng.step()
            if eng.executor:
                eng.executor.group.stats.take()
            times = []
            for _ in range(steps):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                eng.step()
                times.append(1000 * (time.perf_counter() - t0))
            row = {"step_ms": round(statistics.median(times), 3)}
            if eng.executor:
                row["collectives_per_step"] = eng.executor.group.stats.take()[0] / steps
            out[f"b{batch}"] = row
            for req_id in list(eng.scheduler.requests):
                eng.abort(req_id)
            eng.step()
    finally:
        eng.close()
    return out


def tensor_parallel(smoke: bool) -> dict:
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not smoke and visible < 2:
        return {"skipped": f"{visible} GPU visible; TP 2 needs 2 (TP 1 figures above stand alone)"}
    device, model = ("cpu", "random:tiny") if smoke else ("cuda", "random:llama-3.2-1b")
    tp1, tp2 = greedy(model, device, 1), greedy(model, device, 2)
    diffs = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(tp1, tp2)]
    result = {
        "visible_gpus": visible,
        "greedy_fp32": {"equal": sum(a == b for a, b in zip(tp1, tp2)), "of": len(tp1), "first_diff": diffs},
    }
    batches, steps = ((1, 2), 3) if smoke else ((1, 64), 16)
    result["decode_bf16"] = {
        "tp1": decode_steps(model, device, 1, batches, steps),
        "tp2": decode_steps(model, device, 2, batches, steps),
    }
    return result
