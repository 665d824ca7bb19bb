"""KV cache tensors and their sizing from a memory budget.

Per layer, K and V are each [num_blocks, block_size, num_kv_heads, head_dim]. A model with
several KV groups (kv/groups.py) allocates one such pair per slot (layers per group) and each
layer uses its slot's pair, so a pool block spans the layers of one group. The number of
blocks comes from the budget (`CacheConfig.kv_cache_memory_bytes`) divided by the bytes one
block takes across the layers it spans. Two operator mistakes are caught before anything is
allocated, with the numbers and the remedy: a budget larger than the free memory of the
device, and a budget too small to hold even one sequence of max_model_len tokens.
"""

from __future__ import annotations

import psutil
import torch

from splitserve.platform.config import CacheConfig, ModelConfig
from splitserve.platform.errors import ConfigError
from splitserve.platform.kv.groups import KVLayout

GiB = 1024**3
# Leave this share of free memory for activations, the allocator and everything else.
MEMORY_HEADROOM = 0.9


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype, layout: KVLayout | None = None) -> int:
    """Bytes of one pool block: K and V of block_size tokens in every layer a block spans (all
    layers; a group's layers under a multi-group `layout`)."""
    elem = torch.empty((), dtype=dtype).element_size()
    num_layers = model.num_layers if layout is None else layout.num_slots
    return 2 * num_layers * block_size * model.num_kv_heads * model.head_dim * elem


def free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def plan_num_blocks(
    cache: CacheConfig,
    model: ModelConfig,
    dtype: torch.dtype,
    max_model_len: int,
    device: torch.device,
    free_bytes: int | None = None,
    graph_bytes: int = 0,
    layout: KVLayout | None = None,
    chunk: int | None = None,
) -> int:
    """How many KV blocks to allocate, or ConfigError with the numbers and the remedy.

    `graph_bytes`: memory the decode CUDA graphs will take after the cache is allocated
    (engine/cuda_graphs.graph_memory_bytes); the cache and the graphs must fit together.
    `layout`/`chunk`: the model's KV groups and the most tokens a step computes per request
    (one sequence of max_model_len then needs layout.blocks_per_request blocks)."""
    per_block = bytes_per_block(model, cache.block_size, dtype, layout)
    # --num-blocks counts blocks of every layer; a grouped pool's blocks span one group's layers,
    # so the same memory holds num_layers / num_slots times as many
    scale = 1 if layout is None else model.num_layers // layout.num_slots
    num_blocks = (cache.num_blocks or 0) * scale or cache.kv_cache_memory_bytes // per_block
    want = num_blocks * per_block
    free = free_device_memory(device) if free_bytes is None else free_bytes
    if want + graph_bytes > free * MEMORY_HEADROOM:
        fits = max(0, int(free * MEMORY_HEADROOM) - graph_bytes) // per_block * per_block
        graphs = (
            f" plus {graph_bytes / GiB:.2f} GiB for the decode CUDA graphs (--enforce-eager: none)"
            if graph_bytes
            else ""
        )
        raise ConfigError(
            f"the KV cache needs {want / GiB:.2f} GiB ({num_blocks} blocks x {per_block} bytes){graphs} but "
            f"{device} has {free / GiB:.2f} GiB free; lower --kv-cache-memory to at most "
            f"{fits / GiB:.2f} GiB (or use a smaller dtype or model{', or --enforce-eager' if graph_bytes else ''})"
        )
    need_blocks = (
        -(-max_model_len // cache.block_size)
        if layout is None
        else layout.blocks_per_request(max_model_len, cache.block_size, chunk or max_model_len) + 1  # + the null block
    )
    if num_blocks < need_blocks:
        single = layout is None or layout.is_single
        tokens = f" = {num_blocks * cache.block_size} tokens" if single else ""
        shorter = f" to {num_blocks * cache.block_size}" if single else ""
        raise ConfigError(
            f"the KV cache holds {num_blocks} blocks{tokens} "
            f"({want / GiB:.3f} GiB), fewer than one sequence of max_model_len={max_model_len} tokens needs "
            f"({need_blocks} blocks, {need_blocks * per_block / GiB:.3f} GiB); raise --kv-cache-memory to at "
            f"least {need_blocks * per_block / GiB:.3f} GiB or lower --max-model-len{shorter}"
        )
    return num_blocks


def allocate_kv_cache(
    model: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    layout: KVLayout | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per decoder layer its (K, V) pair; under a multi-group `layout` layers of one slot share
    the pair (each reads it through its own group's block ids)."""
    shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
    num_pairs = model.num_layers if layout is None else layout.num_slots
    pairs = [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_pairs)
    ]
    return pairs if layout is None else [pairs[slot] for slot in layout.layer_slot]
