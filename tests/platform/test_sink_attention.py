"""Attention sinks (gpt-oss) in every attention path against transformers' own formula.

The reference is transformers' `eager_attention_forward` of gpt-oss, run token by token over
each token's visible keys (its window where there is one). A mixed step as the runner lays it out
(decodes, a chunk after a prefix hit, a fresh prompt) goes through the torch path
(models/sink_attention.py via paged_attention) and the Triton path (the decode, prefill and
split-context decode kernels, under TRITON_INTERPRET without a GPU), with and without a window,
in float32 (the interpreter is slow; bf16 rounding is covered by test_triton_attention.py).
Sinks are drawn large (std 2), so that leaving them out would be far off the tolerance.
"""

import pytest
import torch
from test_triton_attention import (
    DEVICE,
    check,
    make_generator,
    on_device,
    random_block_tables,
    random_caches,
    rel_error,
)

from splitserve.platform.engine.runner import ModelRunner, _decodes_first
from splitserve.platform.kernels.triton_split_decode import split_decode_attention
from splitserve.platform.models.attention import _paged_attention_triton, gather_kv, paged_attention, write_kv
from splitserve.platform.sched.plan import ScheduledSeq

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 32, 8
FP32 = [torch.float32]  # bf16 rounding is the kernels' own concern (test_triton_attention.py)
SHAPES = [(37, 1), (5, 1), (64, 1), (35, 15), (30, 30)]  # (context after the step, tokens this step)


def transformers_reference(q, k_cache, v_cache, seqs, scale, sinks, window):
    """Each token's output from transformers' gpt-oss eager attention over its visible keys."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = SimpleNamespace(sinks=sinks.float(), num_key_value_groups=NUM_HEADS // NUM_KV_HEADS, training=False)
    out, row = [], 0
    for seq in seqs:
        table = torch.tensor(seq.block_ids)
        keys, values = gather_kv(k_cache.float(), table), gather_kv(v_cache.float(), table)
        for pos in range(seq.start_pos, seq.context_len):
            lo = 0 if window is None else max(0, pos - window + 1)
            key, value = (t[lo : pos + 1].transpose(0, 1)[None] for t in (keys, values))
            query = q[row : row + 1].float().transpose(0, 1)[None]
            attended, _ = eager_attention_forward(module, query, key, value, None, scale)
            out.append(attended[0])
            row += 1
    return torch.cat(out)


@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("dtype", FP32)
def test_sinks_in_torch_and_triton_paths_equal_transformers(dtype, window):
    gen = make_generator("sinks", dtype, window)
    tables = random_block_tables([-(-c // BLOCK_SIZE) for c, _ in SHAPES], 48, gen)
    seqs = _decodes_first(
        [
            ScheduledSeq(f"r{i}", (0,) * n, c - n, tuple(t.tolist()), True)
            for i, ((c, n), t) in enumerate(zip(SHAPES, tables))
        ]
    )
    _, _, meta, _ = ModelRunner(None, None, BLOCK_SIZE, torch.device("cpu"))._prepare(seqs)
    _, _, device_meta, _ = ModelRunner(None, None, BLOCK_SIZE, DEVICE)._prepare(seqs)
    num_tokens = sum(n for _, n in SHAPES)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    k_cache, v_cache = random_caches(48, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype, gen)
    sinks = torch.randn(NUM_HEADS, generator=gen) * 2
    scale = HEAD_DIM**-0.5
    device_caches = on_device(k_cache.clone(), v_cache.clone())

    torch_out = paged_attention(
        q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta, scale, window, sinks
    )
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    ref = transformers_reference(q, k_cache, v_cache, seqs, scale, sinks, window)
    check(f"sinks-torch-{dtype}-{window}", torch_out.to(dtype), ref, dtype)
    without = paged_attention(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta, scale, window)
    assert rel_error(without, ref) > 0.05, "the sinks must matter"

    dq, dk, dv = on_device(q, k, v)
    write_kv(*device_caches, dk, dv, device_meta.slot_mapping)
    out = _paged_attention_triton(dq, *device_caches, device_meta, scale, window, sinks.to(DEVICE))
    check(f"sinks-triton-{dtype}-{window}", out, ref, dtype)


@pytest.mark.parametrize("dtype", FP32)
def test_split_decode_adds_each_sink_once(dtype):
    """Three splits of each context: the reduce adds the sink once, as the single pass does."""
    gen = make_generator("split-sinks", dtype)
    lens = [1, 20, 70, 129]
    tables = random_block_tables([-(-c // BLOCK_SIZE) for c in lens], 64, gen)
    table = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    k_cache, v_cache = random_caches(64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype, gen)
    q = torch.randn(len(lens), NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    sinks = torch.randn(NUM_HEADS, generator=gen) * 2
    seqs = [ScheduledSeq(f"r{i}", (0,), c - 1, tuple(t.tolist()), True) for i, (c, t) in enumerate(zip(lens, tables))]
    ref = transformers_reference(q, k_cache, v_cache, seqs, HEAD_DIM**-0.5, sinks, None)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    args = on_device(q, k_cache, v_cache, table, context_lens)
    for num_splits in (1, 3):
        out = split_decode_attention(*args, HEAD_DIM**-0.5, num_splits, block_n=16, sinks=sinks.to(DEVICE))
        check(f"split{num_splits}-sinks-{dtype}", out, ref, dtype)
