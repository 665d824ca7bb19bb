"""The GGUF types whose stored codes the fast kernels keep as they are (quant/formats.py): Q4_K
into int4 groups (w4a16), Q5_0 and Q8_0 into int8 groups (w8a16), read from the real Gemma 3
270M file (`gemma3-270m`), and the per-type choice Gemma 3's `auto` builds from them
(quant/kernels.exact_kernel).

"Exact" means: the groups' codes, scales and minimums reproduce the `gguf` package's
dequantization bit for bit in float32; the tiled kernels then hold scales and minimums as
float16 lanes, which rounds a Q4_K scale d * sc (an 11-bit mantissa times a 6-bit integer) by at
most 2^-11 relative, and leaves Q5_0/Q8_0's float16 d untouched.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_cpu_a8 import unpack_q4

from splitserve.platform.formats.gguf_file import GGUFFile
from splitserve.platform.kernels.cpu_ops import cpu_ops
from splitserve.platform.model_source import resolve_model
from splitserve.platform.models.layers import _concat_rows
from splitserve.platform.quant import a8, formats
from splitserve.platform.quant.kernels import RescoredHead, build_kernel, exact_kernel, top_ids

ops = cpu_ops()
needs_kernels = pytest.mark.skipif(ops is None, reason="no C compiler could build the fused CPU kernels here")


@pytest.fixture(scope="module")
def gemma_file() -> GGUFFile:
    return GGUFFile(resolve_model("gemma3-270m").path)


def raw_tensor(file: GGUFFile, name: str, expected: Q) -> formats.RawQuant:
    info = file.tensors[name]
    assert Q(info.tensor_type) == expected, name
    return formats.RawQuant(expected, file.raw(name), tuple(info.shape))


def test_q4_k_codes_are_kept_and_give_ggufs_values_bit_for_bit(gemma_file):
    raw = raw_tensor(gemma_file, "blk.0.attn_output.weight", Q.Q4_K)
    groups, exact = formats.int4_groups(raw)
    rows, cols = raw.shape
    values = groups.codes.view(rows, cols // 32, 32).float() * groups.scale[..., None] + groups.minimum[..., None]
    assert exact and groups.codes.max() <= 15
    assert torch.equal(values.view(rows, cols), raw.dequantize())
    # no re-quantization: min/max per group of the file's values would pick other codes
    assert not torch.equal(formats.quantize_int4(raw.dequantize()).codes, groups.codes)


@needs_kernels
def test_q4_k_in_the_w4a16_tiles_keeps_the_codes_and_rounds_only_scales_to_float16(gemma_file):
    raw = raw_tensor(gemma_file, "blk.2.ffn_down.weight", Q.Q4_K)
    groups, _ = formats.int4_groups(raw)
    kernel = build_kernel("w4a16", "layers.2.mlp.down_proj", raw, None, torch.float32)
    assert isinstance(kernel, a8.Int4A8Kernel) and kernel.exact
    codes, scale, minimum = unpack_q4(kernel)
    assert torch.equal(codes, groups.codes)
    assert torch.equal(scale, groups.scale.half().float()) and torch.equal(minimum, groups.minimum.half().float())
    bound = 2.0**-11
    assert ((scale - groups.scale).abs() <= bound * groups.scale.abs()).all()
    assert ((minimum - groups.minimum).abs() <= bound * groups.minimum.abs()).all()


def test_q5_0_codes_are_int8_groups_exactly_and_widen_to_q8_0_blocks(gemma_file):
    raw = raw_tensor(gemma_file, "blk.0.attn_q.weight", Q.Q5_0)
    groups, exact = formats.int8_groups(raw)
    assert exact and groups.codes.min() >= -16 and groups.codes.max() <= 15
    assert torch.equal(groups.dequantize(), raw.dequantize())
    widened = formats.as_q8_0(raw)
    assert widened.tensor_type == Q.Q8_0 and torch.equal(widened.dequantize(), raw.dequantize())


def test_q5_0_and_q8_0_shards_stack_into_one_linear_with_their_codes(gemma_file):
    """Gemma 3 270M's qkv: q and k are Q5_0, v is Q8_0 on half the layers."""
    parts = [
        raw_tensor(gemma_file, "blk.0.attn_q.weight", Q.Q5_0),
        raw_tensor(gemma_file, "blk.0.attn_k.weight", Q.Q5_0),
        raw_tensor(gemma_file, "blk.0.attn_v.weight", Q.Q8_0),
    ]
    stacked = _concat_rows(parts)
    assert isinstance(stacked, formats.RawQuant) and stacked.tensor_type == Q.Q8_0
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert formats.int8_groups(stacked)[1]


@needs_kernels
def test_w8a16_linear_is_the_file_weights_times_two_digit_inputs_and_batch_invariant(gemma_file):
    raw = raw_tensor(gemma_file, "blk.0.ffn_gate.weight", Q.Q5_0)
    kernel = build_kernel("w8a16", "layers.0.mlp.gate_up_proj", raw, None, torch.float32)
    assert isinstance(kernel, a8.Int8A16Kernel) and kernel.exact
    x = torch.randn(5, raw.shape[1])
    x[:, :3] *= 40  # outlier channels, as normed hidden states have
    ref = x.double() @ raw.dequantize().double().t()
    y = kernel(x)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-4  # two digits: 1/64516 of a group's largest input
    assert torch.equal(kernel(x[2:3]), y[2:3])


@needs_kernels
@pytest.mark.parametrize(
    ("tensor_type", "kernel"),
    [
        (Q.Q4_K, "w4a16"),
        (Q.Q4_0, "w4a16"),
        (Q.Q4_1, "w4a16"),
        (Q.Q5_0, "w8a16"),
        (Q.Q8_0, "w8a16"),
        (Q.Q6_K, "fp16"),
        (Q.Q5_K, "fp16"),
        (None, "fp16"),
    ],
)
def test_exact_kernel_keeps_the_codes_of_the_types_it_can_hold(tensor_type, kernel):
    assert exact_kernel(tensor_type) == kernel


@needs_kernels
def test_rescored_head_with_a_w4a8_pass_is_exact_at_the_top(gemma_file):
    table = raw_tensor(gemma_file, "token_embd.weight", Q.Q8_0)
    rows = 4096
    raw = formats.RawQuant(Q.Q8_0, table.blocks[:rows], (rows, table.shape[1]))
    groups, _ = formats.int8_groups(raw)
    head = RescoredHead(groups.codes, groups.scale, ops=ops)
    assert head.name == "w4a8+rescore"
    hidden = torch.randn(3, table.shape[1])
    logits = head(hidden)
    exact = hidden.double() @ raw.dequantize().double().t()
    top = exact.topk(8, dim=-1).indices
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    assert torch.allclose(logits.gather(1, top).double(), exact.gather(1, top), rtol=1e-5, atol=1e-4)
    assert np.isfinite(logits.numpy()).all()


@pytest.mark.parametrize("rows", [1, 3])
def test_top_ids_of_a_large_vocabulary_are_topks(rows):
    """The head's two-pass top (quant/kernels.top_ids) finds the same ids as one topk, with the
    largest values crowded into one chunk and spread over many."""
    torch.manual_seed(0)
    logits = torch.randn(rows, 262144) * 3
    logits[0, 64 * 100 : 64 * 100 + 64] += 50  # one chunk holds all 64 largest of row 0
    ids = top_ids(logits, 64)
    for r in range(rows):
        assert sorted(ids[r].tolist()) == sorted(logits[r].topk(64).indices.tolist())
