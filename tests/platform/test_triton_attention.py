"""The Triton paged-attention kernels against the torch reference path.

Without a GPU the kernels run under TRITON_INTERPRET on CPU tensors (numpy), so their indexing,
masking and online softmax are checked on any machine; with one they run compiled on CUDA tensors
(the interpreter stays off, so other tests in the process get compiled kernels) and the reference
still runs on CPU. Every case draws fresh random inputs: ragged context lengths, block tables that
are random permutations of the cache's blocks, prefix offsets (start_pos > 0), GQA and MHA head
layouts. Outputs start as NaN, so a value the kernel fails to write shows up. Relative error is
max|out - ref| / max|ref|, where the reference runs in fp32 on the same (bf16-valued) inputs: the
bf16 error is the kernel's own (its rounded probabilities and output), not the sum of two
independently rounded outputs.
"""

import os
import zlib

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined: @triton.jit reads it then

pytest.importorskip("triton")

from splitserve.platform.engine.runner import ModelRunner, _decodes_first  # noqa: E402
from splitserve.platform.kernels.dispatch import triton_available  # noqa: E402
from splitserve.platform.kernels.triton_attention import paged_decode_attention, paged_prefill_attention  # noqa: E402
from splitserve.platform.models.attention import (  # noqa: E402
    _paged_attention_triton,
    decode_attention,
    gather_kv,
    paged_attention,
    prefill_attention,
    write_kv,
)
from splitserve.platform.sched.plan import ScheduledSeq  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
HEADS = [pytest.param(8, 2, id="gqa8x2"), pytest.param(4, 4, id="mha4")]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def make_generator(*case) -> torch.Generator:
    """A generator seeded from the test case, so each case has its own reproducible draw."""
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float().cpu() - ref.float()).abs().max() / ref.float().abs().max()).item()


def check(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), f"{name}: {int(out.isnan().sum())} output elements never written"
    err = rel_error(out, ref)
    print(f"{name}: relative error {err:.2e}")  # shown with -s
    assert err <= TOLERANCE[dtype], f"{name}: relative error {err:.2e} > {TOLERANCE[dtype]}"


def random_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))


def random_block_tables(num_blocks_per_seq: list[int], num_blocks: int, gen) -> list[torch.Tensor]:
    """Disjoint, non-contiguous block ids: consecutive slices of a random permutation."""
    perm = torch.randperm(num_blocks, generator=gen)
    bounds = torch.tensor([0, *num_blocks_per_seq]).cumsum(0).tolist()
    assert bounds[-1] <= num_blocks
    return [perm[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("head_dim,block_size", [(32, 8), (24, 16)])  # 24: head_dim padded to 32
def test_decode_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size):
    gen = make_generator("decode", dtype, num_heads, head_dim)
    context_lens = torch.randint(1, 80, (5,), generator=gen)
    context_lens[0] = 1  # a single key
    num_blocks_per_seq = [-(-int(c) // block_size) for c in context_lens]
    k_cache, v_cache = random_caches(64, block_size, num_kv_heads, head_dim, dtype, gen)
    width = max(num_blocks_per_seq) + 1  # a padded column is never read
    block_table = torch.zeros(5, width, dtype=torch.long)
    for row, ids in enumerate(random_block_tables(num_blocks_per_seq, 64, gen)):
        block_table[row, : len(ids)] = ids
    q = torch.randn(5, num_heads, head_dim, generator=gen).to(dtype)

    out = torch.full_like(q, float("nan"), device=DEVICE)
    paged_decode_attention(
        *on_device(q, k_cache, v_cache, block_table, context_lens.to(torch.int32)), head_dim**-0.5, out=out, block_n=16
    )

    mask = torch.arange(width * block_size)[None, :] < context_lens[:, None]
    ref = decode_attention(
        q.float(),
        gather_kv(k_cache.float(), block_table),
        gather_kv(v_cache.float(), block_table),
        head_dim**-0.5,
        mask,
    )
    check(f"decode-{dtype}-{num_heads}x{num_kv_heads}-d{head_dim}", out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_prefill_matches_reference(dtype, num_heads, num_kv_heads):
    head_dim, block_size = 32, 8
    gen = make_generator("prefill", dtype, num_heads)
    # chunk 0: a whole prompt; 1: a prefix hit not aligned to blocks; 2: one token past a
    # long prefix; 3: spans three query tiles with a block-aligned prefix
    q_lens, start_pos = [13, 21, 1, 35], [0, 11, 45, 16]
    context_lens = [s + n for s, n in zip(start_pos, q_lens)]
    num_blocks_per_seq = [-(-c // block_size) for c in context_lens]
    k_cache, v_cache = random_caches(48, block_size, num_kv_heads, head_dim, dtype, gen)
    tables = random_block_tables(num_blocks_per_seq, 48, gen)
    block_tables = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    cu_q_lens = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)

    out = torch.full_like(q, float("nan"), device=DEVICE)
    paged_prefill_attention(
        *on_device(q, k_cache, v_cache, cu_q_lens, torch.tensor(start_pos, dtype=torch.int32), block_tables),
        head_dim**-0.5,
        out=out,
        block_m=16,
        block_n=16,
    )

    ref = torch.empty_like(q, dtype=torch.float32)
    for s, (n, start, ctx) in enumerate(zip(q_lens, start_pos, context_lens)):
        rows = slice(int(cu_q_lens[s]), int(cu_q_lens[s + 1]))
        keys = gather_kv(k_cache.float(), tables[s])[:ctx]
        values = gather_kv(v_cache.float(), tables[s])[:ctx]
        mask = torch.ones(n, ctx, dtype=torch.bool).tril(start)
        ref[rows] = prefill_attention(q[rows].float(), keys, values, head_dim**-0.5, mask)
    check(f"prefill-{dtype}-{num_heads}x{num_kv_heads}", out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_triton_path_matches_torch_path(dtype):
    """A mixed step as the runner lays it out (decodes, then prefill chunks with and without a
    prefix): the Triton path, metadata derived by build_triton_metadata, equals the torch path."""
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 32, 8
    gen = make_generator("paged", dtype)
    # (context_len after this step, tokens this step): decodes, a prefix hit, a fresh prompt
    shapes = [(37, 1), (5, 1), (64, 1), (35, 15), (19, 19)]
    tables = random_block_tables([-(-c // block_size) for c, _ in shapes], 40, gen)
    seqs = _decodes_first(
        [
            ScheduledSeq(f"r{i}", (0,) * n, c - n, tuple(t.tolist()), True)
            for i, ((c, n), t) in enumerate(zip(shapes, tables))
        ]
    )
    _, _, meta, _ = ModelRunner(None, None, block_size, torch.device("cpu"))._prepare(seqs)
    _, _, device_meta, _ = ModelRunner(None, None, block_size, DEVICE)._prepare(seqs)
    num_tokens = sum(n for _, n in shapes)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    k_cache, v_cache = random_caches(40, block_size, num_kv_heads, head_dim, dtype, gen)

    ref = paged_attention(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta, head_dim**-0.5)
    assert meta.triton is None  # the CPU path never builds it
    q, k, v, k_cache, v_cache = on_device(q, k, v, k_cache, v_cache)
    write_kv(k_cache, v_cache, k, v, device_meta.slot_mapping)
    out = _paged_attention_triton(q, k_cache, v_cache, device_meta, head_dim**-0.5)

    tm = device_meta.triton
    assert tm.cu_q_lens.tolist() == [0, 15, 34] and tm.max_q_len == 19
    assert tm.decode_context_lens.tolist() == [37, 5, 64]
    assert tm.prefill_block_tables[1, :3].tolist() == tables[4].tolist()  # from the slot mapping
    check(f"paged-{dtype}", out, ref, dtype)


def test_empty_batches_write_nothing():
    k_cache, v_cache = on_device(*random_caches(4, 8, 2, 16, torch.float32, torch.Generator().manual_seed(0)))
    q, table, lens = on_device(
        torch.empty(0, 4, 16), torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.int32)
    )
    assert paged_decode_attention(q, k_cache, v_cache, table, lens, 0.25).shape == (0, 4, 16)
    cu_q_lens = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    assert paged_prefill_attention(q, k_cache, v_cache, cu_q_lens, lens, table, 0.25).shape == (0, 4, 16)


def test_triton_dispatch_only_on_cuda():
    assert triton_available("cpu") is False
    assert triton_available(torch.device("cuda", 0)) is True  # triton imports in this module


def dense_windowed_reference(q, k_cache, v_cache, seqs, block_size, scale, window):
    """Each token's attention computed alone from its sequence's keys p - window < j <= p."""
    out, row = [], 0
    for seq in seqs:
        table = torch.tensor(seq.block_ids)
        keys, values = gather_kv(k_cache.float(), table), gather_kv(v_cache.float(), table)
        for pos in range(seq.start_pos, seq.context_len):
            lo = max(0, pos - window + 1)
            mask = torch.zeros(1, pos + 1, dtype=torch.bool)
            mask[:, lo:] = True
            out.append(prefill_attention(q[row : row + 1].float(), keys[: pos + 1], values[: pos + 1], scale, mask))
            row += 1
    return torch.cat(out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window_triton_and_torch_paths_match_a_dense_reference(dtype):
    """A mixed step whose contexts are longer than the window (decodes, a prefix hit, a fresh
    prompt): the torch path's window masks and the Triton kernels' WINDOW both equal attention
    computed token by token over the last `window` keys; full attention differs, so the window
    is really applied."""
    num_heads, num_kv_heads, head_dim, block_size, window = 8, 2, 32, 8, 12
    gen = make_generator("window", dtype)
    shapes = [(37, 1), (5, 1), (64, 1), (35, 15), (30, 30)]
    tables = random_block_tables([-(-c // block_size) for c, _ in shapes], 40, gen)
    seqs = _decodes_first(
        [
            ScheduledSeq(f"r{i}", (0,) * n, c - n, tuple(t.tolist()), True)
            for i, ((c, n), t) in enumerate(zip(shapes, tables))
        ]
    )
    _, _, meta, _ = ModelRunner(None, None, block_size, torch.device("cpu"))._prepare(seqs)
    _, _, device_meta, _ = ModelRunner(None, None, block_size, DEVICE)._prepare(seqs)
    num_tokens = sum(n for _, n in shapes)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    k_cache, v_cache = random_caches(40, block_size, num_kv_heads, head_dim, dtype, gen)
    scale = head_dim**-0.5

    torch_out = paged_attention(
        q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta, scale, window=window
    )
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    ref = dense_windowed_reference(q, k_cache, v_cache, seqs, block_size, scale, window)
    check(f"window-torch-{dtype}", torch_out.to(dtype), ref, dtype)
    full = paged_attention(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta, scale)
    assert rel_error(full, ref) > 0.05

    q, k, v, dk, dv = on_device(q, k, v, *random_caches(40, block_size, num_kv_heads, head_dim, dtype, gen))
    write_kv(dk, dv, k, v, device_meta.slot_mapping)
    dk.copy_(k_cache.to(DEVICE)), dv.copy_(v_cache.to(DEVICE))
    out = _paged_attention_triton(q, dk, dv, device_meta, scale, window)
    check(f"window-triton-{dtype}", out, ref, dtype)


def test_fp32_attention_is_ieee_unless_torchs_tf32_switch_is_on():
    """fp32 prefill on a GPU is IEEE fp32 by default (exact against transformers, and slow: no
    tensor cores); torch's own TF32 switch moves the attention onto TF32 with the GEMMs."""
    from splitserve.platform.kernels.triton_attention import _precision

    q32, q16 = torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.bfloat16)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert _precision(q32)["PRECISION"] == "ieee" and _precision(q16)["PRECISION"] == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert _precision(q32)["PRECISION"] == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
