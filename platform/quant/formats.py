"""Grouped low-bit weights: the in-memory forms the fast kernels are fed from.

A weight reaches a layer either as a float tensor (safetensors, random presets, F32/F16 GGUF
tensors, or any type under `--quantization none`) or as a `RawQuant`: the stored GGUF blocks of
one tensor, untouched. From either a layer asks for the form its kernel needs:

- `Int4Groups`: codes 0..15 with, per row and group of 32 inputs, `value = (code - 8) * scale
  + zero`. Q4_0 (`d * (q - 8)`) and Q4_1 (`d * q + m`, so zero = m + 8 d) are read exactly from
  their blocks; anything else is re-quantized from its float values (min/max per group, which
  for llama.cpp's Q4_1, whose groups always span codes 0 and 15, gives back the same codes).
- `Int8Groups`: int8 codes with one float scale per row and group of 32: `value = q * scale`,
  which is Q8_0 exactly; other types are re-quantized (absmax per group).
- `int8_rows`: int8 codes with one scale per row (absmax), for the per-channel int8 kernel.

GGUF block layouts (ggml-common.h): Q4_0 = f16 d | 16 bytes, element j in the low nibble of
byte j and element j + 16 in its high nibble; Q4_1 = f16 d | f16 m | 16 bytes, same nibbles;
Q8_0 = f16 d | 32 int8.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def permute_rows(self, order: torch.Tensor) -> "RawQuant":
        return RawQuant(self.tensor_type, self.blocks[order.numpy()], self.shape)


@dataclass
class Int4Groups:
    codes: torch.Tensor   # [rows, cols] uint8 in 0..15
    scale: torch.Tensor   # [rows, cols // 32] float32
    zero: torch.Tensor    # [rows, cols // 32] float32

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        grouped = (self.codes.view(rows, cols // GROUP, GROUP).float() - 8) * self.scale[..., None] + self.zero[..., None]
        return grouped.view(rows, cols)


@dataclass
class Int8Groups:
    codes: torch.Tensor   # [rows, cols] int8
    scale: torch.Tensor   # [rows, cols // 32] float32

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        return (self.codes.view(rows, cols // GROUP, GROUP).float() * self.scale[..., None]).view(rows, cols)


def _blocks(raw: RawQuant, block_bytes: int) -> np.ndarray:
    rows, cols = raw.shape
    return raw.blocks.reshape(rows, cols // GROUP, block_bytes)


def _f16(blocks: np.ndarray, offset: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.from_numpy(np.concatenate([qs & 0x0F, qs >> 4], axis=-1))


def int4_groups(weight: torch.Tensor | RawQuant) -> tuple[Int4Groups, bool]:
    """The Int4Groups of `weight`, and whether they are exact (read from Q4_0/Q4_1 blocks)."""
    if isinstance(weight, RawQuant) and weight.tensor_type in (Q.Q4_0, Q.Q4_1):
        rows, cols = weight.shape
        is_q4_1 = weight.tensor_type == Q.Q4_1
        blocks = _blocks(weight, 20 if is_q4_1 else 18)
        d = _f16(blocks, 0)
        zero = (_f16(blocks, 2) + 8 * d) if is_q4_1 else torch.zeros_like(d)
        codes = _nibbles(blocks[..., 4 if is_q4_1 else 2:]).reshape(rows, cols)
        return Int4Groups(codes.contiguous(), d, zero), True
    values = weight.dequantize() if isinstance(weight, RawQuant) else weight.float()
    return quantize_int4(values), False


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
    """The Int8Groups of `weight`, and whether they are exact (read from Q8_0 blocks)."""
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
