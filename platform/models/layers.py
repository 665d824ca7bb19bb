"""Building blocks shared by the model families: RMSNorm, rotary embedding, fused linears.

Fused projections (q|k|v and gate|up) turn three and two matmuls into one each; their
`load_weight(shard, tensor)` copies a checkpoint tensor into its slice, so a layer owns the
mapping from checkpoint names to its own parameters.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from splitserve.platform.config import RopeScaling


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 like the reference."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = nn.functional.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


class MergedLinear(nn.Module):
    """One matmul for several projections of the same input; outputs are concatenated."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool):
        super().__init__()
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        self.weight = nn.Parameter(torch.empty(offset, in_features))
        self.bias = nn.Parameter(torch.zeros(offset)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def load_weight(self, shard: str, kind: str, tensor: torch.Tensor) -> None:
        start, size = self.shard_offsets[shard]
        target = self.weight if kind == "weight" else self.bias
        assert target is not None, f"checkpoint has a {shard} bias but the layer has none"
        assert tensor.shape[0] == size, f"{shard}.{kind}: expected {size} rows, got {tuple(tensor.shape)}"
        target.data[start:start + size].copy_(tensor)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies of rotary embedding, with Llama-3 or linear scaling if configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the rotate-half layout (Hugging Face convention).

    cos/sin are precomputed for every position up to max_position in float32 and gathered per
    token each step.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] cos and sin for the given positions, ready to broadcast over heads."""
        return (self.cos_cache[positions].unsqueeze(1).to(dtype),
                self.sin_cache[positions].unsqueeze(1).to(dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
