"""MXFP4 expert weights (gpt-oss checkpoints), dequantized on load.

A released gpt-oss checkpoint stores each expert projection `P` as two uint8 tensors:
`P_blocks` [experts, out, groups, 16] (32 FP4 E2M1 codes per group, two per byte, low nibble
first) and `P_scales` [experts, out, groups] (one shared power of two per group, biased by 127).
A value is FP4_VALUES[code] * 2 ** (scale - 127), which is exact in any float dtype that holds
the exponent range. The model takes the float projection as the bf16 release stores it,
[experts, in, out] (the transpose of the packed rows), under the name `P`.

`join_mxfp4(stream, dtype)` passes every other tensor through and yields `P` as soon as both of
its halves have arrived (safetensors streams them in any order); a half left alone at the end
is a clear error.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from splitserve.platform.errors import ConfigError

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
_SUFFIXES = ("_blocks", "_scales")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> values [..., G * 32] in `dtype`."""
    if blocks.shape[:-1] != scales.shape:
        raise ConfigError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    values = torch.empty(*blocks.shape[:-1], blocks.shape[-1] * 2, dtype=dtype, device=blocks.device)
    values[..., 0::2] = lut[(blocks & 0x0F).long()]
    values[..., 1::2] = lut[(blocks >> 4).long()]
    exponents = scales.to(torch.int32)[..., None] - SCALE_BIAS
    return torch.ldexp(values, exponents).to(dtype).flatten(-2)


def join_mxfp4(stream: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with each `P_blocks` + `P_scales` pair replaced by `P` [experts, in, out]."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        if not name.endswith(_SUFFIXES):
            yield name, tensor
            continue
        base, half = name[: -len("_blocks")], name[-len("blocks") :]
        pending.setdefault(base, {})[half] = tensor
        if len(pending[base]) == 2:
            parts = pending.pop(base)
            yield base, dequantize(parts["blocks"], parts["scales"], dtype).transpose(-1, -2).contiguous()
    if pending:
        base, parts = next(iter(pending.items()))
        missing = ({"blocks", "scales"} - parts.keys()).pop()
        raise ConfigError(f"MXFP4 tensor {base}_{missing} is missing (its other half is in the checkpoint)")
