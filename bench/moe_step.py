"""One decode step of a mixture-of-experts model against the dense model with the same active
parameters, on this CPU, fp32, quantization none (models/moe.py's grouped execution).

Both models are Qwen3-shaped (q/k norm) with random weights: the same attention, embedding and
head; the dense MLP has intermediate size E_ACTIVE * MOE_INTER, the MoE MLP has NUM_EXPERTS
experts of MOE_INTER, E_ACTIVE per token. So per token they do the same multiply-adds; what
the MoE pays on top is routing, the sort by expert, one matmul per expert that received tokens
and projection (more, smaller matmuls) and the scatter back. The MoE model runs twice: with
torch's grouped matmul (its CPU default, models/moe.py) and with the per-expert Python loop (the
same weights, `use_grouped_mm` off). Each (variant, batch) is timed as the best of REPEATS decode
steps over CONTEXT cached tokens per sequence, the three variants' steps interleaved in one run
(so all see the same load on a shared host).

    python bench/moe_step.py [--layers 8] [--repeats 20] [--batches 1,8,32] [--write docs/benchmarks.md]

(fewer layers and repeats keep a run on a busy shared host within a few minutes; the ratios are
per step, so the layer count scales both models alike.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from splitserve.platform.config import ModelConfig
from splitserve.platform.engine.runner import ModelRunner
from splitserve.platform.kv.cache import allocate_kv_cache
from splitserve.platform.models import build_model
from splitserve.platform.models.moe import SparseMoeBlock
from splitserve.platform.sched.plan import ScheduledSeq
from splitserve.platform.weights.random_weights import iter_random_weights

NUM_EXPERTS, E_ACTIVE, MOE_INTER = 32, 4, 384
SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    num_layers=8,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    qk_norm=True,
)
BATCHES, CONTEXT, REPEATS, BLOCK = (1, 8, 32), 256, 20, 16
LAYERS = SHAPE["num_layers"]


def model_for(config: ModelConfig):
    model = build_model(config)
    model.load_weights(iter_random_weights(config, torch.float32))
    return model.eval()


def step_inputs(model, config: ModelConfig, batch: int):
    """A decode step of `batch` sequences with CONTEXT cached tokens each: (caches, ids, positions, meta, sample)."""
    blocks_per_seq = CONTEXT // BLOCK + 1
    caches = allocate_kv_cache(config, batch * blocks_per_seq, BLOCK, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, caches, BLOCK, torch.device("cpu"))
    seqs = [
        ScheduledSeq(f"r{i}", (100 + i,), CONTEXT, tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), True)
        for i in range(batch)
    ]
    return caches, runner, seqs


def set_grouped_mm(model, grouped: bool) -> None:
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.use_grouped_mm = grouped


def paired_step_ms(variants, batch: int, repeats: int) -> list[float]:
    """Best step time (ms) of each (model, config, grouped) variant, their steps interleaved so all
    see the same host load; `grouped` sets the MoE blocks' path before each of its steps."""
    inputs = [step_inputs(m, c, batch) for m, c, _ in variants]
    times: list[list[float]] = [[] for _ in variants]
    with torch.inference_mode():
        for _ in range(repeats + 2):
            for (model, _, grouped), (caches, runner, seqs), out in zip(variants, inputs, times):
                set_grouped_mm(model, grouped)
                ids, positions, meta, sample = runner._prepare(seqs)
                t0 = time.perf_counter()
                model.compute_logits(model(ids, positions, caches, meta)[sample])
                out.append(time.perf_counter() - t0)
    return [1000 * min(t[2:]) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", default=None, help="docs/benchmarks.md to update")
    parser.add_argument("--layers", type=int, default=LAYERS, help="decoder layers of both models")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed steps per variant and batch (best kept)")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    args = parser.parse_args()
    SHAPE["num_layers"] = args.layers
    dense_cfg = ModelConfig(
        model_id="bench-dense", architecture="qwen3", intermediate_size=E_ACTIVE * MOE_INTER, **SHAPE
    )
    moe_cfg = ModelConfig(
        model_id="bench-moe",
        architecture="qwen3_moe",
        intermediate_size=E_ACTIVE * MOE_INTER,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=E_ACTIVE,
        moe_intermediate_size=MOE_INTER,
        norm_topk_prob=True,
        **SHAPE,
    )
    dense, moe = model_for(dense_cfg), model_for(moe_cfg)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        d, m, loop = paired_step_ms(
            [(dense, dense_cfg, True), (moe, moe_cfg, True), (moe, moe_cfg, False)], batch, args.repeats
        )
        rows.append(f"| {batch} | {d:.1f} | {m:.1f} | {m / d:.2f}x | {loop:.1f} | {loop / d:.2f}x | {m / loop:.2f}x |")
        print(rows[-1], flush=True)
    section = "\n".join(
        [
            "<!-- moe_step:begin -->",
            "## Mixture-of-experts decode step vs dense (bench/moe_step.py)",
            "",
            f"Qwen3-shaped random models, hidden {SHAPE['hidden_size']}, {SHAPE['num_layers']} layers, vocab "
            f"{SHAPE['vocab_size']}, fp32, quantization none, {torch.get_num_threads()} torch threads, "
            f"{CONTEXT} cached tokens per sequence, best of {args.repeats} steps, the three variants' steps interleaved: "
            f"the MoE model has {NUM_EXPERTS} experts of {MOE_INTER}, "
            f"{E_ACTIVE} per token; the dense one an MLP of {E_ACTIVE * MOE_INTER} (the same active parameters). "
            f"Target: the MoE step within 1.5x the dense one. Host load average while measuring: "
            f"{os.getloadavg()[0]:.1f} (a shared 2-core machine: the ratios, measured in one run with interleaved "
            "steps, are what count). Beyond batch 1 the MoE step reads more expert weights than the dense "
            "step reads MLP weights (tokens pick different experts). 'MoE step' runs the experts with "
            "torch's grouped matmul (the CPU default); 'loop' is the same model with one matmul pair per "
            "expert in a Python loop (`use_grouped_mm` off): both give the same bits."
            + (
                f" With {args.layers} layers instead of {LAYERS} the shared head (vocab {SHAPE['vocab_size']}) weighs "
                "more in every step, pulling MoE / dense toward 1; grouped / loop compares the experts' two paths "
                "directly."
                if args.layers != LAYERS
                else ""
            ),
            "",
            f"Reproduce: `nice -n 19 python bench/moe_step.py --layers {args.layers} --repeats {args.repeats} "
            f"--batches {args.batches} --write docs/benchmarks.md`",
            "",
            "| batch | dense step (ms) | MoE step (ms) | MoE / dense | MoE, loop (ms) | loop / dense "
            "| grouped / loop |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "<!-- moe_step:end -->",
        ]
    )
    print(section)
    if args.write:
        sys.path.insert(0, "bench")
        from report import write_section

        write_section(args.write, "moe_step", section)


if __name__ == "__main__":
    main()
