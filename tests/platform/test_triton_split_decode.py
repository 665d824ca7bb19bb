"""Split-context (flash-decoding) paged decode attention against the torch reference.

As in test_triton_attention.py: without a GPU the kernels run under TRITON_INTERPRET on CPU
tensors, with one they run compiled. Ragged contexts (one key, contexts shorter than the split
count leaves work for, contexts spanning every split), random block tables, GQA and MHA,
fp32 and bf16; outputs start as NaN so an unwritten element shows. The split-count rule is a
pure function, checked on a table.
"""

import os
import zlib

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

pytest.importorskip("triton")

from splitserve.platform.kernels.triton_split_decode import MAX_SPLITS, choose_num_splits, split_decode_attention  # noqa: E402
from splitserve.platform.models.attention import decode_attention, gather_kv  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def _gen(*case) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def _rel_error(out, ref) -> float:
    return ((out.float().cpu() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("num_heads,num_kv_heads", [pytest.param(8, 2, id="gqa8x2"), pytest.param(4, 4, id="mha4")])
@pytest.mark.parametrize("num_splits", [3, 4])
def test_split_decode_matches_reference(dtype, num_heads, num_kv_heads, num_splits):
    head_dim, block_size, num_blocks = 32, 8, 64
    gen = _gen("split", dtype, num_heads, num_splits)
    # one key; shorter than one tile per split (later splits empty); ragged long ones
    context_lens = torch.tensor([1, 20, 70, 129, 200])
    per_seq = [-(-int(c) // block_size) for c in context_lens]
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(per_seq) + 1
    table = torch.zeros(len(per_seq), width, dtype=torch.long)
    at = 0
    for row, n in enumerate(per_seq):
        table[row, :n] = perm[at : at + n]
        at += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(len(per_seq), num_heads, head_dim, generator=gen).to(dtype)

    out = torch.full_like(q, float("nan"), device=DEVICE)
    split_decode_attention(
        q.to(DEVICE),
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        table.to(DEVICE),
        context_lens.to(torch.int32).to(DEVICE),
        head_dim**-0.5,
        num_splits,
        out=out,
        block_n=16,
    )

    mask = torch.arange(width * block_size)[None, :] < context_lens[:, None]
    ref = decode_attention(
        q.float(), gather_kv(k_cache.float(), table), gather_kv(v_cache.float(), table), head_dim**-0.5, mask
    )
    assert not out.isnan().any(), "an output element was never written"
    err = _rel_error(out, ref)
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e} > {TOLERANCE[dtype]}"


def test_a_row_without_context_comes_out_zero():
    """A row with context length 0: every split is empty, the reduce writes zeros, not NaN. The
    lengths are int64 here, as the CUDA-graph buffers hold them (the runner's are int32)."""
    gen = _gen("empty")
    k_cache, v_cache = (torch.randn(4, 8, 2, 16, generator=gen) for _ in range(2))
    q = torch.randn(2, 4, 16, generator=gen)
    table = torch.tensor([[0, 1], [2, 3]])
    out = split_decode_attention(
        *(t.to(DEVICE) for t in (q, k_cache, v_cache, table)),
        torch.tensor([0, 9], dtype=torch.int64, device=DEVICE),
        0.25,
        4,
        block_n=16,
    )
    assert out[0].abs().max().item() == 0.0 and not out.isnan().any()


@pytest.mark.parametrize(
    "batch,kv_heads,sms,max_context,expected",
    [
        (1, 8, 132, 1024, 4),  # 8 programs: 33 splits wanted, capped by 1024 // 256 = 4
        (1, 8, 132, 8192, MAX_SPLITS),
        (4, 8, 132, 8192, 9),  # ceil(264 / 32) = 9
        (16, 8, 132, 8192, 3),  # 128 programs: ceil(264 / 128) = 3
        (17, 8, 132, 8192, 1),  # 136 programs fill 132 SMs
        (64, 8, 132, 8192, 1),
        (1, 8, 132, 256, 1),  # too short to split
        (2, 32, 132, 4096, 5),  # MHA-like: 64 programs
    ],
)
def test_split_count_rule(batch, kv_heads, sms, max_context, expected):
    assert choose_num_splits(batch, kv_heads, sms, max_context) == expected


def test_split_count_is_one_or_more_and_bounded():
    for batch in (1, 2, 3, 8, 64, 256):
        for ctx in (1, 255, 256, 257, 4096, 131072):
            n = choose_num_splits(batch, 8, 132, ctx)
            assert 1 <= n <= MAX_SPLITS
