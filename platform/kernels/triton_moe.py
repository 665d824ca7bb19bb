"""The experts of a mixture-of-experts MLP as two grouped GEMMs in Triton (models/moe.py on CUDA).

Input: the T x k (token, expert) pairs sorted by expert (stable), so expert e owns the rows
row_offsets[e] .. row_offsets[e + 1] of the sorted order, and row r reads the activations of
token token_of[r]. Each expert's rows are cut into tiles of BLOCK_M rows; tile_offsets[e] is the
first tile of expert e (an exclusive cumulative sum of ceil(count / BLOCK_M), an expert with no
row owning no tile). Both tables are built on the device with a few torch ops (a scatter_add
for the counts, two cumulative sums): no host sync, so a decode step stays capturable in a CUDA
graph, and no Python loop over experts.

Launch 1 (`_gate_up_kernel`), grid (tiles, I / BLOCK_N): a program finds its expert as the
number of experts whose tiles end at or before its tile id (one vector compare against
tile_offsets), gathers its rows of x through token_of (no index_select copy), multiplies them
by that expert's gate and up rows of the stacked [E, 2I, hidden] weight, and stores
silu(gate) * up, [rows, I], in the sorted order.

Launch 2 (`_down_kernel`), grid (tiles, hidden / BLOCK_N): the same tile -> expert lookup; the
rows of launch 1 times the expert's [hidden, I] down weight, scaled by the pair's routing weight,
stored at the pair's own index (order[r]) of a [T * k, hidden] buffer. The caller sums the k
pairs of each token (a [T, k, hidden] sum): no index_add, no atomics, deterministic.

The grid's first dimension is an upper bound on the tile count, min(ceil(M / BLOCK_M) + E, M)
for M = T * k rows, since the true count is only known on the device. A program past the last
tile (its expert id comes out as E) skips the K loop and stores nothing.

Rounding follows the torch loop: gate and up are rounded to the activation dtype before silu,
silu(gate) and the product are rounded, the down product is rounded and then its scaled value;
only the order of the K accumulation (float32) differs. float32 operands use IEEE dot products
(no TF32), as torch's matmul does by default. Under TRITON_INTERPRET the operands are upcast to
float32 for tl.dot and bfloat16 results are rounded to nearest even by hand (kernels/triton_ops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.platform.kernels.triton_attention import _dot
from splitserve.platform.kernels.triton_ops import _round, _rtne

MIN_DOT = 16  # tl.dot needs every tile dimension >= 16


@triton.jit
def _tile_expert(tile_off_ptr, NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr):
    """This program's (expert, tile index within the expert, is a real tile)."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    tile_end = tl.load(tile_off_ptr + 1 + experts, mask=experts < NUM_EXPERTS, other=2**30)
    expert = tl.sum((tile_end <= pid).to(tl.int32), 0)
    valid = expert < NUM_EXPERTS
    expert = tl.minimum(expert, NUM_EXPERTS - 1)
    return expert, pid - tl.load(tile_off_ptr + expert), valid


@triton.jit
def _gate_up_kernel(
    x_ptr,
    tok_ptr,
    w_ptr,
    h_ptr,
    row_off_ptr,
    tile_off_ptr,
    stride_x,
    stride_we,
    stride_wn,
    stride_h,
    K,
    INTER,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    RTNE: tl.constexpr,
):
    expert, tile, valid = _tile_expert(tile_off_ptr, NUM_EXPERTS, E_PAD)
    rows = tl.load(row_off_ptr + expert) + tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.where(valid, tl.load(row_off_ptr + expert + 1), 0)
    tokens = tl.load(tok_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    w = w_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.where(valid, K, 0)
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = col_ok[None, :] & k_ok[:, None]
        b_gate = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=b_mask, other=0.0)
        b_up = tl.load(w + (cols + INTER)[None, :] * stride_wn + ks[:, None], mask=b_mask, other=0.0)
        acc_gate += _dot(a, b_gate, PRECISION, UPCAST)
        acc_up += _dot(a, b_up, PRECISION, UPCAST)
    dtype = h_ptr.dtype.element_ty
    gate = _round(acc_gate, dtype, RTNE).to(tl.float32)
    up = _round(acc_up, dtype, RTNE).to(tl.float32)
    act = _round(gate / (1.0 + tl.exp(-gate)), dtype, RTNE).to(tl.float32)
    tl.store(
        h_ptr + rows[:, None].to(tl.int64) * stride_h + cols[None, :],
        _round(act * up, dtype, RTNE),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    dest_ptr,
    scale_ptr,
    row_off_ptr,
    tile_off_ptr,
    stride_h,
    stride_we,
    stride_wn,
    stride_o,
    K,
    N,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    RTNE: tl.constexpr,
):
    expert, tile, valid = _tile_expert(tile_off_ptr, NUM_EXPERTS, E_PAD)
    rows = tl.load(row_off_ptr + expert) + tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.where(valid, tl.load(row_off_ptr + expert + 1), 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.where(valid, K, 0)
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        b = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc += _dot(a, b, PRECISION, UPCAST)
    dtype = out_ptr.dtype.element_ty
    dest = tl.load(dest_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    scale = tl.load(scale_ptr + dest, mask=row_ok, other=0.0).to(tl.float32)
    y = _round(acc, dtype, RTNE).to(tl.float32)
    tl.store(
        out_ptr + dest[:, None] * stride_o + cols[None, :],
        _round(y * scale[:, None], dtype, RTNE),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def expert_offsets(flat_experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """flat expert ids [M] -> (row_offsets [E + 1], tile_offsets [E + 1]) int32, on the ids' device."""
    # scatter_add, not bincount: bincount sizes its output from the ids' max, a host sync on CUDA
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_experts.device)
    counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
    row_offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat_experts.device)
    tile_offsets = torch.zeros_like(row_offsets)
    torch.cumsum(counts, 0, out=row_offsets[1:])
    torch.cumsum((counts + block_m - 1) // block_m, 0, out=tile_offsets[1:])
    return row_offsets, tile_offsets


def block_m_for(num_rows: int, num_experts: int) -> int:
    """Rows per tile: the mean rows per expert as a power of two, between 16 and 64."""
    return min(64, max(MIN_DOT, triton.next_power_of_2(max(1, -(-num_rows // num_experts)))))


def moe_experts(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, **blocks
) -> torch.Tensor:
    """sum_j weights[t, j] * MLP_{experts[t, j]}(x[t]) for x [T, hidden]; weights, experts [T, k];
    gate_up [E, 2I, hidden] (gate rows then up rows), down [E, hidden, I]. Returns [T, hidden].
    `blocks`: block_n / block_k for grouped_experts (the tests use small ones to get several tiles)."""
    num_tokens, top_k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = (order // top_k).to(torch.int32)
    block_m = block_m_for(flat.numel(), gate_up.shape[0])
    row_offsets, tile_offsets = expert_offsets(flat, gate_up.shape[0], block_m)
    pairs = grouped_experts(
        x,
        token_of,
        order.to(torch.int32),
        weights.reshape(-1),
        row_offsets,
        tile_offsets,
        gate_up,
        down,
        block_m,
        **blocks,
    )
    return pairs.view(num_tokens, top_k, x.shape[1]).sum(dim=1)


def grouped_experts(
    x: torch.Tensor,
    token_of: torch.Tensor,
    dest: torch.Tensor,
    scale: torch.Tensor,
    row_offsets: torch.Tensor,
    tile_offsets: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    block_m: int,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """The two launches over M sorted rows: row r is token token_of[r] of x, its result lands, times
    scale[dest[r]], in row dest[r] of the returned [M, hidden] buffer (rows no r maps to are
    left unwritten: with dest a permutation, none)."""
    assert x.stride(-1) == 1 and gate_up.is_contiguous() and down.is_contiguous() and scale.is_contiguous()
    num_rows, (num_experts, two_inter, hidden) = token_of.numel(), gate_up.shape
    inter = two_inter // 2
    out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    h = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    grid_m = min(triton.cdiv(num_rows, block_m) + num_experts, num_rows)
    common = dict(
        NUM_EXPERTS=num_experts,
        E_PAD=triton.next_power_of_2(num_experts),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=bool(triton.knobs.runtime.interpret),
        RTNE=_rtne(x.dtype),
    )
    _gate_up_kernel[(grid_m, triton.cdiv(inter, block_n))](
        x,
        token_of,
        gate_up,
        h,
        row_offsets,
        tile_offsets,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        h.stride(0),
        hidden,
        inter,
        **common,
    )
    _down_kernel[(grid_m, triton.cdiv(hidden, block_n))](
        h,
        down,
        out,
        dest,
        scale,
        row_offsets,
        tile_offsets,
        h.stride(0),
        down.stride(0),
        down.stride(1),
        out.stride(0),
        inter,
        hidden,
        **common,
    )
    return out
