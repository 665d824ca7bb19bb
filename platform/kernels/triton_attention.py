"""Paged attention in Triton: decode (one query token per sequence) and ragged prefill.

Both kernels read K and V straight from the paged caches ([num_blocks, block_size, kv_heads,
head_dim]) through a block table: key position p of a sequence lives in cache block
table[p // block_size] at offset p % block_size. A tile of BLOCK_N key positions may span
several cache blocks, so each position looks up its own block id (the table row stays in
cache); the block size is any power of two, independent of the tile size.

Online softmax (flash attention): a program walks its key tiles once and keeps, per query row,
the running max m of the scores, the running sum l of exp(score - m) and the unnormalised
output acc. When a tile raises the max, l and acc are rescaled by exp(m_old - m_new). Scores, m,
l and acc are float32 whatever the cache dtype; each output row is written once, acc / l, in q's
dtype. Scores are kept in base 2 (scale premultiplied by log2 e) so each needs one exp2.
m starts at a finite -1e30, not -inf, so a row whose keys are all masked in a tile never
computes exp(-inf - -inf).

Decode: one program per (sequence, kv head). The query heads that share the kv head (the GQA
group) are the rows of one [group, head_dim] tile, so each K/V tile is loaded once per group
and the scores are one matrix product. The group is padded to 16 rows and head_dim to a power
of two >= 16 (the smallest tl.dot tile); padding is masked on load and never stored. Keys at
positions >= the sequence's context length are masked.

Prefill: one program per (chunk, tile of BLOCK_M queries, query head). Chunk s is rows
cu_q_lens[s] .. cu_q_lens[s + 1] of q, its query i at absolute position start_pos[s] + i; query
i attends to cache positions 0 .. start_pos[s] + i (the chunk's own K/V are already in the
cache), so a tile walks keys up to its last query's position and masks the diagonal causally.
The grid covers the longest chunk; tiles past a shorter chunk's end run no iterations and store
nothing.

Precision: fp32 inputs multiply in IEEE fp32, not TF32, so the fp32 path matches the torch
reference to ~1e-6 (unless torch's TF32 switch for matmuls is on: then TF32, as the GEMMs);
bf16/fp16 inputs use the tensor cores with fp32 accumulation and round the probabilities to
the V dtype before P @ V (as FlashAttention does). l sums the rounded probabilities, so the
weights that multiply V sum to exactly one: this halves the worst bf16 error measured against
an fp32 reference (6.6e-3 -> 4.2e-3). Under TRITON_INTERPRET the dot operands go through fp32,
because the interpreter multiplies bf16 storage bits (triton-lang/triton#11584); bf16 products
are exact in fp32, so this changes no result.

Sliding window (WINDOW > 0, a runtime argument; 0 = full attention): the query at position p
sees keys p - WINDOW < j <= p. Each program starts its key loop at the tile holding its first
visible key and masks the rest, so a windowed layer reads O(WINDOW) keys per query, not the
whole context.

Attention sinks (gpt-oss; HAS_SINKS, `sinks` [heads] logits): a sink joins the softmax's
denominator only, so after the key loop l += 2^(sink * log2 e - m) per row, once; the online
loop itself is unchanged. The split-context decode kernel adds it once in its reduce.

Callers guarantee: block-table entries for positions below the context length are valid block
ids (entries past it are never read), q/k_cache/v_cache have a contiguous last dimension.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MIN_DOT = 16  # tl.dot needs every tile dimension >= 16


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _online_softmax_step(
    q, k_ptrs, v_ptrs, kv_mask, score_mask, m, l, acc, scale_log2, PRECISION: tl.constexpr, UPCAST: tl.constexpr
):
    """One key tile: k_ptrs/v_ptrs [BLOCK_N, D_PAD]; returns the updated (m, l, acc)."""
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(k), PRECISION, UPCAST) * scale_log2
    s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    p = tl.exp2(s - m_new[:, None]).to(v.dtype)
    l = l * alpha + tl.sum(p.to(tl.float32), 1)
    acc = acc * alpha[:, None] + _dot(p, v, PRECISION, UPCAST)
    return m_new, l, acc


@triton.jit
def _paged_keys(
    q,
    k_ptr,
    v_ptr,
    table_row_ptr,
    kv_head,
    lo,
    hi,
    dims,
    scale_log2,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One sequence's keys at positions [lo, hi) of its paged cache (`table_row_ptr`: its block
    table row), in BLOCK_N tiles from the tile holding `lo`: the (m, l, acc) of the online softmax."""
    m = tl.full([GROUP_PAD], -1e30, tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = (pos < hi) & (pos >= lo)
        block = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k_rows = block * stride_kb + slot * stride_ks + kv_head * stride_kh
        v_rows = block * stride_vb + slot * stride_vs + kv_head * stride_vh
        kv_mask = pos_ok[:, None] & (dims < HEAD_DIM)[None, :]
        m, l, acc = _online_softmax_step(
            q,
            k_ptr + k_rows[:, None] + dims[None, :],
            v_ptr + v_rows[:, None] + dims[None, :],
            kv_mask,
            pos_ok[None, :],
            m,
            l,
            acc,
            scale_log2,
            PRECISION,
            UPCAST,
        )
    return m, l, acc


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    table_ptr,
    ctx_ptr,
    sinks_ptr,
    scale_log2,
    WINDOW,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_tb,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, D_PAD)
    row_dim_mask = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=row_dim_mask, other=0.0)
    context_len = tl.load(ctx_ptr + seq).to(tl.int32)  # int32 or int64 lengths
    kv_lo = tl.where(WINDOW > 0, tl.maximum(context_len - WINDOW, 0), 0)

    m, l, acc = _paged_keys(
        q,
        k_ptr,
        v_ptr,
        table_ptr + seq * stride_tb,
        kv_head,
        kv_lo,
        context_len,
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
    if HAS_SINKS:
        l += tl.exp2(tl.load(sinks_ptr + heads, mask=rows < GROUP, other=0.0).to(tl.float32) * 1.4426950408889634 - m)
    acc = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(
        out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_dim_mask,
    )


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_ptr,
    start_ptr,
    table_ptr,
    sinks_ptr,
    scale_log2,
    WINDOW,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_tb,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
):
    chunk = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_begin = tl.load(cu_ptr + chunk)
    q_len = tl.load(cu_ptr + chunk + 1) - q_begin
    start_pos = tl.load(start_ptr + chunk)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D_PAD)
    row_dim_mask = (rows < q_len)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + (q_begin + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=row_dim_mask, other=0.0
    )
    q_pos = start_pos + rows
    # keys 0 .. (position of this tile's last real query); none for a tile past the chunk
    kv_end = tl.where(tile * BLOCK_M < q_len, start_pos + tl.minimum(tile * BLOCK_M + BLOCK_M, q_len), 0)

    # with a window, keys from (this tile's first query's position - WINDOW + 1) on
    kv_lo = tl.where(WINDOW > 0, tl.maximum(start_pos + tile * BLOCK_M - WINDOW + 1, 0), 0)

    m = tl.full([BLOCK_M], -1e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for start in range((kv_lo // BLOCK_N) * BLOCK_N, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        block = tl.load(table_ptr + chunk * stride_tb + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k_rows = block * stride_kb + slot * stride_ks + kv_head * stride_kh
        v_rows = block * stride_vb + slot * stride_vs + kv_head * stride_vh
        kv_mask = pos_ok[:, None] & (dims < HEAD_DIM)[None, :]
        causal = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        causal = causal & ((WINDOW == 0) | (pos[None, :] > q_pos[:, None] - WINDOW))
        m, l, acc = _online_softmax_step(
            q,
            k_ptr + k_rows[:, None] + dims[None, :],
            v_ptr + v_rows[:, None] + dims[None, :],
            kv_mask,
            causal,
            m,
            l,
            acc,
            scale_log2,
            PRECISION,
            UPCAST,
        )
    if HAS_SINKS:
        l += tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - m)
    acc = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(
        out_ptr + (q_begin + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_dim_mask,
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D], caches [num_blocks, block_size, Hkv, D], block_table [B, max_blocks] int,
    context_lens [B] int -> [B, H, D] in q's dtype (written into `out` when given).

    Sequence b attends to its cache positions 0 .. context_lens[b] - 1, or only the last
    `window` of them when window > 0. `sinks` [H]: attention sinks (module docstring).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    _check(q, k_cache, v_cache, num_heads, num_kv_heads)
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    _decode_kernel[(num_seqs, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_table,
        context_lens,
        q if sinks is None else sinks,  # an unread pointer without sinks
        scale * LOG2E,
        window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        GROUP=group,
        GROUP_PAD=_pad(group),
        HEAD_DIM=head_dim,
        D_PAD=_pad(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N=max(block_n, MIN_DOT),
        **_precision(q),
        HAS_SINKS=sinks is not None,
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q_lens: torch.Tensor,
    start_pos: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_q_len: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] (S chunks back to back), cu_q_lens [S + 1] int, start_pos [S] int,
    block_tables [S, max_blocks] int -> [T, H, D] in q's dtype (written into `out` when given).

    Query i of chunk s attends causally to cache positions 0 .. start_pos[s] + i (only the
    last `window` of them when window > 0; `sinks` [H]: attention sinks). `max_q_len`
    (the longest chunk) sizes the grid; pass it to avoid a device-to-host sync.
    """
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    _check(q, k_cache, v_cache, num_heads, num_kv_heads)
    out = torch.empty_like(q) if out is None else out
    num_chunks = start_pos.shape[0]
    if max_q_len is None:
        max_q_len = int((cu_q_lens[1:] - cu_q_lens[:-1]).max()) if num_chunks else 0
    if num_chunks == 0 or max_q_len == 0:
        return out
    block_m, block_n = max(block_m, MIN_DOT), max(block_n, MIN_DOT)
    _prefill_kernel[(num_chunks, triton.cdiv(max_q_len, block_m), num_heads)](
        q,
        k_cache,
        v_cache,
        out,
        cu_q_lens,
        start_pos,
        block_tables,
        q if sinks is None else sinks,
        scale * LOG2E,
        window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        D_PAD=_pad(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        **_precision(q),
        HAS_SINKS=sinks is not None,
    )
    return out


def _check(q, k_cache, v_cache, num_heads: int, num_kv_heads: int) -> None:
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads for {num_kv_heads} kv heads"
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "last dimension must be contiguous"
    assert k_cache.shape == v_cache.shape and k_cache.shape[-1] == q.shape[-1]


def _pad(n: int) -> int:
    return max(MIN_DOT, 1 << math.ceil(math.log2(n)))


def _precision(q: torch.Tensor) -> dict:
    """fp32 multiplies in IEEE fp32 unless torch's own TF32 switch for matmuls is on
    (`torch.backends.cuda.matmul.allow_tf32`, or `torch.set_float32_matmul_precision("high")`):
    then attention follows the GEMMs onto the tensor cores, ~8x faster at 10-bit mantissas."""
    exact = q.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    return dict(PRECISION="ieee" if exact else "tf32", UPCAST=bool(triton.knobs.runtime.interpret))
