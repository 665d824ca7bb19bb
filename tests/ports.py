"""Ports for the servers the tests start.

A port from bind(("127.0.0.1", 0)) is in the kernel's ephemeral range: once the probe socket is
closed, any process's next outgoing connection may take it before the server the test starts
binds it ("Address already in use"), and with two xdist workers the suite makes twice as many
connections. So the tests hand out ports below that range, where the kernel never picks one on
its own, each xdist worker from its own block (Ray's worker processes keep to 10002-19999, so
the blocks start at 20000), in turn, skipping any port something already holds.
"""

from __future__ import annotations

import itertools
import os
import socket

LOW = 20000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _block() -> range:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    high = max(_ephemeral_low(), LOW + 2000)
    size = (high - LOW) // max(workers, 1)
    return range(LOW + index * size, LOW + (index + 1) * size)


_BLOCK = _block()
# Start at a point set by the pid, so two suites on one host (a developer's run beside CI's) rarely meet.
_TURN = itertools.count(os.getpid() * 7919)


def free_port() -> int:
    """A loopback port no one holds now and that no other test or outgoing connection will take."""
    for _ in range(len(_BLOCK)):
        port = _BLOCK[next(_TURN) % len(_BLOCK)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_BLOCK}")
