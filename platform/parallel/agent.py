"""The agent of a tensor-parallel group's node K > 0 (`splitserve worker --nnodes N --node-rank K`):
dial the leader, run this node's ranks, relay the leader's steps to them (node.py says how the
group is laid out, and how failures end it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pickle
import socket
import time
from multiprocessing.connection import Connection, Pipe

from splitserve.platform.config import EngineConfig
from splitserve.platform.errors import ConfigError
from splitserve.platform.parallel.channel import PlanSender
from splitserve.platform.parallel.executor import START_TIMEOUT_S, Stop, collect, kill, spawn
from splitserve.platform.parallel.node import POLL_S, link_port, say

log = logging.getLogger(__name__)


def run_node(config: EngineConfig, timeout: float | None = None) -> int:
    """Run this node's ranks for the leader at master_addr until it stops them; the exit code."""
    parallel = config.parallel
    timeout = START_TIMEOUT_S if timeout is None else timeout
    link = _dial(parallel.master_addr, link_port(parallel.master_port), timeout)
    say(link, "node", node_rank=parallel.node_rank)
    spec = pickle.loads(link.recv_bytes())  # from the leader this node was configured with
    first = parallel.node_rank * parallel.ranks_per_node
    pipes = [Pipe() for _ in range(parallel.ranks_per_node)]
    sender = PlanSender([parent for parent, _ in pipes])
    procs = []
    try:
        for i, (parent, child) in enumerate(pipes):
            procs.append(spawn(child))
            child.close()
            parent.send(dataclasses.replace(spec, rank=first + i, segment_name=sender.segment_name))
        try:
            say(link, "hello", detail=collect(procs, sender.conns, "hello", timeout, first=first))
            say(link, "ready", detail=collect(procs, sender.conns, "ready", timeout, first=first))
        except ConfigError as exc:
            say(link, "error", detail=str(exc))
            return 1
        log.info("tensor-parallel node %d: ranks %d-%d ready", parallel.node_rank, first, first + len(procs) - 1)
        return _relay(link, sender, procs)
    finally:
        kill(procs)
        with contextlib.suppress(OSError):
            sender.close()
        link.close()


def _relay(link: Connection, sender: PlanSender, procs) -> int:
    """Forward the leader's messages to this node's ranks; 0 after Stop, 1 if anything broke."""
    while True:
        try:
            ready = link.poll(POLL_S)
            payload = link.recv_bytes() if ready else None
        except (EOFError, OSError):
            log.error("tensor-parallel node: the leader's link closed; ending this node's ranks")
            return 1
        if payload is not None:
            message = pickle.loads(payload)
            sender.send(message, inline=isinstance(message, Stop))
            if isinstance(message, Stop):
                for proc in procs:
                    with contextlib.suppress(Exception):
                        proc.wait(5.0)
                return 0
        dead = next((p for p in procs if p.poll() is not None), None)
        if dead is not None:
            with contextlib.suppress(OSError):
                say(link, "error", detail=f"rank pid {dead.pid} exited with code {dead.returncode}")
            return 1


def _dial(addr: str, port: int, timeout: float) -> Connection:
    """Connect to the leader's agent port, retrying while it starts."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((addr, port), timeout=5.0)
        except OSError as exc:
            if time.monotonic() > deadline:
                raise ConfigError(f"could not reach the tensor-parallel leader at {addr}:{port}: {exc}") from None
            time.sleep(0.5)
            continue
        sock.setblocking(True)
        return Connection(sock.detach())
