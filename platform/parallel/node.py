"""A tensor-parallel group over several nodes: rank 0's links to the other nodes here, and the
agent that runs a node's ranks (`splitserve worker --nnodes N --node-rank K`, K > 0) in agent.py.

    node 0 (the leader, the pool member the router and the KV peers talk to):
        rank 0 in the worker's process, ranks 1..R-1 spawned as on one node (executor.py),
        and a listener on master_addr:master_port+1 for the other nodes' agents
    node K > 0:
        the agent dials the leader, names its node rank, receives the RankSpec, spawns ranks
        K*R .. K*R+R-1 with its own shared-memory channel (channel.py), reports their hello
        (then rank 0 opens the group's store) and their ready, then relays every message the
        leader sends to its ranks, until Stop

R = ranks per node. The ranks of every node join one torch.distributed group at
master_addr:master_port (rank 0 serves its store), so the forward's collectives span the nodes;
only the plans travel over these links, each pickled once by rank 0 and relayed as bytes.

Failure, either way within about a second: rank 0's watchdog polls each link, and a link that
closes (an agent or its node gone) or reports an error takes the group down; an agent whose
link to the leader closes (rank 0 gone, or the group taken down) SIGKILLs its ranks and exits
non-zero, and so does an agent one of whose ranks died.

Trust: the links, like torch.distributed's own store and gloo sockets, carry no authentication,
so the group's ports must be reachable only by the group's pods (docs/security.md). The leader
never unpickles what an agent sends: agents answer in JSON. An agent unpickles what the leader
it was configured with sends, as every rank does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import socket
import time
from multiprocessing.connection import Connection

from splitserve.platform.errors import ConfigError

log = logging.getLogger(__name__)

POLL_S = 0.5


def link_port(master_port: int) -> int:
    """The leader's port for the node agents: the one after the group's store."""
    return master_port + 1


def say(link: Connection, kind: str, **fields) -> None:
    link.send_bytes(json.dumps({"kind": kind, **fields}).encode())


def _hear(link: Connection) -> dict:
    """An agent's JSON message (the leader never unpickles an agent's bytes)."""
    message = json.loads(link.recv_bytes(64 * 1024))
    if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
        raise ConfigError(f"a node agent sent {message!r}; expected a JSON object with a kind")
    return message


class NodeLinks:
    """Rank 0's side: one link per other node, in node-rank order."""

    def __init__(self, addr: str, master_port: int, nnodes: int):
        self.nnodes = nnodes
        self.links: list[Connection] = []
        self._listener = socket.create_server((addr, link_port(master_port)), backlog=nnodes)

    def accept(self, spec, timeout: float) -> None:
        """Wait for every other node's agent; send each the RankSpec template."""
        deadline = time.monotonic() + timeout
        by_rank: dict[int, Connection] = {}
        while len(by_rank) < self.nnodes - 1:
            self._listener.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                raise ConfigError(
                    f"{self.nnodes - 1 - len(by_rank)} of the group's other nodes did not connect within "
                    f"{timeout:.0f} s (is `splitserve worker --node-rank K` running there, with this --master-addr?)"
                ) from None
            sock.setblocking(True)
            link = Connection(sock.detach())
            node = self._hello(link)
            if node is None or node in by_rank:
                link.close()
                continue
            link.send_bytes(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
            by_rank[node] = link
        self.links = [by_rank[k] for k in sorted(by_rank)]
        self._listener.close()

    def _hello(self, link: Connection) -> int | None:
        """The node rank a connecting agent names, or None (logged) if it is not a valid hello."""
        try:
            hello = _hear(link) if link.poll(10.0) else {}
        except (ValueError, ConfigError, EOFError, OSError) as exc:
            hello = {"unreadable": str(exc)}
        node = hello.get("node_rank")
        if hello.get("kind") == "node" and isinstance(node, int) and 0 < node < self.nnodes:
            return node
        log.warning("tensor-parallel leader: refused a connection that sent %r (not a node agent's hello)", hello)
        return None

    def collect(self, kind: str, timeout: float) -> list:
        """Each node's next message, which must be `kind`; their `detail` fields, in node order."""
        details = []
        deadline = time.monotonic() + timeout
        for node, link in enumerate(self.links, start=1):
            if not link.poll(max(0.0, deadline - time.monotonic())):
                raise ConfigError(f"tensor-parallel node {node} did not report {kind} within {timeout:.0f} s")
            message = _hear(link)
            if message["kind"] == "error":
                raise ConfigError(f"tensor-parallel node {node} failed: {message.get('detail')}")
            if message["kind"] != kind:
                raise ConfigError(f"tensor-parallel node {node} sent {message['kind']!r}, expected {kind!r}")
            details.append(message.get("detail"))
        return details

    def forward(self, payload: bytes) -> None:
        for link in self.links:
            link.send_bytes(payload)

    def problem(self) -> str | None:
        """Why a node is gone (its link closed, or it reported an error), or None."""
        for node, link in enumerate(self.links, start=1):
            try:
                if link.poll(0):
                    return f"node {node}: {_hear(link).get('detail', 'sent a message out of turn')}"
            except (EOFError, OSError, ValueError, ConfigError):
                return f"node {node}'s link closed (its agent or its node is gone)"
        return None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        for link in self.links:
            with contextlib.suppress(OSError):
                link.close()
