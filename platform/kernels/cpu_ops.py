"""The fused CPU kernels (cpu_ops.c) as torch-facing functions; see that file for the math.

`fused_cpu_ops(device, dtype)` returns a CpuOps when they apply (a CPU, float32 activations, the
library built) and None otherwise; the model then runs its torch path. Every function takes and
returns contiguous float32 CPU tensors; ids, positions and slots are int64; the KV cache is
float32 or float16 (KV_DTYPES). The C side trusts
its pointers and these run hundreds of times per step (a per-call check cost 1.3 ms of a 10 ms
step), so the callers guarantee that layout by construction (llama.py, quant/kernels.py) and
tests/platform/test_cpu_ops.py pins every op against its torch definition. Threads:
torch's intra-op count, so a worker's `--threads` governs these kernels too.
"""

from __future__ import annotations

import ctypes

import torch

from splitserve.platform.kernels import cpu_build


def fused_cpu_ops(device: torch.device, dtype: torch.dtype) -> CpuOps | None:
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    return cpu_ops()


def cpu_ops() -> CpuOps | None:
    """The kernels of this host, whatever the model's dtype (None: not built here)."""
    lib = cpu_build.load()
    return None if lib is None else CpuOps(lib)


_p = torch.Tensor.data_ptr  # a tensor's address, without a Python frame per call
KV_DTYPES = (torch.float32, torch.float16)  # the KV cache types the kernels read and write


LORA_SHARDS = 3  # SS_LORA_SHARDS: q|k|v


class LoraEntry(ctypes.Structure):
    """One adapter's part of one linear for ss_lora_delta (lora.adapter.LoraLinear): A_T
    [k, width] and per shard B_s^T [rank, size] added at output column `start` (float32,
    contiguous; a NULL `a`: the adapter leaves this linear alone)."""

    _fields_ = [
        ("a", ctypes.c_void_p),
        ("width", ctypes.c_int64),
        ("rank", ctypes.c_int64),
        ("shards", ctypes.c_int64),
        ("b", ctypes.c_void_p * LORA_SHARDS),
        ("start", ctypes.c_int64 * LORA_SHARDS),
        ("size", ctypes.c_int64 * LORA_SHARDS),
    ]

    @classmethod
    def of(cls, linear) -> LoraEntry:
        blocks = linear.blocks
        assert len(blocks) <= LORA_SHARDS and linear.a_t.dtype == torch.float32
        n = len(blocks)
        pad = (0,) * (LORA_SHARDS - n)
        return cls(
            linear.a_t.data_ptr(),
            linear.a_t.shape[1],
            linear.rank,
            n,
            (ctypes.c_void_p * LORA_SHARDS)(*(b.data_ptr() for _, b in blocks), *pad),
            (ctypes.c_int64 * LORA_SHARDS)(*(start for start, _ in blocks), *pad),
            (ctypes.c_int64 * LORA_SHARDS)(*(b.shape[1] for _, b in blocks), *pad),
        )


class CpuOps:
    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        self.lib.ss_rms_norm(_p(x), _p(weight), _p(out), x.shape[0], x.shape[1], eps, torch.get_num_threads())
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place); returns rms_norm(residual) * weight."""
        out = torch.empty_like(x)
        self.lib.ss_add_rms_norm(
            _p(x), _p(residual), _p(weight), _p(out), x.shape[0], x.shape[1], eps, torch.get_num_threads()
        )
        return out

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        """Rotate the q and k heads of each fused qkv row in place; store k and v in their cache slots
        (rounded to nearest even in a float16 cache)."""
        self.lib.ss_rope_write_kv(
            _p(qkv),
            _p(positions),
            _p(cos),
            _p(sin),
            _p(k_cache),
            _p(v_cache),
            _p(slots),
            qkv.shape[0],
            num_heads,
            num_kv_heads,
            head_dim,
            k_cache.dtype == torch.float16,
            torch.get_num_threads(),
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q [B, H, D] (one token per sequence) -> [B, H, D], K/V read in place through the block table."""
        b, h, d = q.shape
        out = torch.empty_like(q)
        self.lib.ss_decode_attention(
            _p(q),
            _p(k_cache),
            _p(v_cache),
            _p(block_table),
            _p(context_lens),
            _p(out),
            b,
            h,
            k_cache.shape[2],
            d,
            k_cache.shape[1],
            block_table.shape[1],
            scale,
            k_cache.dtype == torch.float16,
            torch.get_num_threads(),
        )
        return out

    def to_half(self, x: torch.Tensor) -> torch.Tensor:
        """float32 -> float16, round to nearest even (the KV store's conversion; torch's .half() too)."""
        out = torch.empty(x.shape, dtype=torch.float16)
        self.lib.ss_store_half(_p(x), _p(out), x.numel())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] fused gate|up -> silu(gate) * up [T, I]."""
        t, two_i = gate_up.shape
        out = gate_up.new_empty(t, two_i // 2)
        self.lib.ss_silu_mul(_p(gate_up), _p(out), t, two_i // 2, torch.get_num_threads())
        return out

    def q4_linear(self, x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> [M, N]: 4-bit weights (qs [N, K/2] uint8 in GGUF's nibble order, d and
        mn [N, K/32] float32: w = d * q + mn) widened in registers, float32 math (cpu_ops.c)."""
        m, k = x.shape
        y = x.new_empty(m, qs.shape[0])
        self.lib.ss_q4_linear(_p(x), m, k, _p(qs), _p(d), _p(mn), qs.shape[0], _p(y), torch.get_num_threads())
        return y

    def gemm_fixed(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ w [K, N] with each output one fixed-order chain over k (batch-invariant bits);
        added into `out` [M, N] when given (cpu_ops.c)."""
        m, k = x.shape
        y = x.new_empty(m, w.shape[1]) if out is None else out
        self.lib.ss_gemm_fixed(_p(x), m, k, _p(w), w.shape[1], _p(y), out is not None, torch.get_num_threads())
        return y

    def lora_delta(self, x: torch.Tensor, entries, row_group: torch.Tensor, y: torch.Tensor) -> None:
        """y [M, N] += each adapter's delta on its own rows: `entries` a LoraEntry array, one per
        adapter group, `row_group` [M] int64 each row's group (-1: none). See cpu_ops.c."""
        rc = self.lib.ss_lora_delta(
            _p(x),
            x.shape[0],
            x.shape[1],
            ctypes.addressof(entries),
            len(entries),
            _p(row_group),
            y.shape[1],
            _p(y),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("ss_lora_delta could not allocate its scratch buffers")

    def q4_dequant(self, qs: torch.Tensor, d: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
        """The float32 weight [N, K] of the same layout (for a GEMM over many rows)."""
        n, k = qs.shape[0], qs.shape[1] * 2
        w = torch.empty(n, k)
        self.lib.ss_q4_dequant(_p(qs), _p(d), _p(mn), n, k, _p(w), torch.get_num_threads())
        return w

    # ---- int8 activations (cpu_a8.c) ----------------------------------------------------------------
    @property
    def a8_path(self) -> str:
        """Which code path cpu_a8.c takes here for many rows: avx512-amx (where the tiles are
        granted, after the first such step), avx512-vnni, avx2 or portable."""
        return self.lib.ss_a8_path().decode()

    def set_amx(self, enable: bool) -> bool:
        """Allow (and ask Linux for) the AMX tiles for steps of many rows, or not; True when in use.
        Either way the results are the same bits (cpu_a8.c)."""
        return bool(self.lib.ss_a8_set_amx(int(enable)))

    def quantize_a8(self, x: torch.Tensor, digits: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [M, K] float32 -> (codes [M, digits * K] int8, unit of the last digit [M, K/32], exact
        input sums [M, K/32]); digits 2 adds an int8 digit for the remainder (16-bit precision)."""
        m, k = x.shape
        q = torch.empty(m, digits * k, dtype=torch.int8)
        dx, xs = x.new_empty(m, k // 32), x.new_empty(m, k // 32)
        self.lib.ss_quantize_a8(_p(x), m, k, digits, _p(q), _p(dx), _p(xs), torch.get_num_threads())
        return q, dx, xs

    def q4a8_linear(
        self, a8: tuple[torch.Tensor, torch.Tensor, torch.Tensor], w: torch.Tensor, d: torch.Tensor, mn: torch.Tensor
    ) -> torch.Tensor:
        """quantize_a8(x) against 4-bit weights packed in 16-row tiles (quant/a8.py) -> [M, N] float32."""
        q, dx, xs = a8
        m, k = q.shape[0], xs.shape[1] * 32
        n = d.shape[0] * 16
        y = torch.empty(m, n)
        self.lib.ss_q4a8_linear(
            _p(q), _p(dx), _p(xs), m, k, q.shape[1] // k, _p(w), _p(d), _p(mn), n, _p(y), torch.get_num_threads()
        )
        return y

    def q8a8_linear(
        self, a8: tuple[torch.Tensor, torch.Tensor, torch.Tensor], w: torch.Tensor, d: torch.Tensor
    ) -> torch.Tensor:
        """quantize_a8(x) against int8 weights packed in 16-row tiles (quant/a8.py) -> [M, N] float32."""
        q, dx, xs = a8
        m, k = q.shape[0], xs.shape[1] * 32
        n = d.shape[0] * 16
        y = torch.empty(m, n)
        self.lib.ss_q8a8_linear(_p(q), _p(dx), m, k, q.shape[1] // k, _p(w), _p(d), n, _p(y), torch.get_num_threads())
        return y
