"""Rank 0's side of a tensor-parallel group: start the other ranks, ship each step, watch them.

Start (all before the engine serves):
  1. the caller has checked the sizes (layout.check_tensor_parallel): nothing starts on bad input;
  2. start ranks 1..tp-1, each a fresh interpreter (`python -m ...parallel.rank`, no forked
     torch state) with its end of a pipe; each gets its RankSpec, says hello, joins the group;
  3. rank 0 joins the group (init_group), loads its own shard, and waits until every rank has
     said ready (or reported the error that stopped it: raised here as ConfigError, all ranks
     ended).

Each step: `send_step` ships the runner's StepMessage over the channel (channel.py); every rank
then runs the same forward and the same collectives. Only rank 0 samples, on the gathered
logits, so there is one token stream and nothing on the other ranks can diverge.

Failure: a watchdog thread checks every WATCH_S that each rank is alive and not stopped (a
SIGSTOP shows as state T in /proc). A rank that died, or stayed stopped STOPPED_GRACE_S, takes
the group down: every rank is SIGKILLed (a stopped process ignores SIGTERM) and `failure` says
why; the step in flight fails in its collective (the peer's socket closes, or the collective
timeout of group.py trips) and every later step raises TensorParallelError at once. The ranks
watch rank 0 in turn (rank.py), so no rank outlives the engine's process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe

import torch

from splitserve.platform.config import EngineConfig
from splitserve.platform.errors import ConfigError, TensorParallelError
from splitserve.platform.parallel.channel import PlanSender
from splitserve.platform.parallel.group import TPGroup, close_group, init_group
from splitserve.platform.parallel.node import NodeLinks

log = logging.getLogger(__name__)

WATCH_S = 0.5
STOPPED_GRACE_S = 2.0
START_TIMEOUT_S = 600.0  # loading a large shard takes a while; a dead rank is noticed at once


@dataclass(frozen=True)
class RankSpec:
    """What a spawned rank needs to build its shard (all picklable)."""

    config: EngineConfig
    rank: int
    size: int
    master_addr: str
    master_port: int
    num_blocks: int
    max_model_len: int
    segment_name: str
    num_threads: int


@dataclass(frozen=True)
class Stop:
    """The message that ends a rank's loop."""


class TPExecutor:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int):
        parallel = config.parallel
        self.size = parallel.tensor_parallel_size
        self.device = rank_device(config.device.device, 0)
        addr = parallel.master_addr
        port = parallel.master_port or _free_port(addr)
        pipes = [Pipe() for _ in range(1, parallel.ranks_per_node)]
        self.sender = PlanSender([parent for parent, _ in pipes])
        threads = config.device.num_threads or max(1, (os.cpu_count() or 1) // parallel.ranks_per_node)
        self.procs: list[subprocess.Popen] = []
        self.failure: str | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, kill, self.procs)
        # the other nodes' agents (node.py); None on one node
        self.nodes = NodeLinks(addr, port, parallel.nnodes) if parallel.nnodes > 1 else None
        spec = RankSpec(config, 0, self.size, addr, port, num_blocks, max_model_len, "", threads)
        for rank, (parent, child) in enumerate(pipes, start=1):
            self.procs.append(spawn(child))
            child.close()
            parent.send(dataclasses.replace(spec, rank=rank, segment_name=self.sender.segment_name))
        try:
            if self.nodes is not None:
                self.nodes.accept(spec, START_TIMEOUT_S)
            self._collect("hello", timeout=START_TIMEOUT_S)
            self.group: TPGroup = init_group(0, self.size, addr, port, self.device)
        except BaseException:
            self.close()
            raise
        self._watchdog: threading.Thread | None = None
        self.rank_weight_bytes: list[int] = []  # ranks 1.. : their parameters' bytes, once ready

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_ready(self) -> None:
        """Block until every rank loaded its shard; ConfigError (all ranks ended) if one failed."""
        try:
            self.rank_weight_bytes = self._collect("ready", timeout=START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="splitserve-tp-watchdog", daemon=True)
        self._watchdog.start()

    def _collect(self, kind: str, timeout: float) -> list:
        """Each rank's next answer (the other nodes' ranks through their agents), which must be
        `kind`; their details in rank order."""
        details = collect(self.procs, self.sender.conns, kind, timeout)
        if self.nodes is not None:
            for node_details in self.nodes.collect(kind, timeout):
                details += node_details or []
        return details

    def send_step(self, message) -> None:
        """Ship one step to every rank; TensorParallelError if the group is down."""
        self.check()
        try:
            self._broadcast(message)
        except OSError as exc:
            self.fail(f"a rank's pipe broke ({exc})")
            self.check()

    def check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(f"the tensor-parallel group is down: {self.failure}")

    def _broadcast(self, message, inline: bool = False) -> None:
        """`message` to every local rank, and its bytes as they are to the other nodes' agents."""
        payload = self.sender.send(message, inline=inline)
        if self.nodes is not None:
            self.nodes.forward(payload)

    def fail(self, reason: str) -> None:
        """Take the group down: record why (the first reason wins) and SIGKILL every rank."""
        if self.failure is None:
            self.failure = reason
            log.error("tensor-parallel group down: %s; ending every rank", reason)
        kill(self.procs)
        if self.nodes is not None:
            self.nodes.close()  # each agent sees its link close and ends its node's ranks

    def _watch(self) -> None:
        stopped_since: dict[int, float] = {}
        while not self._closed and self.failure is None:
            if self.nodes is not None and (problem := self.nodes.problem()) is not None:
                self.fail(problem)
                return
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    self.fail(f"rank {rank} (pid {proc.pid}) exited with code {proc.returncode}")
                    return
                if _is_stopped(proc.pid):
                    since = stopped_since.setdefault(rank, time.monotonic())
                    if time.monotonic() - since >= STOPPED_GRACE_S:
                        self.fail(f"rank {rank} (pid {proc.pid}) is stopped and does not answer")
                        return
                else:
                    stopped_since.pop(rank, None)
            time.sleep(WATCH_S)

    def close(self) -> None:
        """End every rank (asked first, killed after 5 s) and leave the group; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.failure is None:
            with contextlib.suppress(OSError, ValueError):
                self._broadcast(Stop(), inline=True)
            deadline = time.monotonic() + 5.0
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, deadline - time.monotonic()))
        kill(self.procs)
        if self.nodes is not None:
            self.nodes.close()
        with contextlib.suppress(OSError):
            self.sender.close()
        close_group()


def spawn(child: Connection) -> subprocess.Popen:
    """A fresh interpreter running rank.py, its end of the pipe passed as an inherited fd (not
    multiprocessing's spawn, which re-runs the caller's __main__ module in the child)."""
    fd = child.fileno()
    return subprocess.Popen(
        [sys.executable, "-m", "splitserve.platform.parallel.rank", str(fd)], pass_fds=(fd,), close_fds=True
    )


def collect(procs: list[subprocess.Popen], conns: list[Connection], kind: str, timeout: float, first: int = 1) -> list:
    """Each spawned rank's next answer, which must be `kind`; their details in rank order
    (`first`: the rank number of procs[0], for the messages)."""
    details = []
    deadline = time.monotonic() + timeout
    for rank, (proc, conn) in enumerate(zip(procs, conns, strict=True), start=first):
        while not conn.poll(0.1):
            if proc.poll() is not None:
                raise ConfigError(f"tensor-parallel rank {rank} exited with code {proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise ConfigError(f"tensor-parallel rank {rank} did not report {kind} within {timeout:.0f} s")
        got, detail = conn.recv()
        if got == "error":
            raise ConfigError(f"tensor-parallel rank {rank} failed to start: {detail}")
        assert got == kind, f"rank {rank} sent {got!r}, expected {kind!r}"
        details.append(detail)
    return details


def kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every rank still running (a stopped one too) and reap it."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5.0)


def _is_stopped(pid: int) -> bool:
    """State T (stopped) or t (traced) in /proc/<pid>/stat; False where /proc is unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def rank_device(device: str, local_rank: int) -> torch.device:
    """Rank r of a node runs on cuda:r (one GPU per rank), or the CPU."""
    return torch.device("cuda", local_rank) if device.startswith("cuda") else torch.device("cpu")
