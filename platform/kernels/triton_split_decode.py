"""Split-context paged decode attention in Triton (flash-decoding): a partial pass and a reduce.

The single-pass decode kernel (triton_attention.py) runs one program per (sequence, kv head)
and walks the whole context in it. At batch 1 with 8 kv heads that is 8 programs on a GPU with
over a hundred SMs, so the long walk is latency-bound. Here the context of every sequence is cut
into NUM_SPLITS pieces and each piece is one program, (sequence, kv head, split):

1. Partial pass. Split s of a sequence with context length L covers key positions
   [s * n, min((s + 1) * n, L)), n = ceil(ceil(L / NUM_SPLITS) / BLOCK_N) * BLOCK_N, so every
   tile but the last of a split is full. Within a split the online softmax is the single-pass
   kernel's (same helper, same precision rules). The program stores its normalised output
   o_s = acc / l ([group, head_dim], fp32) and its log-sum-exp in base 2, lse_s = m + log2(l).
   A split with no keys (short contexts leave the last splits empty) stores lse = -inf, o = 0.
2. Reduce, one program per (sequence, query head): M = max_s lse_s, w_s = 2^(lse_s - M),
   out = sum_s w_s o_s / sum_s w_s, cast to q's dtype. A row whose splits are all empty (a
   padded graph row with no context) comes out as zeros, never NaN. With attention sinks
   (HAS_SINKS) the denominator also gets the head's sink once: + 2^(sink * log2 e - M).

The split count is a constexpr chosen once per batch shape by `choose_num_splits` (in
kernels/dispatch.py, which imports no triton, so the runner can use it anywhere), a pure
function of (batch, kv heads, SM count, the longest context the shape may hold): it depends on no
tensor value, so a CUDA graph captured for a batch-size bucket keeps one fixed count and stays
valid whatever the real context lengths are (vLLM fixes its split count under graphs for the same
reason). Rules: no split when the (sequence, kv head) programs already fill the SMs; else enough
splits for about two programs per SM, at most MAX_SPLITS, and none shorter than MIN_SPLIT_TOKENS
keys of the longest context, so short contexts are not cut into tiles of padding.

Partial buffers are fp32 [batch, heads, NUM_SPLITS, head_dim] and [batch, heads, NUM_SPLITS]:
16 splits of 32 heads of 128 dims are 256 KiB per sequence, read back once by the reduce.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.platform.kernels.dispatch import MAX_SPLITS, choose_num_splits  # noqa: F401 (re-exported)
from splitserve.platform.kernels.triton_attention import (
    LOG2E,
    MIN_DOT,
    _check,
    _pad,
    _paged_keys,
    _precision,
    paged_decode_attention,
)


@triton.jit
def _partial_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    po_ptr,
    plse_ptr,
    table_ptr,
    ctx_ptr,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_tb,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, D_PAD)
    row_ok = rows < GROUP
    row_dim_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=row_dim_mask, other=0.0)
    context_len = tl.load(ctx_ptr + seq).to(tl.int32)  # int32 or int64 lengths
    split_len = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    begin = split * split_len
    end = tl.minimum(begin + split_len, context_len)

    # begin is a multiple of BLOCK_N (split_len is), so the tiles are those of begin..end
    m, l, acc = _paged_keys(
        q,
        k_ptr,
        v_ptr,
        table_ptr + seq * stride_tb,
        kv_head,
        begin,
        end,
        dims,
        scale_log2,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        GROUP_PAD,
        HEAD_DIM,
        D_PAD,
        BLOCK_SIZE,
        BLOCK_N,
        PRECISION,
        UPCAST,
    )
    has_keys = l > 0
    acc = acc / tl.where(has_keys, l, 1.0)[:, None]
    lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l, 1.0)), float("-inf"))
    part = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # [GROUP_PAD]
    tl.store(po_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_dim_mask)
    tl.store(plse_ptr + part, lse, mask=row_ok)


@triton.jit
def _reduce_kernel(
    po_ptr,
    plse_ptr,
    out_ptr,
    sinks_ptr,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, S_PAD)
    dims = tl.arange(0, D_PAD)
    split_ok = splits < NUM_SPLITS
    part = (seq * NUM_HEADS + head) * NUM_SPLITS + splits
    lse = tl.load(plse_ptr + part, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(lse - top)  # empty split: 0
    o = tl.load(
        po_ptr + part[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(weights, 0)
    if HAS_SINKS:
        total += tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - top)
    out = tl.sum(weights[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM
    )


def split_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    *,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_decode_attention with each context cut into `num_splits` pieces (see the module doc).

    q [B, H, D], caches [num_blocks, block_size, Hkv, D], block_table [B, max_blocks] int,
    context_lens [B] int -> [B, H, D] in q's dtype. num_splits 1 runs the single-pass kernel.
    `sinks` [H]: attention sinks (module docstring).
    Launches no host synchronisation, so it can be captured in a CUDA graph.
    """
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_splits == 1:
        return paged_decode_attention(
            q, k_cache, v_cache, block_table, context_lens, scale, out=out, block_n=block_n, sinks=sinks
        )
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    _check(q, k_cache, v_cache, num_heads, num_kv_heads)
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        part_out,
        part_lse,
        block_table,
        context_lens,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        block_table.stride(0),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        NUM_HEADS=num_heads,
        NUM_SPLITS=num_splits,
        GROUP=group,
        GROUP_PAD=_pad(group),
        HEAD_DIM=head_dim,
        D_PAD=_pad(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N=max(block_n, MIN_DOT),
        **_precision(q),
    )
    _reduce_kernel[(num_seqs, num_heads)](
        part_out,
        part_lse,
        out,
        q if sinks is None else sinks,  # an unread pointer without sinks
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        NUM_SPLITS=num_splits,
        S_PAD=max(2, triton.next_power_of_2(num_splits)),
        HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        HAS_SINKS=sinks is not None,
    )
    return out
