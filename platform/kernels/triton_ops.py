"""The small per-layer ops of the decoder in Triton, one kernel each, and `TritonOps`, which serves
them to the model through the same interface as the fused CPU kernels (kernels/cpu_ops.py).

Per decoder layer the torch path launches about twenty elementwise kernels besides its four
GEMMs (norm casts, residual adds, rotary built from neg/cat, casts, index_copy_ for K and V).
With these, a decode layer is: qkv GEMM, rope_write_kv, attention (one kernel, or two when the
context is split), o GEMM, add_rms_norm, gate_up GEMM, silu_mul, down GEMM, add_rms_norm: nine
or ten kernels.

- `add_rms_norm(x, residual, weight, eps)`: residual <- x + residual (rounded to the activation
  dtype, as the torch residual add is), then weight * rms_norm(residual), the norm in float32
  and its result rounded to the activation dtype before the weight multiplies it, as
  layers.RMSNorm does. One program per row. `rms_norm` is the same without the add.
- `rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, ...)`: one program per
  (token, head) of the fused qkv rows: q and k heads are rotated in place (rotate-half layout;
  cos/sin are the float32 tables of layers.RotaryEmbedding, the product taken in float32 and
  rounded once); k and v heads are stored into their cache slots. A negative slot (a padded
  CUDA-graph row) writes nothing to the cache.
- `silu_mul(gate_up)`: silu(gate) * up over the fused [T, 2I] projection, in float32, rounded once.

Under TRITON_INTERPRET a float32 -> bfloat16 conversion truncates, where a GPU rounds to nearest
even; the kernels then round to nearest even by hand first (`_round`, RTNE), so the interpreter
tests see the GPU's results. Rounding once instead of after every torch op means a bf16 result can
differ from the torch path in the last bit; the tests bound it (fp32 agrees to ~1e-6).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, dtype: tl.constexpr, RTNE: tl.constexpr):
    """float32 x in `dtype`; RTNE: round to nearest even by hand (the interpreter truncates)."""
    if RTNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
    RTNE: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:
        x = x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        x = _round(x, res_ptr.dtype.element_ty, RTNE)
        tl.store(res_ptr + row * stride_r + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    normed = _round(xf * rstd, out_ptr.dtype.element_ty, RTNE).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, _round(w * normed, out_ptr.dtype.element_ty, RTNE), mask=ok)


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    k_ptr,
    v_ptr,
    slot_ptr,
    stride_t,
    stride_c,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    RTNE: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HALF_PAD)
    ok = dims < HALF
    row = qkv_ptr + token * stride_t + head * HEAD_DIM
    x1 = tl.load(row + dims, mask=ok, other=0.0)
    x2 = tl.load(row + HALF + dims, mask=ok, other=0.0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    if head < NUM_HEADS + NUM_KV_HEADS:  # q or k: rotate in place
        pos = tl.load(pos_ptr + token).to(tl.int64)
        c = tl.load(cos_ptr + pos * stride_c + dims, mask=ok, other=0.0)
        s = tl.load(sin_ptr + pos * stride_c + dims, mask=ok, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        y1 = _round(a * c - b * s, qkv_ptr.dtype.element_ty, RTNE)
        y2 = _round(b * c + a * s, qkv_ptr.dtype.element_ty, RTNE)
        tl.store(row + dims, y1, mask=ok)
        tl.store(row + HALF + dims, y2, mask=ok)
        if head >= NUM_HEADS and slot >= 0:
            dst = k_ptr + block * stride_kb + offset * stride_ks + (head - NUM_HEADS) * stride_kh
            tl.store(dst + dims, y1.to(k_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + HALF + dims, y2.to(k_ptr.dtype.element_ty), mask=ok)
    elif slot >= 0:  # v: copy into the cache
        dst = v_ptr + block * stride_vb + offset * stride_vs + (head - NUM_HEADS - NUM_KV_HEADS) * stride_vh
        tl.store(dst + dims, x1.to(v_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF + dims, x2.to(v_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_g, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr, RTNE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    gate = tl.load(gu_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_g + INTER + cols, mask=ok, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, _round(out, out_ptr.dtype.element_ty, RTNE), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, in its dtype); returns weight * rms_norm(residual). x, residual [T, hidden]."""
    return _norm(x, residual, weight, eps, add=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_norm(x) for x [T, hidden], as layers.RMSNorm computes it."""
    return _norm(x, x, weight, eps, add=False)


def _norm(x, residual, weight, eps: float, add: bool) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(-1) == residual.stride(-1) == 1 and x.shape == residual.shape
    out = torch.empty_like(x)
    if x.shape[0]:
        hidden = x.shape[1]
        _add_rms_norm_kernel[(x.shape[0],)](
            x,
            residual,
            weight,
            out,
            x.stride(0),
            residual.stride(0),
            out.stride(0),
            eps,
            HIDDEN=hidden,
            BLOCK=triton.next_power_of_2(hidden),
            ADD=add,
            RTNE=_rtne(x.dtype),
        )
    return out


def rope_write_kv(
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
    """qkv [T, (H + 2 Hkv) * D] fused rows: rotate q and k heads in place, store k and v at `slots`
    (negative: not stored). cos/sin [max_position, D] float32, positions/slots [T] int."""
    assert qkv.stride(-1) == 1 and head_dim % 2 == 0 and cos.stride() == sin.stride()
    num_tokens = qkv.shape[0]
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rope_write_kv_kernel[(num_tokens, num_heads + 2 * num_kv_heads)](
        qkv,
        positions,
        cos,
        sin,
        k_cache,
        v_cache,
        slots,
        qkv.stride(0),
        cos.stride(0),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        BLOCK_SIZE=k_cache.shape[1],
        RTNE=_rtne(qkv.dtype),
    )


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """[T, 2I] fused gate|up -> silu(gate) * up [T, I]."""
    num_tokens, two_i = gate_up.shape
    inter = two_i // 2
    out = gate_up.new_empty(num_tokens, inter)
    if num_tokens:
        block = min(block, triton.next_power_of_2(inter))
        _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), INTER=inter, BLOCK=block, RTNE=_rtne(out.dtype)
        )
    return out


def _rtne(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)


class TritonOps:
    """The model's fused-op interface (LlamaForCausalLM.use_fused_ops) on CUDA: these kernels plus
    the Triton paged attention, which reads K/V that rope_write_kv already stored."""

    attends_paged = True  # paged_attention_fused hands the whole step to paged_attention below

    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    rope_write_kv = staticmethod(rope_write_kv)
    silu_mul = staticmethod(silu_mul)

    @staticmethod
    def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float):
        from splitserve.platform.models.attention import _paged_attention_triton

        return _paged_attention_triton(q, k_cache, v_cache, meta, scale)
