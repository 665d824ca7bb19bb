"""The `w4a8` / `w4a16` kernels: 4-bit weights (and the int8 LM head) times integer activations
(cpu_a8.c).

Each call quantizes its input rows, per row and group of 32, to int8 with an absmax scale (and
keeps the exact float sum of each group for the weights' minimum term), then runs integer dot
products against weights packed in tiles of 16 output rows. The packing (below) is done once at
load; see cpu_a8.c for the byte layout and why a row's result never depends on its batch-mates.

Fidelity: one int8 digit (`w4a8`) rounds each input to 1/254 of its group's largest, as
llama.cpp does; on SmolLM2, whose normed activations carry large outliers, that moves the top-20
logits by up to 0.92 and the top-1 token at 3 of 72 prompt positions (3.5 and 8 before the
minimum term took the rounded inputs' sum, cpu_a8.c), and 5 of 8 greedy answers leave
transformers' within 64 tokens. Two digits (`w4a16`: the first digit's remainder quantized again,
x = u (254 q1 + q2)) bring the rounding to 1/64516 of the group's largest input, i.e. the float32
model within a few hundredths of a logit and 8 of 8 greedy answers, for twice the dot products on
the same unpacked weights. `auto` takes w4a16 for 4-bit files.
tests/platform/test_quantization.py holds every mode to its gates.
"""

from __future__ import annotations

import torch

from splitserve.platform.kernels.cpu_ops import CpuOps
from splitserve.platform.quant import formats
from splitserve.platform.quant.formats import RawQuant

TILE = 16


def pack_q4_tiles(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor):
    """codes [N, K] uint8 (0..15), scale/minimum [N, K/32] (w = scale * code + minimum) ->
    (tiles [N/16, K/32 * 256] uint8, scale and minimum [N/16, K/32, 16] float16)."""
    n, k = codes.shape
    t, g = n // TILE, k // formats.GROUP
    c = codes.view(t, TILE, g, 2, 4, 4)  # (tile, row, group, half, i, c)
    packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).contiguous()  # (tile, group, i, row, c)
    return packed.view(t, g * 256), _lanes(scale, t, g), _lanes(minimum, t, g)


def pack_q8_tiles(codes: torch.Tensor, scale: torch.Tensor):
    """codes [N, K] int8, scale [N, K/32] -> (tiles [N/16, K/32 * 512] int8, scale [N/16, K/32, 16] float16)."""
    n, k = codes.shape
    t, g = n // TILE, k // formats.GROUP
    packed = codes.view(t, TILE, g, 8, 4).permute(0, 2, 3, 1, 4).contiguous()  # (tile, group, j, row, c)
    return packed.view(t, g * 512), _lanes(scale, t, g)


def _lanes(values: torch.Tensor, tiles: int, groups: int) -> torch.Tensor:
    """[N, G] -> float16 [N/16, G, 16]: GGUF's own precision for scales and minimums (exact for
    Q4_0/Q4_1/Q8_0 blocks); float32 would add half the codes' bytes to every step's read."""
    return values.half().reshape(tiles, TILE, groups).permute(0, 2, 1).contiguous()


def fits(out_features: int, in_features: int) -> bool:
    return out_features % TILE == 0 and in_features % formats.GROUP == 0


class Int4A8Kernel:
    """A linear on 4-bit weights (per group of 32: a scale and a minimum; Q4_0/Q4_1 read exactly)
    with integer activations: one int8 digit (`w4a8`) or two (`w4a16`: the remainder of the first
    digit as a second, so 16-bit precision for twice the dot products on the same unpacked
    weights). Needs the CPU kernels (build_kernel falls back to `int4` without them)."""

    def __init__(self, weight: torch.Tensor | RawQuant, bias: torch.Tensor | None, ops: CpuOps, digits: int):
        assert digits in (1, 2)
        groups, self.exact = formats.int4_groups(weight)
        self.ops, self.digits = ops, digits
        self.name = "w4a8" if digits == 1 else "w4a16"
        self.tiles, self.d, self.mn = pack_q4_tiles(groups.codes, groups.scale, groups.minimum)
        self.bias = None if bias is None else bias.float()
        self.nbytes = self.tiles.nbytes + self.d.nbytes + self.mn.nbytes

    fits = staticmethod(fits)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        a = self.ops.quantize_a8(x.float().contiguous(), self.digits)
        y = self.ops.q4a8_linear(a, self.tiles, self.d, self.mn)
        return (y if self.bias is None else y + self.bias).to(x.dtype)


class Int8A16Kernel:
    """A linear on int8 weights with a scale per group of 32 (GGUF Q8_0, and Q5_0 widened to
    bytes, read exactly) times activations in two int8 digits: the same arithmetic as the LM head
    below, for a layer. (`auto-exact`'s kernel for those types, quant/kernels.exact_kernel.)"""

    name = "w8a16"

    def __init__(self, weight: torch.Tensor | RawQuant, bias: torch.Tensor | None, ops: CpuOps, digits: int = 2):
        assert digits == 2
        groups, self.exact = formats.int8_groups(weight)
        self.ops = ops
        self.tiles, self.d = pack_q8_tiles(groups.codes, groups.scale)
        self.bias = None if bias is None else bias.float()
        self.nbytes = self.tiles.nbytes + self.d.nbytes

    fits = staticmethod(fits)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.q8a8_linear(self.ops.quantize_a8(x.float().contiguous(), 2), self.tiles, self.d)
        return (y if self.bias is None else y + self.bias).to(x.dtype)


class Int8A8Head:
    """The LM head of the integer-activation modes: the int8 table (the embedding's own when tied;
    GGUF Q8_0 exactly) against the hidden state in two int8 digits, over the whole vocabulary.
    Every logit carries the same small rounding; no part of the vocabulary is approximated more
    than another. (With one digit, SmolLM2's chat answer to "What is the capital of France?"
    started with "L" instead of "The": a 0.08 margin, and one digit moved a logit by 0.13.)"""

    name = "w8a16"
    digits = 2

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, ops: CpuOps):
        self.ops = ops
        self.tiles, self.d = pack_q8_tiles(codes, scale)
        self.exact = False
        self.nbytes = self.tiles.nbytes + self.d.nbytes

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.q8a8_linear(self.ops.quantize_a8(hidden.float().contiguous(), self.digits), self.tiles, self.d)
