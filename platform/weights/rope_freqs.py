"""Recover Llama-3 RoPE scaling parameters from llama.cpp's `rope_freqs.weight` tensor.

Hugging Face describes Llama-3.1 scaling with four numbers (factor, low_freq_factor,
high_freq_factor, original_max_position_embeddings). llama.cpp's converter does not store them:
it writes, per rotary frequency f_i = theta^(-2i/d), the divisor it applies to that frequency:

    wavelen_i = 2*pi / f_i
    wavelen_i < orig / high        -> 1              (high frequencies are kept)
    wavelen_i > orig / low         -> factor         (low frequencies are slowed down)
    otherwise, with s_i = (orig / wavelen_i - low) / (high - low):
                                   -> 1 / ((1 - s_i) / factor + s_i)

So `factor` is the largest divisor, and in the medium band s_i = (1/r_i - 1/factor) /
(1 - 1/factor) is linear in x_i = orig / wavelen_i: s = a*x + b with a = 1/(high - low) and
b = -low/(high - low). Two medium points fix low and high; with fewer, Meta's values (1, 4)
are tried. Only orig/low and orig/high matter, so an unknown `orig` (8192 assumed) changes
the numbers but not the frequencies. The result is verified by recomputing the divisors; a
tensor that does not follow this shape is rejected rather than approximated.
"""

from __future__ import annotations

import math

import numpy as np

from splitserve.platform.config import RopeScaling
from splitserve.platform.errors import UnsupportedModelError

DEFAULT_ORIGINAL_CONTEXT = 8192
_RTOL = 1e-4


def llama3_divisors(scaling: RopeScaling, rope_theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as `rope_freqs.weight`."""
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / freqs
    orig = scaling.original_max_position_embeddings
    smooth = (orig / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    medium = 1.0 / ((1 - smooth) / scaling.factor + smooth)
    divisors = np.where(wavelen > orig / scaling.low_freq_factor, scaling.factor, medium)
    return np.where(wavelen < orig / scaling.high_freq_factor, 1.0, divisors)


def llama3_scaling_from_divisors(
    divisors: np.ndarray, rope_theta: float, head_dim: int, original_context: int | None = None
) -> RopeScaling | None:
    """The RopeScaling whose divisors equal `divisors`, or None when they are all 1."""
    divisors = np.asarray(divisors, dtype=np.float64).reshape(-1)
    if divisors.shape != (head_dim // 2,):
        raise UnsupportedModelError(
            f"rope_freqs.weight has {divisors.size} values, expected head_dim/2 = {head_dim // 2}"
        )
    factor = float(divisors.max())
    if np.allclose(divisors, 1.0, rtol=0, atol=_RTOL):
        return None
    orig = original_context or DEFAULT_ORIGINAL_CONTEXT
    low, high = _fit_band(divisors, factor, rope_theta, head_dim, orig)
    scaling = RopeScaling(
        rope_type="llama3",
        factor=_tidy(factor),
        low_freq_factor=_tidy(low),
        high_freq_factor=_tidy(high),
        original_max_position_embeddings=orig,
    )
    if not np.allclose(llama3_divisors(scaling, rope_theta, head_dim), divisors, rtol=_RTOL, atol=0):
        raise UnsupportedModelError(
            "rope_freqs.weight does not follow Llama-3 RoPE scaling; supported: Llama-3 (llama3) "
            f"frequency divisors; got {np.round(divisors, 4).tolist()}"
        )
    return scaling


def _fit_band(divisors: np.ndarray, factor: float, rope_theta: float, head_dim: int, orig: int) -> tuple[float, float]:
    """(low_freq_factor, high_freq_factor) from the divisors strictly between 1 and factor."""
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    x = orig * freqs / (2 * math.pi)
    medium = (divisors > 1 + _RTOL) & (divisors < factor * (1 - _RTOL))
    if medium.sum() < 2:
        return 1.0, 4.0
    smooth = (1 / divisors[medium] - 1 / factor) / (1 - 1 / factor)
    a, b = np.polyfit(x[medium], smooth, 1)
    low = -b / a
    return float(low), float(low + 1 / a)


def _tidy(value: float) -> float:
    """Round away float32 noise (0.99999994 -> 1.0) while keeping genuine fractions."""
    return float(f"{value:.5g}")
