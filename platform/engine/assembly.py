"""How an LLMEngine is put together: size the KV cache, start the other tensor-parallel ranks,
load the weights and build the parts that `LLMEngine` wires (see llm_engine.py's docstring).

Two stages, because the ranks must start between them: `size()` reads the checkpoint's config
and plans the KV budget (no weights yet), then `assemble()` starts the ranks, loads rank 0's
shard and builds the scheduler, runner and processors over one block pool. A failure in either
stage ends the ranks it started and restores torch's thread count before it raises.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from splitserve.platform.config import EngineConfig, ModelConfig, resolve_kv_cache_dtype
from splitserve.platform.engine.cuda_graphs import decode_graph_bytes, uses_decode_graphs
from splitserve.platform.engine.input_processor import InputProcessor
from splitserve.platform.engine.kv_connector import KVConnector
from splitserve.platform.engine.kv_parallel import TPKVConnector
from splitserve.platform.engine.model_loader import DTYPES, load_model
from splitserve.platform.engine.output_processor import OutputProcessor
from splitserve.platform.engine.runner import ModelRunner
from splitserve.platform.hashing import BlockHasher
from splitserve.platform.kv.block_pool import BlockPool
from splitserve.platform.kv.cache import allocate_kv_cache, bytes_per_block, plan_num_blocks
from splitserve.platform.kv.grouped import GroupedKVCacheManager
from splitserve.platform.kv.groups import KVLayout, describe, plan_layout
from splitserve.platform.kv.manager import KVCacheManager
from splitserve.platform.kv.tier import attach_tier
from splitserve.platform.lora.batch import attach as attach_lora
from splitserve.platform.lora.registry import LoraRegistry
from splitserve.platform.model_source import resolve_model
from splitserve.platform.models.features import family_quantization, lora_refusal
from splitserve.platform.parallel.executor import TPExecutor
from splitserve.platform.parallel.group import SINGLE
from splitserve.platform.parallel.layout import ShardLayout, check_tensor_parallel
from splitserve.platform.quant import resolve_quantization
from splitserve.platform.sched.scheduler import Scheduler
from splitserve.platform.spec.speculator import Speculator
from splitserve.platform.tokenizer import load_tokenizer
from splitserve.platform.weights import load_model_config

__all__ = ["EngineParts", "Sizing", "assemble", "size"]

log = logging.getLogger(__name__)


@dataclass
class Sizing:
    """What the checkpoint's config and the flags decide before any weight is read."""

    source: object  # model_source.ModelSource
    model_config: ModelConfig
    local_config: ModelConfig  # rank 0's share: its KV heads under tensor parallelism
    device: torch.device
    dtype: torch.dtype
    quantization: str
    kv_cache_dtype: str
    kv_dtype: torch.dtype
    tokenizer: object  # None for a random-weight model without one
    eos_token_ids: frozenset[int]
    max_model_len: int
    num_blocks: int
    kv_layout: KVLayout  # the KV groups (kv/groups.py): one for most models
    chunk: int  # the most tokens one step computes for a request (the scheduler's token budget)


@dataclass
class EngineParts:
    """Everything LLMEngine holds; each field becomes the engine attribute of the same name."""

    sizing: Sizing
    executor: TPExecutor | None  # the other ranks; None for one process
    threads_before: int | None  # torch's thread count to restore on close
    model: torch.nn.Module
    pool: BlockPool
    kv: KVCacheManager | GroupedKVCacheManager
    hasher: BlockHasher
    scheduler: Scheduler
    kv_tier: object
    loras: LoraRegistry
    runner: ModelRunner
    kv_connector: KVConnector
    inputs: InputProcessor
    outputs: OutputProcessor
    speculator: Speculator | None


def size(config: EngineConfig) -> Sizing:
    """Read the checkpoint's config and tokenizer, resolve the dtypes and plan the KV blocks."""
    tp = config.parallel.tensor_parallel_size
    device = torch.device(config.device.device)
    dtype = DTYPES[config.device.dtype]
    source = resolve_model(config.model)
    model_config: ModelConfig = load_model_config(source)
    # "auto" picks the best mode that runs here; under tensor parallelism that is "none"
    # (the packed CPU modes have no sharded form; asking for one by name is refused below).
    mode = "none" if tp > 1 and config.device.quantization == "auto" else config.device.quantization
    quantization = family_quantization(model_config, config, resolve_quantization(mode, config.device.device))
    kv_cache_dtype = resolve_kv_cache_dtype(config.device, quantization)
    kv_dtype = DTYPES[kv_cache_dtype]
    tokenizer = load_tokenizer(config.model)
    eos = tokenizer.eos_token_ids if tokenizer is not None else model_config.eos_token_ids
    max_model_len = min(
        config.scheduler.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings
    )
    check_tensor_parallel(model_config, config.parallel, config.device.device, quantization)
    local_config = ShardLayout(model_config, 0, tp).local_model_config()
    graph_bytes = decode_graph_bytes(
        config.device.enforce_eager, device, model_config, config.scheduler.max_num_seqs, dtype
    )
    layout = plan_layout(local_config)
    chunk = config.scheduler.resolved(max_model_len).max_num_batched_tokens
    num_blocks = plan_num_blocks(
        config.cache, local_config, kv_dtype, max_model_len, device, graph_bytes=graph_bytes,
        layout=None if layout.is_single else layout, chunk=chunk,
    )  # fmt: skip
    return Sizing(
        source, model_config, local_config, device, dtype, quantization, kv_cache_dtype, kv_dtype, tokenizer,
        frozenset(eos), max_model_len, num_blocks, layout, chunk,
    )  # fmt: skip


def assemble(config: EngineConfig, model: torch.nn.Module | None = None) -> EngineParts:
    """Size, start the ranks, load and build; `model`: weights already loaded for the same
    config.model, dtype and device (tests and benchmarks share them between engines)."""
    if config.device.num_threads:
        torch.set_num_threads(config.device.num_threads)
    tp = config.parallel.tensor_parallel_size
    threads_before = None
    if tp > 1 and not config.device.num_threads and config.device.device == "cpu":
        threads_before = torch.get_num_threads()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))  # the node's cores split over its ranks
    executor = None
    try:
        sizing = size(config)
        # Under tensor parallelism the other ranks start now and load their shards while rank 0
        # loads its own (parallel/executor.py).
        executor = TPExecutor(config, sizing.num_blocks, sizing.max_model_len) if tp > 1 else None
        return _build(config, sizing, executor, threads_before, model)
    except BaseException:
        if executor is not None:
            executor.close()
        if threads_before is not None:
            torch.set_num_threads(threads_before)
        raise


def _build(config: EngineConfig, sizing: Sizing, executor, threads_before, model) -> EngineParts:
    """Load the weights (rank 0's shard under tensor parallelism) and build what runs them."""
    if executor is not None:
        sizing.device = executor.device
    s = sizing
    loaded = load_model(
        config, s.source, s.model_config, s.quantization, s.dtype, s.kv_dtype, s.device, model,
        executor.group if executor is not None else SINGLE,
    )  # fmt: skip
    if executor is not None:
        executor.wait_ready()
    block_size = config.cache.block_size
    kv_layout = s.kv_layout
    # a grouped cache sets its first block aside as the null block (kv/grouped.py)
    pool = BlockPool(
        s.num_blocks - (not kv_layout.is_single),
        enable_caching=config.cache.enable_prefix_caching,
        null_block=not kv_layout.is_single,
    )
    kv = KVCacheManager(pool, block_size) if kv_layout.is_single else GroupedKVCacheManager(pool, block_size, kv_layout)
    block_bytes = bytes_per_block(s.local_config, block_size, s.kv_dtype, kv_layout)
    log.info("%s", describe(kv_layout, s.num_blocks, block_size, block_bytes, s.max_model_len, s.chunk))
    hasher = BlockHasher(s.model_config.model_id, block_size)
    scheduler = Scheduler(config.scheduler, kv, s.max_model_len, max_loras=config.lora.max_loras)
    kv_caches = allocate_kv_cache(s.local_config, s.num_blocks, block_size, s.kv_dtype, s.device, kv_layout)
    lora_context, layout = attach_lora(loaded)
    tp = config.parallel.tensor_parallel_size
    loras = LoraRegistry(config.lora, layout, s.dtype, ShardLayout(s.model_config, 0, tp) if tp > 1 else None)
    loras.refusal = lora_refusal(s.model_config)
    loras.load_modules()
    runner = ModelRunner(loaded, kv_caches, block_size, s.device, lora_context)
    runner.executor = executor
    runner.layer_group = kv_layout.layer_group
    if uses_decode_graphs(config.device.enforce_eager, s.device) and kv_layout.is_single:
        runner.enable_decode_graphs(config.scheduler.max_num_seqs, s.max_model_len, capture=True)
    elif not kv_layout.is_single:
        log.info("CUDA graphs for decode are off: the model has %d KV groups (kv/groups.py)", len(kv_layout.groups))
    if executor is None:
        kv_connector = KVConnector(kv_caches, kv, block_size, s.device)
    else:  # full-head payloads in and out; each rank's heads gathered and scattered (kv_parallel.py)
        kv_connector = TPKVConnector(kv_caches, kv, block_size, s.device, executor, ShardLayout(s.model_config, 0, tp))
    if not kv_layout.is_single:
        kv_connector.kv_layout, kv_connector.layer_group = kv_layout, kv_layout.layer_group
    copier = kv_connector if executor is not None else None  # a tier under TP keeps every rank's heads
    kv_tier = attach_tier(config.kv_tier, pool, kv, kv_caches, s.model_config.model_id, copier)
    inputs = InputProcessor(
        config.model, s.model_config, s.tokenizer, s.max_model_len, hasher, s.eos_token_ids, loras, kv_connector,
        s.device, on_grammars=lambda backend: setattr(runner.sampler, "stats", backend.stats),
    )  # fmt: skip
    speculator = Speculator(config.speculative, s.max_model_len) if config.speculative else None
    return EngineParts(
        sizing, executor, threads_before, loaded, pool, kv, hasher, scheduler, kv_tier, loras, runner, kv_connector,
        inputs, OutputProcessor(s.tokenizer), speculator,
    )  # fmt: skip
