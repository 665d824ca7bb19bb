"""Random weights of the right shape, for `random:<preset>` models.

Every tensor of `expected_weight_shapes(config)` is drawn straight into `dtype` on `device`
(an 8B model in bf16 is 16 GB; no float32 copy of the model ever exists): norms are ones,
matrices and biases normal(0, 0.02) like transformers' initializer. Each tensor has its own
generator seeded from a hash of (seed, name), so a tensor does not depend on which were drawn
before it. The same (seed, dtype, device type) always gives the same values; CPU and CUDA
generators differ, so CPU and GPU runs get different (equally valid) random models.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch

from splitserve.platform.config import ModelConfig
from splitserve.platform.weights.names import expected_weight_shapes

INIT_STD = 0.02


def iter_random_weights(
    config: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, random tensor in `dtype` on `device`) in `expected_weight_shapes` order."""
    device = torch.device(device)
    for name, shape in expected_weight_shapes(config).items():
        yield name, random_tensor(name, shape, dtype, device, seed)


def random_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int
) -> torch.Tensor:
    """The tensor `name` of the random model `seed` (a pure function of its arguments)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(tensor_seed(seed, name))
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, INIT_STD, generator=generator)


def tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one tensor. Hashed, not added: the CPU generator keeps only 32 bits."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63
