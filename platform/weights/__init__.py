"""Weight loading: a ModelConfig and a stream of HF-named tensors from any ModelSource.

    config = load_model_config(source)
    for name, tensor in iter_weights(source, config, torch.bfloat16, "cuda"):
        model.load_weight(name, tensor)      # the caller owns each tensor it receives

Sources: "gguf" (gguf.py), "hf" folders (hf.py), "random" presets (presets.py,
random_weights.py). Whatever the source, `iter_weights` yields exactly the names and shapes
of `expected_weight_shapes(config)` (names.py), one tensor at a time, already in `dtype` on
`device`, and raises ConfigError / UnsupportedModelError as soon as something does not fit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from splitserve.platform.config import ModelConfig
from splitserve.platform.errors import ConfigError
from splitserve.platform.model_source import ModelSource
from splitserve.platform.parallel.layout import Slices, cut
from splitserve.platform.weights.gguf import iter_gguf_weights, load_gguf_config
from splitserve.platform.weights.hf import iter_hf_weights, load_hf_config
from splitserve.platform.weights.mxfp4 import join_mxfp4
from splitserve.platform.weights.names import check_weights, expected_weight_shapes
from splitserve.platform.weights.presets import PRESETS, preset_config
from splitserve.platform.weights.random_weights import iter_random_weights

__all__ = ["PRESETS", "expected_weight_shapes", "iter_weights", "load_model_config"]


def load_model_config(source: ModelSource) -> ModelConfig:
    """The model's shape, from GGUF metadata, config.json or the preset; reads no tensor data."""
    if source.kind == "gguf":
        return load_gguf_config(source.path, source.model_id)
    if source.kind == "hf":
        return load_hf_config(source.path, source.model_id)
    if source.kind == "random":
        return preset_config(source.preset, source.model_id)
    raise ConfigError(f"model source kind {source.kind!r} is not supported; allowed: gguf, hf, random")


def iter_weights(
    source: ModelSource,
    config: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    keep_quantized: bool = False,
    shard: Callable[[str], Slices | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every weight of `config`, one at a time, in `dtype` on `device`.

    `config` is what `load_model_config(source)` returned. `seed` only matters for random
    sources. Nothing is read until the iterator is advanced; each yielded tensor is new memory
    the caller may keep or drop. `keep_quantized` (GGUF only): quantized matrices come as
    their stored blocks (quant.formats.RawQuant) for the fast kernels to pack.
    `shard` (tensor parallelism, parallel/layout.py): the ranges of each tensor this rank keeps;
    safetensors reads only them, GGUF and random sources cut them after dequantizing or drawing
    the whole tensor (one tensor at a time, so the full model never exists in one rank).
    """
    if source.kind == "hf":
        tensors = join_mxfp4(iter_hf_weights(source.path, config, dtype, device, shard), dtype)
    else:
        if source.kind == "gguf":
            tensors = iter_gguf_weights(source.path, config, dtype, device, keep_quantized)
        elif source.kind == "random":
            tensors = iter_random_weights(config, dtype, device, seed)
        else:
            raise ConfigError(f"model source kind {source.kind!r} is not supported; allowed: gguf, hf, random")
        if shard is not None:
            tensors = ((name, cut(tensor, shard(name))) for name, tensor in tensors)
    return check_weights(tensors, config, source.path or source.model_id, shard)
