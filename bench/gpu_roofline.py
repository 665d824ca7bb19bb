"""GPU roofline benchmark (issue 8, issue 30; `make bench-gpu`): the engine on CUDA against the hardware limit.

One run on one GPU, no network: `random:llama-3-8b` in bf16 (random weights of the real shapes).

1. Peaks of this GPU, measured in the same run: HBM bandwidth from a large device-to-device
   copy (bytes read + bytes written over time) and the bf16 matmul rate from a large square
   matmul (2 n^3 FLOPs over time).
2. Kernel check: the Triton paged-attention kernels against the torch reference on the GPU
   (decode single-pass and split-context, prefill with prefixes, fp32 and bf16), before
   anything is timed.
3. Decode, what a user waits for per token: B requests with CONTEXT-token prompts are prefilled,
   then each engine.step() of pure decode is timed from a synchronised start to its return. A
   step returns only after its sampled tokens are on the host (the sampler's one device-to-host
   copy waits for the GPU), so this wall time is the interval between two tokens of a stream,
   scheduling, input preparation, the forward, sampling and output processing included. Both
   arms run on the same engine in the same run: CUDA graphs on (the graphs captured at start-up)
   and off (the runner's graphs detached: everything eager, as --enforce-eager). Floor: the bytes
   a step must read from HBM (every weight matrix once, the B gathered embedding rows, the K and
   V of every context token of every layer) over the measured bandwidth. The input embedding
   table is not read whole (only B rows), so it is not counted; the LM head is.
4. Where the time goes: a few more decode steps of each arm under torch.profiler: CUDA kernels
   launched per step, the GPU-busy time per step (union of the kernels' intervals) and its
   share of the step's wall time; the rest is the host (Python, launches, the copy back).
5. Prefill: one prompt of N tokens, the step that prefills it and samples its first token.
   Floor: its FLOPs (2 x matmul weights x N, the one sampled LM-head row, causal attention
   QK^T and PV) over the measured matmul rate. Achieved fraction = floor / time.
6. Baseline: the same shapes through transformers' LlamaForCausalLM.generate at batch 64 with the
   same prompt length; its decode throughput is B (n - 1) over the time from the first to the last
   of its n generation steps, stamped inside the one generate call.

Why two earlier harnesses disagreed at batch 1 (24.8 ms here, 14.9 ms timing engine.step() with one
synchronisation per step): reading both, they time the same call, engine.step(), and both end at
the sampler's copy to the host, so neither measures a different thing; what differs is the engine
they time. This script built its engine for its largest shapes (max_num_seqs 128,
max_num_batched_tokens 8192, max_model_len 8256, a KV pool for 128 x 1k tokens) and timed batch
1 first, right after the kernel check had compiled other specialisations; the other timed a
default-sized engine. In the eager engine a step is host-bound (854 launches, GPU busy 7.9 of
14.9 ms), so anything that adds host work per launch or per step shows up in full, and nothing on
the GPU explains 10 ms. The code does not show which per-step cost grew with the bigger engine;
rather than guess, this script now reports, for one engine in one process, the wall time per step
next to the profiler's GPU-busy time and kernel count, so a host-side difference is visible as
host time in the same table, and with graphs the host's share per step is one replay.

Results go to docs/benchmarks.md between the gpu-roofline markers, and as JSON on stdout.
`--smoke` runs every phase on CPU with `random:tiny` and tiny sizes, to check the script itself.

Usage: python bench/gpu_roofline.py [--write docs/benchmarks.md] [--smoke]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from splitserve.platform.weights.names import layer_weight_shapes

MARK_BEGIN = "<!-- gpu-roofline:begin -->"
MARK_END = "<!-- gpu-roofline:end -->"
COMMAND = "make bench-gpu  # = python bench/gpu_roofline.py --write docs/benchmarks.md"
# issue 30's acceptance: decode at batch 1 and 64 against the HBM floor, prefill against the matmul rate
TARGETS = dict(
    decode_batch1_max_ratio=1.25, decode_batch64_max_ratio=1.6, prefill_2k_min_fraction=0.65, hf_min_speedup=3.0
)
PROFILE_STEPS = 5


@dataclass(frozen=True)
class Sizes:
    model: str
    device: str
    dtype: str
    decode_batches: tuple[int, ...]
    context: int
    decode_steps: int
    prefill_tokens: tuple[int, ...]
    copy_bytes: int
    matmul_n: int
    hf_batch: int
    hf_new_tokens: int
    repeats: int


FULL = Sizes(
    "random:llama-3-8b",
    "cuda",
    "bfloat16",
    (1, 8, 32, 64, 128),
    1024,
    32,
    (512, 2048, 8192),
    4 * 1024**3,
    8192,
    64,
    32,
    3,
)
SMOKE = Sizes("random:tiny", "cpu", "bfloat16", (1, 2), 32, 3, (16, 64), 16 * 1024**2, 128, 2, 4, 1)


# -- floors (pure) ---------------------------------------------------------------------------

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_section  # noqa: E402


def dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Weights of one decoder layer's matrices (q, k, v, o, gate, up, down); norms and biases
    are not matmul work and a rounding error of the bytes."""
    return sum(r * c for r, c in (s for s in layer_weight_shapes(cfg, 0).values() if len(s) == 2))


def param_count(cfg: ModelConfig) -> int:
    """Every parameter of the checkpoint (tied embeddings counted once)."""
    per_layer = sum(_numel(s) for s in layer_weight_shapes(cfg, 0).values())
    embed = cfg.vocab_size * cfg.hidden_size
    return cfg.num_layers * per_layer + cfg.hidden_size + embed * (1 if cfg.tie_word_embeddings else 2)


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    """K and V of one token across all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(dtype)


def decode_weight_bytes(cfg: ModelConfig, batch: int, dtype: str) -> int:
    """Weight bytes one decode step reads: all parameters but the input embedding table, of
    which only the batch's rows are gathered (tied: the table is read whole as the LM head)."""
    unread = 0 if cfg.tie_word_embeddings else (cfg.vocab_size - batch) * cfg.hidden_size
    return (param_count(cfg) - unread) * dtype_bytes(dtype)


def decode_step_bytes(cfg: ModelConfig, batch: int, context_len: int, dtype: str) -> int:
    """HBM bytes a decode step of `batch` sequences, each attending to `context_len` keys, must
    read: the weights once plus every sequence's K and V."""
    return decode_weight_bytes(cfg, batch, dtype) + batch * context_len * kv_bytes_per_token(cfg, dtype)


def prefill_flops(cfg: ModelConfig, num_tokens: int, start_pos: int = 0) -> int:
    """FLOPs of prefilling `num_tokens` after `start_pos` cached ones and sampling the last:
    2 per weight per token for the layer matmuls, one LM-head row, and causal attention, where
    query i sees start_pos + i + 1 keys and QK^T and PV cost 2 * head_dim FLOPs per key each."""
    matmuls = 2 * cfg.num_layers * layer_matmul_params(cfg) * num_tokens
    lm_head = 2 * cfg.vocab_size * cfg.hidden_size
    keys_seen = num_tokens * start_pos + num_tokens * (num_tokens + 1) // 2
    attention = cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * keys_seen
    return matmuls + lm_head + attention


def floor_seconds(work: float, rate: float) -> float:
    """Time at `rate` (bytes/s or FLOP/s) for `work` (bytes or FLOPs)."""
    return work / rate


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- measurements ----------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of fn() over `repeats` runs, each synchronised."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_bandwidth(device: torch.device, num_bytes: int, repeats: int) -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = time_op(lambda: dst.copy_(src), device, max(repeats, 10))
    return 2 * num_bytes / seconds


def measure_matmul_rate(device: torch.device, n: int, dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of an n x n x n matmul."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = time_op(lambda: a @ b, device, max(repeats, 10))
    return 2 * n**3 / seconds


def check_kernels(device: torch.device) -> dict:
    """Max relative error of the Triton kernels against the torch reference on this GPU."""
    from splitserve.platform.kernels.triton_attention import paged_decode_attention, paged_prefill_attention
    from splitserve.platform.models.attention import decode_attention, gather_kv, prefill_attention

    gen = torch.Generator(device=device).manual_seed(0)
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        heads, kv_heads, dim, bs, num_blocks = 32, 8, 128, 16, 512
        k_cache, v_cache = (
            torch.randn(num_blocks, bs, kv_heads, dim, device=device, generator=gen).to(dtype) for _ in range(2)
        )
        perm = torch.randperm(num_blocks, device=device, generator=gen)
        table = perm[: 4 * 70].view(4, 70)  # 4 sequences, up to 1120 tokens
        ctx = torch.tensor([1, 300, 1001, 1120], device=device, dtype=torch.int32)
        q = torch.randn(4, heads, dim, device=device, generator=gen).to(dtype)
        out = paged_decode_attention(q, k_cache, v_cache, table, ctx, dim**-0.5)
        mask = torch.arange(70 * bs, device=device)[None, :] < ctx[:, None]
        ref = decode_attention(
            q.float(), gather_kv(k_cache.float(), table), gather_kv(v_cache.float(), table), dim**-0.5, mask
        )
        errors[f"decode_{dtype}"] = _rel_error(out, ref)
        from splitserve.platform.kernels.triton_split_decode import split_decode_attention

        out = split_decode_attention(q, k_cache, v_cache, table, ctx, dim**-0.5, 8)
        errors[f"split_decode_{dtype}"] = _rel_error(out, ref)
        q_lens, starts = [700, 1, 300], [0, 999, 513]
        cu = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
        q = torch.randn(sum(q_lens), heads, dim, device=device, generator=gen).to(dtype)
        tables = table[:3]
        out = paged_prefill_attention(
            q, k_cache, v_cache, cu, torch.tensor(starts, device=device, dtype=torch.int32), tables, dim**-0.5
        )
        ref = torch.cat(
            [
                prefill_attention(
                    q[cu[s] : cu[s + 1]].float(),
                    gather_kv(k_cache.float(), tables[s])[: n + st],
                    gather_kv(v_cache.float(), tables[s])[: n + st],
                    dim**-0.5,
                    torch.ones(n, n + st, dtype=torch.bool, device=device).tril(st),
                )
                for s, (n, st) in enumerate(zip(q_lens, starts))
            ]
        )
        errors[f"prefill_{dtype}"] = _rel_error(out, ref)
    return errors


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def build_engine(sizes: Sizes):
    """The engine under test: one step holds the longest prompt; the KV pool holds the largest
    decode batch (plus the tokens decoded while the batch prefills, plus partial blocks)."""
    from splitserve.platform.engine.llm_engine import LLMEngine
    from splitserve.platform.weights.presets import preset_config

    cfg = preset_config(sizes.model.removeprefix("random:"), sizes.model)
    max_batch, longest = max(sizes.decode_batches), max(sizes.prefill_tokens)
    prefill_steps = -(-max_batch * sizes.context // longest)
    max_model_len = longest + 64
    tokens = max(max_batch * (sizes.context + prefill_steps + sizes.decode_steps + 32), max_model_len + 32)
    return LLMEngine(
        EngineConfig(
            model=sizes.model,
            device=DeviceConfig(device=sizes.device, dtype=sizes.dtype),
            cache=CacheConfig(kv_cache_memory_bytes=int(tokens * kv_bytes_per_token(cfg, sizes.dtype) * 1.05)),
            scheduler=SchedulerConfig(
                max_num_seqs=max_batch, max_num_batched_tokens=longest, max_model_len=max_model_len
            ),
        )
    )


def random_prompts(vocab: int, count: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def measure_decode(engine, batch: int, sizes: Sizes, rng: random.Random) -> dict:
    """Per arm (graphs on, when the engine captured them, and off): the median wall seconds of a
    pure-decode step at `batch` from a synchronised start (what a user waits per token), and the
    profiler's view of PROFILE_STEPS more steps; plus the mean number of keys a sequence attends
    to over the timed steps (prompts prefilled early decode while the others prefill, so
    contexts differ by a few tokens). The arms run on the same requests, one after the other."""
    from splitserve.platform.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)  # aborted below
    engine.pool.reset_prefix_cache()
    ids = [
        engine.add_request(params=params, prompt_token_ids=prompt)
        for prompt in random_prompts(engine.model_config.vocab_size, batch, sizes.context, rng)
    ]
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked) until all decode
        started.update(o.req_id for o in engine.step() if o.num_output_tokens)
    graphs = engine.runner.graphs
    arms = {"graphs": graphs, "eager": None} if graphs is not None else {"eager": None}
    result, keys = dict(batch=batch), []
    try:
        for arm, runner_graphs in arms.items():
            engine.runner.graphs = runner_graphs
            engine.step()  # warm-up decode step
            times = []
            for _ in range(sizes.decode_steps):
                sync(engine.device)
                t = time.perf_counter()
                outs = engine.step()
                times.append(time.perf_counter() - t)
                assert len(outs) == batch and all(len(o.new_token_ids) == 1 for o in outs), "a step was not pure decode"
                # the step's input is the previous last token: it attends to prompt + outputs - 1 keys
                keys += [o.num_prompt_tokens + o.num_output_tokens - 1 for o in outs]
            result[arm] = dict(step_s=statistics.median(times), **profile_steps(engine, PROFILE_STEPS))
    finally:
        engine.runner.graphs = graphs
    for req_id in ids:
        engine.abort(req_id)
    while engine.has_unfinished_requests():
        engine.step()
    result["context"] = statistics.mean(keys)
    result["step_s"] = min(result[arm]["step_s"] for arm in arms)
    return result


def profile_steps(engine, steps: int) -> dict:
    """CUDA kernels (memcpy and memset included) per step, GPU-busy seconds per step (the union of their
    intervals) and their share of the wall time, over `steps` engine steps under torch.profiler.
    On a CPU (smoke runs) only the wall time is known."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    sync(engine.device)
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(engine.device)
        wall = (time.perf_counter() - t) / steps
    if not on_cuda:
        return dict(profiled_step_s=wall, kernels_per_step=None, gpu_busy_s=None, gpu_busy_share=None)
    intervals = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    busy_us, reach = 0.0, float("-inf")
    for begin, end in intervals:  # union of intervals, in microseconds
        if end > reach:
            busy_us += end - max(begin, reach)
            reach = end
    busy = busy_us * 1e-6 / steps
    return dict(
        profiled_step_s=wall, kernels_per_step=len(intervals) / steps, gpu_busy_s=busy, gpu_busy_share=busy / wall
    )


def measure_prefill(engine, num_tokens: int, sizes: Sizes, rng: random.Random) -> float:
    """Median wall seconds of the step that prefills a `num_tokens` prompt (fresh, no prefix hit)."""
    from splitserve.platform.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(sizes.repeats + 1):  # the first run compiles and warms up
        engine.pool.reset_prefix_cache()
        engine.add_request(
            params=params, prompt_token_ids=random_prompts(engine.model_config.vocab_size, 1, num_tokens, rng)[0]
        )
        sync(engine.device)
        t = time.perf_counter()
        outs = engine.step()
        sync(engine.device)
        assert outs and outs[0].finished, "the prompt did not prefill in one step"
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_hf(cfg: ModelConfig, sizes: Sizes, device: torch.device, rng: random.Random) -> float:
    """transformers' generate decode throughput (tokens/s) at sizes.hf_batch: a logits processor
    stamps the time at every generation step, so the decode steps are timed inside one call."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LogitsProcessorList

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
    )
    # rope scaling is left out: it changes the frequencies, not the cost
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=getattr(torch, sizes.dtype)).eval()
    prompts = torch.tensor(random_prompts(cfg.vocab_size, sizes.hf_batch, sizes.context, rng), device=device)
    rates = []
    for i in range(sizes.repeats + 1):  # the first run warms up
        stamps: list[float] = []
        with torch.inference_mode():
            out = model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=False,
                max_new_tokens=sizes.hf_new_tokens,
                min_new_tokens=sizes.hf_new_tokens,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([_StepClock(device, stamps)]),
            )
        assert out.shape[1] == sizes.context + sizes.hf_new_tokens and len(stamps) == sizes.hf_new_tokens
        if i:  # stamps[0] follows the prefill; then one stamp per decode step
            rates.append(sizes.hf_batch * (len(stamps) - 1) / (stamps[-1] - stamps[0]))
    del model
    return statistics.median(rates)


class _StepClock:
    """A transformers logits processor that appends the (synchronised) time at each step."""

    def __init__(self, device: torch.device, stamps: list[float]):
        self.device, self.stamps = device, stamps

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync(self.device)
        self.stamps.append(time.perf_counter())
        return scores


# -- the run ---------------------------------------------------------------------------------


def run(sizes: Sizes) -> dict:
    device = torch.device(sizes.device)
    rng = random.Random(0)
    result: dict = dict(sizes=asdict(sizes), environment=environment(device))
    peak_bw = measure_bandwidth(device, sizes.copy_bytes, sizes.repeats)
    peak_mm = measure_matmul_rate(device, sizes.matmul_n, getattr(torch, sizes.dtype), sizes.repeats)
    result["peaks"] = dict(hbm_bytes_per_s=peak_bw, matmul_flop_per_s=peak_mm)
    result["kernel_check"] = check_kernels(device) if device.type == "cuda" else "skipped (no CUDA)"
    engine = build_engine(sizes)
    cfg = engine.model_config
    result["attention_path"] = attention_path(device)
    result["decode"] = [
        decode_row(cfg, measure_decode(engine, b, sizes, rng), sizes.dtype, peak_bw) for b in sizes.decode_batches
    ]
    result["prefill"] = [
        prefill_row(cfg, n, measure_prefill(engine, n, sizes, rng), peak_mm) for n in sizes.prefill_tokens
    ]
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf_tok_s = measure_hf(cfg, sizes, device, rng)
    ours = next((r for r in result["decode"] if r["batch"] == sizes.hf_batch), result["decode"][-1])
    result["baseline"] = dict(
        batch=ours["batch"], ours_tok_s=ours["tok_s"], hf_tok_s=hf_tok_s, speedup=ours["tok_s"] / hf_tok_s
    )
    result["acceptance"] = acceptance(result)
    return result


def decode_row(cfg: ModelConfig, m: dict, dtype: str, bandwidth: float) -> dict:
    """The measured arms with their floor ratio and tokens/s; the row's own step is the faster arm's."""
    work = decode_step_bytes(cfg, m["batch"], m["context"], dtype)
    floor = floor_seconds(work, bandwidth)
    row = dict(m, bytes_per_step=work, floor_s=floor, ratio=m["step_s"] / floor, tok_s=m["batch"] / m["step_s"])
    for arm in ("graphs", "eager"):
        if arm in m:
            row[arm] = dict(m[arm], ratio=m[arm]["step_s"] / floor, tok_s=m["batch"] / m[arm]["step_s"])
    return row


def prefill_row(cfg: ModelConfig, num_tokens: int, seconds: float, matmul_rate: float) -> dict:
    flops = prefill_flops(cfg, num_tokens)
    floor = floor_seconds(flops, matmul_rate)
    return dict(
        tokens=num_tokens,
        step_s=seconds,
        tok_s=num_tokens / seconds,
        flops=flops,
        floor_s=floor,
        fraction=floor / seconds,
    )


def acceptance(result: dict) -> dict:
    batch1 = next((r for r in result["decode"] if r["batch"] == 1), None)
    batch64 = next((r for r in result["decode"] if r["batch"] == 64), None)
    prefill_2k = next((r for r in result["prefill"] if r["tokens"] == 2048), None)
    return dict(
        decode_batch1_ratio_ok=None if batch1 is None else batch1["ratio"] <= TARGETS["decode_batch1_max_ratio"],
        decode_batch64_ratio_ok=None if batch64 is None else batch64["ratio"] <= TARGETS["decode_batch64_max_ratio"],
        prefill_2k_fraction_ok=None
        if prefill_2k is None
        else prefill_2k["fraction"] >= TARGETS["prefill_2k_min_fraction"],
        hf_speedup_ok=result["baseline"]["speedup"] >= TARGETS["hf_min_speedup"],
    )


def attention_path(device: torch.device) -> str:
    from splitserve.platform.kernels.dispatch import triton_available

    return "triton" if triton_available(device) else "torch reference"


def environment(device: torch.device) -> dict:
    import transformers

    env = dict(torch=torch.__version__, transformers=transformers.__version__, python=sys.version.split()[0])
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 1024**3, 1), cuda=torch.version.cuda)
    else:
        env.update(gpu=None, cpu_threads=torch.get_num_threads())
    return env


# -- report ----------------------------------------------------------------------------------


def render(r: dict, command: str) -> str:
    env, peaks, base = r["environment"], r["peaks"], r["baseline"]
    ok = {True: "✓", False: "✗", None: "–"}
    acc = r["acceptance"]
    lines = [
        MARK_BEGIN,
        "",
        f"Model `{r['sizes']['model']}` in {r['sizes']['dtype']} on "
        f"{env.get('gpu') or 'CPU (smoke run)'}; torch {env['torch']}, triton {env['triton']}, "
        f"transformers {env['transformers']}; attention: {r['attention_path']}.",
        "",
        f"Command: `{command}`",
        "",
        f"Measured peaks: HBM {peaks['hbm_bytes_per_s'] / 1e9:.0f} GB/s (device-to-device copy), "
        f"bf16 matmul {peaks['matmul_flop_per_s'] / 1e12:.1f} TFLOP/s "
        f"({r['sizes']['matmul_n']}³). Kernel check (max rel. error vs torch): {_fmt_check(r['kernel_check'])}.",
        "",
        "Decode: wall time per step from a synchronised start, i.e. the wait between two tokens; kernels "
        "and GPU-busy time from torch.profiler over the same engine's next steps.",
        "",
        "| decode batch | arm | context | step (ms) | HBM floor (ms) | step / floor | tok/s | kernels / step "
        "| GPU busy (ms) | busy share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_decode_line(d, arm) for d in r["decode"] for arm in ("graphs", "eager") if arm in d]
    lines += [
        "",
        "| prefill tokens | step (ms) | tok/s | matmul floor (ms) | share of matmul rate |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {p['tokens']} | {p['step_s'] * 1e3:.1f} | {p['tok_s']:.0f} | {p['floor_s'] * 1e3:.1f} "
        f"| {p['fraction']:.0%} |"
        for p in r["prefill"]
    ]
    lines += [
        "",
        f"Decode at batch {base['batch']}: splitserve {base['ours_tok_s']:.0f} tok/s, transformers "
        f"`generate` {base['hf_tok_s']:.0f} tok/s: {base['speedup']:.2f}×.",
        "",
        f"Targets: batch-1 decode ≤ {TARGETS['decode_batch1_max_ratio']}× floor "
        f"{ok[acc['decode_batch1_ratio_ok']]}; batch-64 decode ≤ {TARGETS['decode_batch64_max_ratio']}× floor "
        f"{ok[acc['decode_batch64_ratio_ok']]}; 2k prefill ≥ {TARGETS['prefill_2k_min_fraction']:.0%} of the "
        f"matmul rate {ok[acc['prefill_2k_fraction_ok']]}; batch-{base['batch']} decode ≥ {TARGETS['hf_min_speedup']}× "
        f"transformers {ok[acc['hf_speedup_ok']]}.",
        "",
        MARK_END,
    ]
    return "\n".join(lines)


def _decode_line(d: dict, arm: str) -> str:
    a = d[arm]
    kernels = "–" if a["kernels_per_step"] is None else f"{a['kernels_per_step']:.0f}"
    busy = "–" if a["gpu_busy_s"] is None else f"{a['gpu_busy_s'] * 1e3:.2f}"
    share = "–" if a["gpu_busy_share"] is None else f"{a['gpu_busy_share']:.0%}"
    return (
        f"| {d['batch']} | {arm} | {d['context']:.0f} | {a['step_s'] * 1e3:.2f} | {d['floor_s'] * 1e3:.2f} "
        f"| {a['ratio']:.2f}× | {a['tok_s']:.0f} | {kernels} | {busy} | {share} |"
    )


def _fmt_check(check) -> str:
    if isinstance(check, str):
        return check
    return ", ".join(f"{k.replace('torch.', '')} {v:.1e}" for k, v in check.items())


def write(path: str, section: str) -> None:
    write_section(path, "gpu-roofline", section)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", help="update this markdown file's gpu-roofline section")
    ap.add_argument("--smoke", action="store_true", help="CPU, random:tiny, tiny sizes: checks the script")
    args = ap.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    if sizes.device == "cuda" and not torch.cuda.is_available():
        print(
            f"error: no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}); run on a "
            "GPU machine with a CUDA build of torch, or pass --smoke to check the script on CPU",
            file=sys.stderr,
        )
        return 2
    result = run(sizes)
    section = render(result, "python bench/gpu_roofline.py --smoke" if args.smoke else COMMAND)
    print(section, file=sys.stderr)
    print(json.dumps(result, default=str))
    if args.write:
        write(args.write, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
