"""The fused CPU kernels (cpu_ops.c) as torch-facing functions; see that file for the math.

`fused_cpu_ops(device, dtype)` returns a CpuOps when they apply (a CPU, float32 activations, the
library built) and None otherwise; the model then runs its torch path. Every function takes and
returns contiguous float32 CPU tensors; ids, positions and slots are int64. Threads: torch's
intra-op count, so a worker's `--threads` governs these kernels too.
"""

from __future__ import annotations

import ctypes

import torch

from splitserve.platform.kernels import cpu_build


def fused_cpu_ops(device: torch.device, dtype: torch.dtype) -> "CpuOps | None":
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    lib = cpu_build.load()
    return None if lib is None else CpuOps(lib)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class CpuOps:
    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    @staticmethod
    def _check(*tensors: torch.Tensor) -> None:
        for t in tensors:
            assert t.is_contiguous() and t.device.type == "cpu", (t.shape, t.stride(), t.device)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self._check(x, weight)
        out = torch.empty_like(x)
        self.lib.ss_rms_norm(_ptr(x), _ptr(weight), _ptr(out), x.shape[0], x.shape[1], eps, torch.get_num_threads())
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place); returns rms_norm(residual) * weight."""
        self._check(x, residual, weight)
        out = torch.empty_like(x)
        self.lib.ss_add_rms_norm(_ptr(x), _ptr(residual), _ptr(weight), _ptr(out), x.shape[0], x.shape[1], eps,
                                 torch.get_num_threads())
        return out

    def rope_write_kv(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                      num_kv_heads: int, head_dim: int) -> None:
        """Rotate the q and k heads of each fused qkv row in place; store k and v in their cache slots."""
        self._check(qkv, positions, cos, sin, k_cache, v_cache, slots)
        assert k_cache.dtype == v_cache.dtype == torch.float32 and positions.dtype == slots.dtype == torch.int64
        self.lib.ss_rope_write_kv(_ptr(qkv), _ptr(positions), _ptr(cos), _ptr(sin), _ptr(k_cache), _ptr(v_cache),
                                  _ptr(slots), qkv.shape[0], num_heads, num_kv_heads, head_dim,
                                  torch.get_num_threads())

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_table: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, H, D] (one token per sequence) -> [B, H, D], K/V read in place through the block table."""
        self._check(q, k_cache, v_cache, block_table, context_lens)
        assert block_table.dtype == context_lens.dtype == torch.int64
        b, h, d = q.shape
        out = torch.empty_like(q)
        self.lib.ss_decode_attention(_ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(block_table), _ptr(context_lens),
                                     _ptr(out), b, h, k_cache.shape[2], d, k_cache.shape[1], block_table.shape[1],
                                     scale, torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] fused gate|up -> silu(gate) * up [T, I]."""
        self._check(gate_up)
        t, two_i = gate_up.shape
        out = gate_up.new_empty(t, two_i // 2)
        self.lib.ss_silu_mul(_ptr(gate_up), _ptr(out), t, two_i // 2, torch.get_num_threads())
        return out
