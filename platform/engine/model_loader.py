"""Building an engine's model: from the config's source, or reusing one already loaded.

Tests and benchmarks share one model's weights between engines (`LLMEngine(config, model=...)`);
a model passed in must have been built with the quantization this engine's config resolves to.
The fast quantization modes also switch on the fused CPU kernels; "none" stays the torch
reference the correctness tests compare against.
"""

from __future__ import annotations

import logging
import time

import torch

from splitserve.platform.config import EngineConfig, ModelConfig
from splitserve.platform.errors import ConfigError
from splitserve.platform.kernels.cpu_ops import KV_DTYPES, fused_cpu_ops
from splitserve.platform.models import build_model
from splitserve.platform.parallel.group import SINGLE, TPGroup, building
from splitserve.platform.parallel.layout import ShardLayout
from splitserve.platform.quant.report import describe_kernels, weight_nbytes
from splitserve.platform.weights import iter_weights

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(
    config: EngineConfig,
    source,
    model_config: ModelConfig,
    quantization: str,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: torch.device,
    model: torch.nn.Module | None = None,
    group: TPGroup = SINGLE,
) -> torch.nn.Module:
    """The engine's model in eval mode, with the fused CPU kernels on where the mode takes them.
    `group`: this rank's tensor-parallel group; the model is built and loaded as its shard."""
    t0 = time.perf_counter()
    if model is not None and getattr(model, "quantization", "none") != quantization:
        raise ConfigError(
            f"the model passed in was built with quantization {model.quantization!r}, "
            f"this engine's config resolves to {quantization!r}"
        )
    if model is not None and group.is_parallel:
        raise ConfigError("a tensor-parallel engine cannot take a model passed in (each rank loads its shard)")
    if model is None:
        with building(group), torch.device(device):
            model = build_model(model_config, quantization).to(dtype)
        shard = None
        if group.is_parallel:
            layout = ShardLayout(model_config, group.rank, group.size)
            shard = lambda name: layout.slices(model.own_name(name))  # noqa: E731
        model.load_weights(
            iter_weights(
                source,
                model_config,
                dtype,
                device,
                seed=config.seed,
                keep_quantized=quantization != "none",
                shard=shard,
            )
        )
        if quantization != "none":
            log.info(
                "quantization %s: %s; weights resident %.0f MB",
                quantization,
                describe_kernels(model),
                weight_nbytes(model) / 1e6,
            )
        model = model.eval()
    if quantization != "none" and kv_dtype in KV_DTYPES:
        model.use_fused_ops(fused_cpu_ops(device, dtype))
    log.info("loaded %s in %.1f s", config.model, time.perf_counter() - t0)
    return model
