"""torch.compile (inductor, CPU) against the hand-fused C kernels (platform/kernels/cpu_ops.c) for one
layer's small ops of a decode step: residual add + RMSNorm, silu*up, rotary (+ the KV write for
the C kernels). Prints microseconds per call and inductor's compile time, one thread; docs/engine.md
quotes a run.

    python bench/small_ops_compile.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from splitserve.platform.kernels.cpu_ops import cpu_ops
from splitserve.platform.models.layers import RotaryEmbedding, apply_rotary

H, INTER, NH, NKV, D = 576, 1536, 9, 3, 64  # SmolLM2-135M: hidden, intermediate, heads, KV heads, head dim
ROTARY = RotaryEmbedding(D, 2048, 100000.0, None)


def eager(x, res, w, gate_up, qkv, pos):
    res = res + x
    h = F.rms_norm(res, (H,), None, 1e-5) * w
    act = F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
    cos, sin = ROTARY.cos_sin(pos, torch.float32)
    qk = apply_rotary(qkv.view(qkv.shape[0], -1, D)[:, : NH + NKV], cos, sin)
    return res, h, act, qk


def fused(ops, x, res, w, gate_up, qkv, pos):
    h = ops.add_rms_norm(x, res, w, 1e-5)
    act = ops.silu_mul(gate_up)
    k_cache, v_cache = torch.zeros(4, 16, NKV, D), torch.zeros(4, 16, NKV, D)
    ops.rope_write_kv(
        qkv, pos, ROTARY.cos_cache, ROTARY.sin_cache, k_cache, v_cache, torch.arange(qkv.shape[0]), NH, NKV, D
    )
    return res, h, act, qkv


def per_call_us(fn, args, n: int = 2000) -> float:
    for _ in range(20):
        fn(*args)
    t = time.perf_counter()
    for _ in range(n):
        fn(*args)
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    torch.set_num_threads(1)
    ops = cpu_ops()
    assert ops is not None, "the C kernels could not be built here"
    for b in (1, 8):
        args = (
            torch.randn(b, H),
            torch.randn(b, H),
            torch.rand(H),
            torch.randn(b, 2 * INTER),
            torch.randn(b, (NH + 2 * NKV) * D),
            torch.arange(b) + 100,
        )
        t0 = time.perf_counter()
        compiled = torch.compile(eager, dynamic=False)
        compiled(*args)
        compile_s = time.perf_counter() - t0
        print(
            f"batch {b}: eager {per_call_us(eager, args):.1f} us, inductor {per_call_us(compiled, args):.1f} us "
            f"(compile {compile_s:.1f} s), C kernels {per_call_us(lambda *a: fused(ops, *a), args):.1f} us"
        )


if __name__ == "__main__":
    main()
