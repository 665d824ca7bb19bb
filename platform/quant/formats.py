"""Grouped low-bit weights: the in-memory forms the fast kernels are fed from.

A weight reaches a layer either as a float tensor (safetensors, random presets, F32/F16 GGUF
tensors, or any type under `--quantization none`) or as a `RawQuant`: the stored GGUF blocks of
one tensor, untouched. From either a layer asks for the form its kernel needs:

- `Int4Groups`: codes 0..15 with, per row and group of 32 inputs, `value = code * scale +
  minimum` (also written `(code - 8) * scale + zero`, zero = minimum + 8 scale). Q4_0
  (`d * (q - 8)`), Q4_1 (`d * q + m`) and Q4_K are read exactly from their blocks; anything else
  is re-quantized from its float values (min/max per group, which for llama.cpp's Q4_1, whose
  groups always span codes 0 and 15, gives back the same codes).
- `Int8Groups`: int8 codes with one float scale per row and group of 32: `value = q * scale`,
  which is Q8_0 exactly, and Q5_0 too (codes q - 16 in -16..15, scale d); other types are
  re-quantized (absmax per group).
- `int8_rows`: int8 codes with one scale per row (absmax), for the per-channel int8 kernel.

GGUF block layouts (ggml-common.h): Q4_0 = f16 d | 16 bytes, element j in the low nibble of
byte j and element j + 16 in its high nibble; Q4_1 = f16 d | f16 m | 16 bytes, same nibbles;
Q8_0 = f16 d | 32 int8; Q5_0 = f16 d | 4 bytes qh | 16 bytes qs, element j's low 4 bits in
nibble j of qs as Q4_0's, its fifth bit in bit j of qh (little-endian), value d * (q - 16).
Q4_K = super-blocks of 256 (144 bytes): f16 d | f16 dmin | 12 bytes of eight 6-bit scales sc and
minimums m | 128 bytes of codes; sub-block j (32 inputs) is `d * sc_j * q - dmin * m_j`, i.e. one
Int4Group with scale d * sc_j and minimum -dmin * m_j (both exact in float32: an 11-bit
mantissa times a 6-bit integer). Its codes: the 32 bytes of chunk c (c < 4) hold sub-block 2c in
their low nibbles and 2c + 1 in their high nibbles. The 6-bit fields: for j < 4, sc_j is the low
6 bits of byte j and m_j of byte j + 4; for j >= 4 their low 4 bits are the low and high nibble
of byte j + 4 and their top 2 bits the top 2 bits of bytes j - 4 and j.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

GROUP = 32


@dataclass
class RawQuant:
    """The stored blocks of one GGUF tensor: `blocks` uint8 [rows, bytes_per_row], in HF row order."""

    tensor_type: Q
    blocks: np.ndarray
    shape: tuple[int, int]

    @property
    def type_name(self) -> str:
        return getattr(self.tensor_type, "name", str(self.tensor_type))

    def dequantize(self) -> torch.Tensor:
        """The float32 values, exactly as `--quantization none` loads them."""
        values = dequantize(self.blocks, self.tensor_type)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(self.shape)

    def permute_rows(self, order: torch.Tensor) -> RawQuant:
        return RawQuant(self.tensor_type, self.blocks[order.numpy()], self.shape)


@dataclass
class Int4Groups:
    codes: torch.Tensor  # [rows, cols] uint8 in 0..15
    scale: torch.Tensor  # [rows, cols // 32] float32
    zero: torch.Tensor  # [rows, cols // 32] float32
    exact_minimum: torch.Tensor | None = field(default=None, repr=False)  # as stored, where read from blocks

    @property
    def minimum(self) -> torch.Tensor:
        """value = code * scale + minimum: the stored minimum where there is one (Q4_K), so the
        float32 arithmetic of zero - 8 scale adds no rounding of its own."""
        return self.zero - 8 * self.scale if self.exact_minimum is None else self.exact_minimum

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        codes = self.codes.view(rows, cols // GROUP, GROUP).float()
        grouped = (codes - 8) * self.scale[..., None] + self.zero[..., None]
        return grouped.view(rows, cols)


@dataclass
class Int8Groups:
    codes: torch.Tensor  # [rows, cols] int8
    scale: torch.Tensor  # [rows, cols // 32] float32

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        return (self.codes.view(rows, cols // GROUP, GROUP).float() * self.scale[..., None]).view(rows, cols)


def _blocks(raw: RawQuant, block_bytes: int) -> np.ndarray:
    rows, cols = raw.shape
    return raw.blocks.reshape(rows, cols // GROUP, block_bytes)


def _f16(blocks: np.ndarray, offset: int) -> torch.Tensor:
    halves = np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)
    return torch.from_numpy(halves[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.from_numpy(np.concatenate([qs & 0x0F, qs >> 4], axis=-1))


def int4_groups(weight: torch.Tensor | RawQuant) -> tuple[Int4Groups, bool]:
    """The Int4Groups of `weight`, and whether they are exact (read from Q4_0/Q4_1/Q4_K blocks)."""
    if isinstance(weight, RawQuant) and weight.tensor_type == Q.Q4_K:
        return q4_k_groups(weight), True
    if isinstance(weight, RawQuant) and weight.tensor_type in (Q.Q4_0, Q.Q4_1):
        rows, cols = weight.shape
        is_q4_1 = weight.tensor_type == Q.Q4_1
        blocks = _blocks(weight, 20 if is_q4_1 else 18)
        d = _f16(blocks, 0)
        zero = (_f16(blocks, 2) + 8 * d) if is_q4_1 else torch.zeros_like(d)
        codes = _nibbles(blocks[..., 4 if is_q4_1 else 2 :]).reshape(rows, cols)
        return Int4Groups(codes.contiguous(), d, zero), True
    values = weight.dequantize() if isinstance(weight, RawQuant) else weight.float()
    return quantize_int4(values), False


def q4_k_groups(raw: RawQuant) -> Int4Groups:
    """Q4_K's codes as they are stored, each sub-block of 32 one group (module docstring)."""
    rows, cols = raw.shape
    blocks = raw.blocks.reshape(rows, cols // 256, 144)
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
    packed = blocks[..., 4:16].astype(np.int32)
    lo, mid, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:].reshape(rows, cols // 256, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, cols)
    scale = (d * torch.from_numpy(sc).float()).reshape(rows, cols // GROUP)
    minimum = -(dmin * torch.from_numpy(m).float()).reshape(rows, cols // GROUP)
    return Int4Groups(torch.from_numpy(codes).contiguous(), scale, minimum + 8 * scale, minimum)


def q5_0_codes(raw: RawQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0's codes as int8 (q - 16, in -16..15) [rows, cols] and its scales d [rows, cols / 32]."""
    rows, cols = raw.shape
    blocks = _blocks(raw, 22)
    qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")  # [rows, groups, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4  # bit j -> element j
    codes = (_nibbles(blocks[..., 6:]).numpy() | high).astype(np.int8) - 16
    return torch.from_numpy(codes.reshape(rows, cols)).contiguous(), _f16(blocks, 0)


def as_q8_0(raw: RawQuant) -> RawQuant:
    """A Q5_0 tensor as Q8_0 blocks with the same values (each code widened to a byte, d kept),
    so shards of both types can be stacked into one linear without leaving their stored codes."""
    if raw.tensor_type == Q.Q8_0:
        return raw
    assert raw.tensor_type == Q.Q5_0, raw.type_name
    rows, cols = raw.shape
    codes, _ = q5_0_codes(raw)
    d = _blocks(raw, 22)[..., 0:2]
    blocks = np.concatenate([d, codes.numpy().view(np.uint8).reshape(rows, cols // GROUP, GROUP)], axis=-1)
    return RawQuant(Q.Q8_0, np.ascontiguousarray(blocks.reshape(rows, -1)), raw.shape)


def quantize_int4(values: torch.Tensor) -> Int4Groups:
    """Asymmetric 4-bit per group of 32: codes 0 and 15 land on the group's min and max."""
    rows, cols = values.shape
    grouped = values.float().reshape(rows, cols // GROUP, GROUP)
    lo, hi = grouped.amin(-1), grouped.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((grouped - lo[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Int4Groups(codes.reshape(rows, cols), scale, lo + 8 * scale)


def int8_groups(weight: torch.Tensor | RawQuant) -> tuple[Int8Groups, bool]:
    """The Int8Groups of `weight`, and whether they are exact (read from Q8_0 or Q5_0 blocks)."""
    if isinstance(weight, RawQuant) and weight.tensor_type == Q.Q5_0:
        return Int8Groups(*q5_0_codes(weight)), True
    if isinstance(weight, RawQuant) and weight.tensor_type == Q.Q8_0:
        rows, cols = weight.shape
        blocks = _blocks(weight, 34)
        codes = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8)).reshape(rows, cols)
        return Int8Groups(codes.contiguous(), _f16(blocks, 0)), True
    values = weight.dequantize() if isinstance(weight, RawQuant) else weight.float()
    rows, cols = values.shape
    grouped = values.reshape(rows, cols // GROUP, GROUP)
    scale = grouped.abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (grouped / safe[..., None]).round().clamp(-127, 127).to(torch.int8)
    return Int8Groups(codes.reshape(rows, cols), scale), False


def int8_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (codes [rows, cols] int8, scale [rows] float32)."""
    scale = values.float().abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (values.float() / safe[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, scale


def as_float(weight: torch.Tensor | RawQuant) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, RawQuant) else weight.float()
