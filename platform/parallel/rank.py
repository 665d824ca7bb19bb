"""A rank > 0 of a tensor-parallel group: build its shard, then run the forwards rank 0 sends.

    hello -> join the group -> load this rank's shard of the weights, allocate its KV heads
    (rank 0's number of blocks: the block ids of every plan are rank 0's) -> ready
    -> loop: next message; Stop ends it, a StepMessage runs ModelRunner.follow (the forward and
       the collectives of that step, no sampling), a KV transfer's KVWrites or KVGather runs
       HeadShards.follow (engine/kv_parallel.py: this rank's heads scattered to it or gathered)

Anything that goes wrong ends the process with a non-zero code (rank 0's watchdog then takes
the group down). A thread checks every second that rank 0's process still exists, so a rank
never outlives it, even while blocked in a collective.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from multiprocessing.connection import Connection

import torch

from splitserve.platform.parallel.channel import PlanReceiver, RankGoneError
from splitserve.platform.parallel.executor import RankSpec, Stop, rank_device
from splitserve.platform.parallel.group import close_group, init_group

log = logging.getLogger(__name__)


def main(argv: list[str]) -> None:
    """`python -m splitserve.platform.parallel.rank FD`: FD is this rank's end of rank 0's pipe."""
    conn = Connection(int(argv[1]))
    rank_main(conn.recv(), conn)


def rank_main(spec: RankSpec, conn) -> None:
    """Serve as rank spec.rank until told to stop; never returns (the process exits)."""
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    receiver = PlanReceiver(conn, spec.segment_name)
    try:
        torch.set_num_threads(spec.num_threads)
        receiver.reply(("hello", spec.rank))
        device = rank_device(spec.config.device.device, spec.rank % spec.config.parallel.ranks_per_node)
        group = init_group(spec.rank, spec.size, spec.master_addr, spec.master_port, device)
        runner, wants_graphs = build_runner(spec, group, device)
        receiver.reply(("ready", sum(p.nbytes for p in runner.model.parameters())))
    except BaseException as exc:
        receiver.reply(("error", f"{type(exc).__name__}: {exc}"))
        os._exit(1)
    if wants_graphs:  # in lockstep with rank 0's capture: the same buckets, the same collectives
        runner.enable_decode_graphs(spec.config.scheduler.max_num_seqs, spec.max_model_len, capture=True)
    _serve(receiver, runner, parent)


def _serve(receiver: PlanReceiver, runner, parent: int) -> None:
    from splitserve.platform.engine.runner import StepMessage

    code = 0
    try:
        while True:
            message = receiver.recv(lambda: os.getppid() == parent)
            if isinstance(message, Stop):
                break
            if isinstance(message, StepMessage):
                runner.follow(message)
            else:  # a KV transfer's writes or gather (engine/kv_parallel.py)
                runner.kv_shards.follow(message)
    except RankGoneError:
        code = 1
    except BaseException:
        log.exception("tensor-parallel rank failed")
        code = 1
    finally:
        receiver.close()
        if code == 0:
            close_group()
    os._exit(code)


def build_runner(spec: RankSpec, group, device: torch.device):
    """This rank's model shard, KV cache and runner, as LLMEngine builds rank 0's, and whether
    it captures decode graphs."""
    from splitserve.platform.config import resolve_kv_cache_dtype
    from splitserve.platform.engine.cuda_graphs import uses_decode_graphs
    from splitserve.platform.engine.kv_parallel import HeadShards
    from splitserve.platform.engine.model_loader import DTYPES, load_model
    from splitserve.platform.engine.runner import ModelRunner
    from splitserve.platform.kv.cache import allocate_kv_cache
    from splitserve.platform.kv.groups import plan_layout
    from splitserve.platform.lora.adapter import read_adapter
    from splitserve.platform.lora.batch import attach as attach_lora
    from splitserve.platform.model_source import resolve_model
    from splitserve.platform.parallel.layout import ShardLayout
    from splitserve.platform.weights import load_model_config

    config = spec.config
    dtype = DTYPES[config.device.dtype]
    kv_dtype = DTYPES[resolve_kv_cache_dtype(config.device, "none")]
    source = resolve_model(config.model)
    model_config = load_model_config(source)
    model = load_model(config, source, model_config, "none", dtype, kv_dtype, device, group=group)
    local = ShardLayout(model_config, group.rank, group.size).local_model_config()
    block_size = config.cache.block_size
    kv_layout = plan_layout(local)  # the KV groups, as rank 0 plans them (kv/groups.py)
    kv_caches = allocate_kv_cache(local, spec.num_blocks, block_size, kv_dtype, device, kv_layout)
    lora_context, layout = attach_lora(model)
    runner = ModelRunner(model, kv_caches, block_size, device, lora_context)
    runner.layer_group = kv_layout.layer_group
    shard = ShardLayout(model_config, group.rank, group.size)
    runner.read_lora = lambda name, path: read_adapter(name, path, layout, config.lora.max_lora_rank, dtype, shard)
    runner.kv_shards = HeadShards(group, shard, kv_caches, device)
    return runner, uses_decode_graphs(config.device.enforce_eager, device)


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


if __name__ == "__main__":
    import sys

    main(sys.argv)
