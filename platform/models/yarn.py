"""YaRN rotary scaling (gpt-oss, DeepSeek-V3) and the rotary table a 2026 family uses.

YaRN, as the reference computes it: with base frequencies f_i = theta ** (-2i / dim), the
dimensions that turn fewer than `beta_slow` times over the original context are interpolated
(f_i / factor), those turning more than `beta_fast` times keep f_i, and a linear ramp blends
the dimensions in between (the ramp's ends rounded outwards unless `truncate` is false). cos
and sin are then multiplied by the attention factor: `attention_factor` when the config gives
one, else 0.1 * ln(factor) + 1, or with DeepSeek's `mscale` / `mscale_all_dim` the ratio of
those two terms. DeepSeek also multiplies its softmax scale by mscale(factor, mscale_all_dim)
squared (`attention_mscale`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from splitserve.platform.config import ModelConfig, RopeScaling
from splitserve.platform.models.layers import RotaryEmbedding


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], attention factor) of YaRN over `dim` rotary dimensions."""
    factor = scaling.factor
    if scaling.attention_factor is not None:
        attention_factor = scaling.attention_factor
    elif scaling.mscale and scaling.mscale_all_dim:
        attention_factor = _mscale(factor, scaling.mscale) / _mscale(factor, scaling.mscale_all_dim)
    else:
        attention_factor = _mscale(factor)

    def correction_dim(rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of each dimension's original frequency
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    inv_freq = (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep
    return inv_freq, attention_factor


def attention_mscale(scaling: RopeScaling | None) -> float:
    """DeepSeek's factor on the softmax scale under YaRN (1 without `mscale_all_dim`)."""
    if scaling is None or scaling.rope_type != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    return _mscale(scaling.factor, scaling.mscale_all_dim) ** 2


class YarnRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding with YaRN's frequencies and its attention factor folded into cos/sin."""

    def __init__(self, dim: int, max_position: int, theta: float, scaling: RopeScaling):
        nn.Module.__init__(self)
        inv_freq, attention_factor = yarn_inv_freq(dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * attention_factor, persistent=False)


def rotary_for(config: ModelConfig, dim: int) -> RotaryEmbedding:
    """The rotary table over `dim` dimensions that `config`'s rope settings describe."""
    if config.rope_scaling is not None and config.rope_scaling.rope_type == "yarn":
        return YarnRotaryEmbedding(dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
    return RotaryEmbedding(dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
