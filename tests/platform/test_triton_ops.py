"""The per-layer Triton ops (kernels/triton_ops.py) against the torch path of the model.

Under TRITON_INTERPRET on CPU without a GPU, compiled on one. Each op is compared with what the
torch layers compute for the same inputs: layers.RMSNorm after a residual add, apply_rotary plus
write_kv, silu(gate) * up. Rows and heads are ragged in number (hidden sizes that are not powers
of two, GQA and MHA), fp32 and bf16; the cache starts as NaN so a slot the kernel should not
touch (a padded row's slot -1) and one it should write both show.
"""

import os
import zlib

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined

pytest.importorskip("triton")

from splitserve.platform.config import RopeScaling  # noqa: E402
from splitserve.platform.kernels import triton_ops  # noqa: E402
from splitserve.platform.models.attention import write_kv  # noqa: E402
from splitserve.platform.models.layers import RMSNorm, RotaryEmbedding, apply_rotary  # noqa: E402

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# fp32 agrees to rounding; bf16 differs by where the kernel rounds (once) vs torch (every op)
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}


def _gen(*case) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def _close(out: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    assert not out.isnan().any()
    err = ((out.float().cpu() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e} > {TOLERANCE[dtype]}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 64])
def test_add_rms_norm_matches_residual_add_then_rmsnorm(dtype, hidden):
    gen = _gen("norm", dtype, hidden)
    x, residual = (torch.randn(5, hidden, generator=gen).to(dtype) for _ in range(2))
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype)
    new_residual = x + residual
    ref = norm(new_residual)

    res = residual.to(DEVICE)
    out = triton_ops.add_rms_norm(x.to(DEVICE), res, norm.weight.data.to(DEVICE), 1e-5)
    _close(out, ref, dtype)
    assert torch.equal(res.cpu(), new_residual), "the residual is x + residual in its dtype, in place"
    _close(triton_ops.rms_norm(x.to(DEVICE), norm.weight.data.to(DEVICE), 1e-5), norm(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [pytest.param(4, 2, id="gqa4x2"), pytest.param(3, 3, id="mha3")])
def test_rope_write_kv_matches_apply_rotary_and_write_kv(dtype, num_heads, num_kv_heads):
    head_dim, block_size, num_blocks = 24, 4, 6  # half = 12: padded to 16 in the kernel
    gen = _gen("rope", dtype, num_heads)
    rotary = RotaryEmbedding(head_dim, 128, 10000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
    positions = torch.tensor([0, 7, 33, 127, 5])
    slots = torch.tensor([3, 9, 22, -1, 17])  # row 3 is graph padding
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(5, width, generator=gen).to(dtype)

    heads = qkv.view(5, -1, head_dim)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    rotated = apply_rotary(heads[:, : num_heads + num_kv_heads].float(), cos, sin)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_ref, v_ref = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    keep = slots >= 0
    write_kv(k_ref, v_ref, rotated[keep, num_heads:].to(dtype), heads[keep, num_heads + num_kv_heads :], slots[keep])

    qkv_dev = qkv.to(DEVICE)
    k_cache, v_cache = (
        torch.full_like(k_ref, float("nan"), device=DEVICE),
        torch.full_like(v_ref, float("nan"), device=DEVICE),
    )
    triton_ops.rope_write_kv(
        qkv_dev,
        positions.to(DEVICE),
        rotary.cos_cache.to(DEVICE),
        rotary.sin_cache.to(DEVICE),
        k_cache,
        v_cache,
        slots.to(DEVICE),
        num_heads,
        num_kv_heads,
        head_dim,
    )
    out = qkv_dev.view(5, -1, head_dim).cpu()
    _close(out[:, : num_heads + num_kv_heads], rotated, dtype)
    assert torch.equal(out[:, num_heads + num_kv_heads :], heads[:, num_heads + num_kv_heads :]), "v is not touched"
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[keep]] = True
    k_flat, v_flat = k_cache.cpu().view(-1, num_kv_heads, head_dim), v_cache.cpu().view(-1, num_kv_heads, head_dim)
    assert k_flat[~written].isnan().all() and v_flat[~written].isnan().all(), "wrote outside the given slots"
    _close(k_flat[written], k_ref.view(-1, num_kv_heads, head_dim)[written], dtype)
    assert torch.equal(v_flat[written], v_ref.view(-1, num_kv_heads, head_dim)[written])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    gen = _gen("silu", dtype)
    gate_up = (3 * torch.randn(3, 2 * 40, generator=gen)).to(dtype)
    gate, up = gate_up.float().split(40, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    _close(triton_ops.silu_mul(gate_up.to(DEVICE), block=16), ref, dtype)  # 40 = 16 + 16 + 8: a ragged tile
