"""Paged attention, torch reference path (CPU and any device).

Per step the runner lays out the batch as: all decode tokens first (one token per sequence),
then each prefill chunk. Per layer:

1. the new tokens' K and V are written into their cache slots (`slot_mapping`, one flat
   index block_id * block_size + offset per token);
2. decodes attend in one batched call: each sequence's blocks are gathered through its block
   table into [batch, max_blocks * block_size] keys, positions past its context are masked;
   queries are grouped per KV head ([batch, kv_heads, group, dim]), which is GQA without
   repeating K/V;
3. each prefill chunk attends to its cached prefix plus itself, causally; a chunk with no
   prefix attends to its own fresh K/V directly without touching the cache.

Sliding-window layers (`window` W) let the query at position p see keys p - W < j <= p: the
decode mask and each chunk's mask get that lower bound too (built once per step and window,
kept in the metadata for the step's other layers); the Triton kernels take W directly. A model
that mixes layer types keeps one KV group per type (platform/kv/groups.py): the model hands each
layer its group's metadata (`AttentionMetadata.for_layer`), whose block tables have holes
(NULL_BLOCK_ID) where a sliding group released blocks its window left behind; every path here
masks (torch) or skips (Triton) those positions, so a hole is never attended to.

Attention sinks (gpt-oss, `sinks`: a logit per query head in the softmax's denominator): the
torch path runs models/sink_attention.py for decodes and prefill chunks alike; the Triton
kernels add the sink to their softmax denominators (interpreter-tested, no GPU run yet).

Scores and softmax run in float32 whatever the KV dtype. With a narrower KV cache (float16 K/V
beside float32 activations) every attention reads K/V as the cache holds them: a prefill chunk
rounds its own fresh K/V the same way, so a prompt gives the same numbers whether it is computed
in one chunk, in several, or after a prefix-cache hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from splitserve.platform.kernels.dispatch import triton_available
from splitserve.platform.models.sink_attention import causal_mask, sink_attention


@dataclass
class PrefillChunk:
    """One prefill slice: tokens [q_start, q_start + q_len) of the flattened batch."""

    q_start: int
    q_len: int
    start_pos: int  # tokens of this sequence already in the cache
    block_table: torch.Tensor | None  # [num_blocks] when start_pos > 0
    mask: torch.Tensor | None  # [q_len, start_pos + q_len] bool, when start_pos > 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long
    num_decodes: int  # tokens [0, num_decodes) are decodes
    decode_block_table: torch.Tensor | None  # [num_decodes, max_blocks] long
    decode_mask: torch.Tensor | None  # [num_decodes, max_blocks * block_size] bool, True = attend
    prefills: list[PrefillChunk]
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] long, for the fused CPU kernel
    # Every token of the step as one query row for the fused CPU kernel (its sequence's block
    # table, its context length); None until the first fused layer with a prefill derives it.
    rows: tuple[torch.Tensor, torch.Tensor] | None = None
    # The Triton kernels' view of the same step; None until the first CUDA layer derives it
    # (build_triton_metadata), after which every other layer of the step reuses it.
    triton: TritonAttentionMetadata | None = None
    # window -> (decode mask, per-chunk masks) of sliding-window layers, built on first use.
    windowed: dict[int, tuple[torch.Tensor | None, list[torch.Tensor | None]]] = field(default_factory=dict)
    # Context splits of the Triton decode kernel (kernels/triton_split_decode.py), fixed by the
    # runner per batch shape; 1 is the single-pass kernel. The torch paths ignore it.
    decode_num_splits: int = 1
    # A model with several KV groups: per decoder layer, the metadata of its group (group 0's is
    # this one). None: one group, every layer reads this metadata.
    layer_metas: tuple[AttentionMetadata, ...] | None = None

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata decoder layer `layer` attends with."""
        return self if self.layer_metas is None else self.layer_metas[layer]


@dataclass
class TritonAttentionMetadata:
    """AttentionMetadata laid out for the Triton kernels; prefill rows count from num_decodes."""

    decode_context_lens: torch.Tensor | None  # [num_decodes] int32
    cu_q_lens: torch.Tensor | None  # [S + 1] int32, chunk s is prefill rows cu[s] .. cu[s + 1]
    start_pos: torch.Tensor | None  # [S] int32
    prefill_block_tables: torch.Tensor | None  # [S, max_blocks] long, zero-padded
    max_q_len: int  # the longest chunk, to size the grid without a sync


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V ([T, kv_heads, dim]) into the paged caches ([blocks, block_size, kv_heads, dim])."""
    if slot_mapping.numel() and not slot_mapping.is_cuda and int(slot_mapping[-1]) < 0:
        real = int((slot_mapping >= 0).sum())  # graph padding (slot -1) sits at the end
        k, v, slot_mapping = k[:real], v[:real], slot_mapping[:real]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_blocks * block_size, kv_heads, dim]."""
    flat = cache.index_select(0, block_table.reshape(-1))
    return flat.view(*block_table.shape[:-1], -1, *cache.shape[2:])


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor
) -> torch.Tensor:
    """q [B, H, D], k/v [B, Lk, Hkv, D], mask [B, Lk] -> [B, H, D].

    GQA by grouping query heads per KV head ([B, Hkv, group, D]); on CPU this beats SDPA with
    enable_gqa for single-token queries (measured 350 vs 530 us at B=16, Lk=256).
    """
    b, h, d = q.shape
    hkv = k.shape[2]
    qg = q.view(b, hkv, h // hkv, d).float()
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1).float()) * scale  # [B, Hkv, G, Lk]
    scores = scores.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3).float())  # [B, Hkv, G, D]
    return out.view(b, h, d).to(q.dtype)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """q [Lq, H, D], k/v [Lk, Hkv, D] -> [Lq, H, D]; causal (mask None, Lk == Lq) or masked.

    SDPA's fused kernel keeps memory linear in the prompt length (no Lq x Lk score matrix).
    """
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] for this step's tokens -> attention output [T, H, D].

    `window`: a sliding-window layer's W (None: full attention). `sinks` [H]: attention sinks.
    On CUDA with triton installed the Triton kernels run; everywhere else the torch reference.
    """
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    if q.is_cuda and triton_available(q.device):
        return _paged_attention_triton(q, k_cache, v_cache, meta, scale, window, sinks)
    decode_mask, chunk_masks = meta.decode_mask, [c.mask for c in meta.prefills]
    if window is not None:
        if window not in meta.windowed:
            meta.windowed[window] = window_masks(meta, window)
        decode_mask, chunk_masks = meta.windowed[window]
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        keys = gather_kv(k_cache, meta.decode_block_table)
        values = gather_kv(v_cache, meta.decode_block_table)
        if sinks is None:
            out[:nd] = decode_attention(q[:nd], keys, values, scale, decode_mask)
        else:
            out[:nd] = sink_attention(q[:nd, None], keys, values, scale, decode_mask[:, None], sinks)[:, 0]
    _prefill_chunks(q, k, v, k_cache, v_cache, meta, scale, out, chunk_masks, sinks)
    return out


def _sink_prefill(q, k, v, scale, mask, sinks):
    """prefill_attention with attention sinks."""
    if mask is None:
        mask = causal_mask(q.shape[0], k.shape[0], q.device)
    return sink_attention(q[None], k[None], v[None], scale, mask[None], sinks)[0]


def window_masks(meta: AttentionMetadata, window: int) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """The step's decode mask and chunk masks restricted to the last `window` positions of each
    query (key j visible from position p iff p - window < j <= p). A chunk whose queries all see
    their whole causal past keeps mask None (SDPA's causal path)."""
    decode_mask = None
    if meta.num_decodes:
        ctx = meta.decode_mask.sum(-1)
        keys = torch.arange(meta.decode_mask.shape[1], device=ctx.device)
        decode_mask = meta.decode_mask & (keys[None, :] >= (ctx - window)[:, None])
    chunk_masks = []
    for c in meta.prefills:
        if c.start_pos + c.q_len <= window:
            chunk_masks.append(c.mask)
            continue
        device = meta.slot_mapping.device
        pos = torch.arange(c.start_pos, c.start_pos + c.q_len, device=device)[:, None]
        keys = torch.arange(c.start_pos + c.q_len if c.block_table is not None else c.q_len, device=device)[None, :]
        if c.block_table is None:
            keys = keys + c.start_pos
        chunk_masks.append((keys <= pos) & (keys > pos - window))
    return decode_mask, chunk_masks


def as_cached(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x as the cache would give it back: rounded to the cache's dtype, in x's dtype."""
    return x if cache.dtype == x.dtype else x.to(cache.dtype).to(x.dtype)


def _prefill_chunks(
    q,
    k,
    v,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    masks: list[torch.Tensor | None],
    sinks: torch.Tensor | None = None,
) -> None:
    """Each prefill chunk attends to its cached prefix plus itself (or, without a prefix, to its
    own fresh K/V, rounded as the cache holds them); results go into their rows of `out`.
    `masks`: each chunk's mask (None: plain causal); `sinks`: attention sinks, if any."""

    def attend(q, k, v, scale, mask):
        return prefill_attention(q, k, v, scale, mask) if sinks is None else _sink_prefill(q, k, v, scale, mask, sinks)

    for chunk, mask in zip(meta.prefills, masks, strict=True):
        sl = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        if chunk.block_table is None:
            out[sl] = attend(q[sl], as_cached(k[sl], k_cache), as_cached(v[sl], v_cache), scale, mask)
            continue
        ctx = chunk.start_pos + chunk.q_len
        keys = gather_kv(k_cache, chunk.block_table)[:ctx].to(q.dtype)
        values = gather_kv(v_cache, chunk.block_table)[:ctx].to(q.dtype)
        out[sl] = attend(q[sl], keys, values, scale, mask)


def paged_attention_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    ops,
) -> torch.Tensor:
    """paged_attention with K/V already written (CpuOps.rope_write_kv): every token, decode or
    prefill, is one query row of the fused CPU kernel, which reads the paged cache in place with
    a reduction order fixed per row. A prompt token's attention therefore has the same bits
    whether its prompt is computed in one chunk or several, after a prefix-cache hit, or beside
    any batch-mates (SDPA's blocking would differ with the chunk's shape; with a float16 cache an
    ulp of difference upstream can round a K element differently, and greedy ties then flip)."""
    if getattr(ops, "attends_paged", False):  # kernels/triton_ops.TritonOps on CUDA
        return ops.paged_attention(q, k_cache, v_cache, meta, scale)
    if meta.prefills:
        if meta.rows is None:
            meta.rows = query_rows(meta, k_cache.shape[1])
        table, lens = meta.rows
    else:
        table, lens = meta.decode_block_table, meta.decode_context_lens
    return ops.decode_attention(q.contiguous(), k_cache, v_cache, table, lens, scale)


def query_rows(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, max_blocks] block table and [T] context lengths, one row per token of the step: a decode
    row as the decode tables have it, prefill token i of a chunk with its sequence's table and
    start_pos + i + 1 (causal). A chunk without a prefix has no block table; its block ids are
    read off its slot mapping (every block_size-th slot, as build_triton_metadata does)."""
    tables, lens = [], []
    if meta.num_decodes:
        tables += list(meta.decode_block_table)
        lens.append(meta.decode_context_lens)
    for c in meta.prefills:
        table = (
            c.block_table
            if c.block_table is not None
            else meta.slot_mapping[c.q_start : c.q_start + c.q_len : block_size] // block_size
        )
        tables += [table] * c.q_len
        lens.append(torch.arange(c.start_pos + 1, c.start_pos + c.q_len + 1, device=table.device))
    return torch.nn.utils.rnn.pad_sequence(tables, batch_first=True), torch.cat(lens)


def _paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton path of paged_attention, K/V already written; fills meta.triton on first use."""
    from splitserve.platform.kernels.triton_attention import paged_decode_attention, paged_prefill_attention
    from splitserve.platform.kernels.triton_split_decode import split_decode_attention

    if meta.triton is None:
        meta.triton = build_triton_metadata(meta, k_cache.shape[1])
    tm = meta.triton
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        if window:  # sliding-window layers: the single-pass kernel, which masks by window
            paged_decode_attention(
                q[:nd],
                k_cache,
                v_cache,
                meta.decode_block_table,
                tm.decode_context_lens,
                scale,
                out=out[:nd],
                window=window,
                sinks=sinks,
            )
        else:
            split_decode_attention(
                q[:nd],
                k_cache,
                v_cache,
                meta.decode_block_table,
                tm.decode_context_lens,
                scale,
                meta.decode_num_splits,
                out=out[:nd],
                sinks=sinks,
            )
    if meta.prefills:
        paged_prefill_attention(
            q[nd:],
            k_cache,
            v_cache,
            tm.cu_q_lens,
            tm.start_pos,
            tm.prefill_block_tables,
            scale,
            max_q_len=tm.max_q_len,
            out=out[nd:],
            window=window or 0,
            sinks=sinks,
        )
    return out


def build_triton_metadata(meta: AttentionMetadata, block_size: int) -> TritonAttentionMetadata:
    """Derive the kernels' metadata from the torch path's: context lengths from the decode mask
    (a prefix of True), one padded block table for all prefill chunks. A chunk without a prefix
    has no block table; its block ids are read off its slot mapping (position p's slot is
    block_ids[p // block_size] * block_size + p % block_size, so every block_size-th slot)."""
    context_lens = meta.decode_mask.sum(-1, dtype=torch.int32) if meta.num_decodes else None
    if not meta.prefills:
        return TritonAttentionMetadata(context_lens, None, None, None, 0)
    nd, dev = meta.num_decodes, meta.slot_mapping.device
    tables = [
        c.block_table
        if c.block_table is not None
        else meta.slot_mapping[c.q_start : c.q_start + c.q_len : block_size] // block_size
        for c in meta.prefills
    ]
    ends = [c.q_start + c.q_len - nd for c in meta.prefills]
    assert [c.q_start - nd for c in meta.prefills] == [0, *ends[:-1]], "prefill chunks must be back to back"
    return TritonAttentionMetadata(
        decode_context_lens=context_lens,
        cu_q_lens=torch.tensor([0, *ends], dtype=torch.int32, device=dev),
        start_pos=torch.tensor([c.start_pos for c in meta.prefills], dtype=torch.int32, device=dev),
        prefill_block_tables=torch.nn.utils.rnn.pad_sequence(tables, batch_first=True),
        max_q_len=max(c.q_len for c in meta.prefills),
    )
