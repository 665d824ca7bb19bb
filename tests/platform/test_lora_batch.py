"""The mixed-adapter delta (platform/lora/batch.py) against the per-row definition
y_i += scale * B_a (A_a x_i) for row i's adapter a, on random weights: adapters of different
ranks, one that does not touch the linear, base rows in between, and the cached entries and
concatenations reused across steps and rebuilt when the set of adapters changes. Both paths:
the C kernel (CpuOps.lora_delta) and the torch form with a mask (a GPU's), and the C kernel's
row bits the same alone and in any mix."""

import pytest
import torch

from splitserve.platform.lora.adapter import LinearLayout, LoraAdapter, _pack
from splitserve.platform.lora.batch import LoraContext

LAYOUT = LinearLayout(in_features=12, shard_offsets={"q": (0, 8), "k": (8, 4), "v": (12, 4)})
KEY = "layers.0.self_attn.qkv_proj"


def adapter(name, rank, projs, seed, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    sizes = {"q_proj": 8, "k_proj": 4, "v_proj": 4}
    parts = {
        p: {"A": torch.randn(rank, 12, generator=gen), "B": torch.randn(sizes[p], rank, generator=gen)} for p in projs
    }
    weights = {KEY: _pack(parts, LAYOUT, scale, torch.float32)} if parts else {}
    return LoraAdapter(name, "/x", rank, scale * rank, False, tuple(projs), name.encode() * 4, weights), parts


def reference(x, y, parts, scale=2.0):
    out = y.clone()
    offsets = {"q_proj": (0, 8), "k_proj": (8, 4), "v_proj": (12, 4)}
    for p, ab in parts.items():
        start, size = offsets[p]
        out[:, start : start + size] += scale * (x @ ab["A"].T) @ ab["B"].T
    return out


@pytest.fixture(params=["c-kernel", "torch-mask"])
def path(request):
    """Run add_delta through the CPU's C kernel, or through the torch form (batch.ops None)."""
    from splitserve.platform.kernels.cpu_ops import cpu_ops

    if request.param == "c-kernel" and cpu_ops() is None:
        pytest.skip("no C compiler could build the CPU kernels here")
    return request.param


def begin(ctx, num_tokens, adapters, path):
    ctx.begin(num_tokens, adapters, "cpu")
    if ctx.batch is not None and path == "torch-mask":
        ctx.batch.ops = None


def test_mixed_rows_get_their_own_adapter_and_base_rows_nothing(path):
    a, pa = adapter("a", 4, ["q_proj", "v_proj"], 1)
    b, pb = adapter("b", 8, ["k_proj", "q_proj", "v_proj"], 2)
    c, _ = adapter("c", 2, [], 3)  # touches no projection of this linear
    ctx = LoraContext()
    seqs = [(3, a), (1, None), (2, b), (1, c), (2, a)]  # rows: a a a - b b c a a
    x, y = torch.randn(9, 12), torch.randn(9, 16)
    for _ in range(2):  # the second step reuses the cached concatenation
        begin(ctx, [n for n, _ in seqs], [ad for _, ad in seqs], path)
        out = y.clone()
        ctx.add_delta(KEY, x, out)
        ctx.end()
        expected = y.clone()
        expected[[0, 1, 2, 7, 8]] = reference(x[[0, 1, 2, 7, 8]], y[[0, 1, 2, 7, 8]], pa)
        expected[[4, 5]] = reference(x[[4, 5]], y[[4, 5]], pb)
        torch.testing.assert_close(out, expected)
        assert torch.equal(out[3], y[3]) and torch.equal(out[6], y[6])  # base and untouched rows: exact
    assert ctx.batch is None and len(ctx._packed) == 1


def test_one_adapter_on_every_row_and_a_changed_set(path):
    a, pa = adapter("a", 4, ["k_proj"], 4)
    b, pb = adapter("b", 4, ["q_proj"], 5)
    ctx = LoraContext()
    x, y = torch.randn(5, 12), torch.randn(5, 16)
    begin(ctx, [5], [a], path)
    assert ctx.batch.is_uniform
    out = y.clone()
    ctx.add_delta(KEY, x, out)
    torch.testing.assert_close(out, reference(x, y, pa))
    begin(ctx, [2, 3], [b, a], path)
    out = y.clone()
    ctx.add_delta(KEY, x, out)
    torch.testing.assert_close(out[:2], reference(x[:2], y[:2], pb))
    torch.testing.assert_close(out[2:], reference(x[2:], y[2:], pa))
    ctx.begin([5], [None], "cpu")
    assert ctx.batch is None  # no adapter in the step: nothing published


def test_c_kernel_gives_a_row_the_same_bits_alone_and_in_any_mix():
    """A request's delta may not depend on its batch-mates (greedy tokens would change with the
    batch): each row of a mixed step equals, bit for bit, that row run alone with its adapter.
    (The torch form runs a BLAS, which picks kernels by shape: no such promise.)"""
    from splitserve.platform.kernels.cpu_ops import cpu_ops

    if cpu_ops() is None:
        pytest.skip("no C compiler could build the CPU kernels here")
    path = "c-kernel"
    a, _ = adapter("a", 4, ["q_proj", "v_proj"], 6)
    b, _ = adapter("b", 16, ["k_proj", "q_proj", "v_proj"], 7)
    ctx = LoraContext()
    x, y = torch.randn(11, 12), torch.randn(11, 16)
    seqs = [(1, b), (4, a), (2, None), (3, b), (1, a)]
    begin(ctx, [n for n, _ in seqs], [ad for _, ad in seqs], path)
    mixed = y.clone()
    ctx.add_delta(KEY, x, mixed)
    row = 0
    for n, ad in seqs:
        for r in range(row, row + n):
            alone = y[r : r + 1].clone()
            begin(ctx, [1], [ad], path)
            if ctx.batch is not None:
                ctx.add_delta(KEY, x[r : r + 1].contiguous(), alone)
            assert torch.equal(mixed[r], alone[0]), f"row {r} ({'base' if ad is None else ad.name})"
        row += n
