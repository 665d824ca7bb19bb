"""How each step's plan reaches the other ranks of rank 0's node: shared memory plus a pipe.

Rank 0 pickles the message once into one shared-memory segment and writes a 9-byte header (kind,
length) to each rank's pipe; a rank wakes on its pipe, copies the bytes out and unpickles. A
message larger than the segment, and every control message (start-up, stop), travels inline in
the pipe instead.

Why one segment is enough: rank 0 writes step k + 1 only after step k's forward, whose
all-reduces every rank joins only after it has read step k, so no rank can still be reading
when the segment is overwritten. The pipe also carries each rank's answers at start-up (ready,
or the error that stopped it).

A rank waits for its next message without a timeout (an idle engine sends none) but checks
every POLL_S that rank 0's process is still alive, and exits when it is not.
"""

from __future__ import annotations

import pickle
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

SEGMENT_BYTES = 8 * 1024**2  # a 512-token step of 64 long sequences pickles to well under 1 MiB
POLL_S = 0.5
_HEADER = struct.Struct("<cQ")


class RankGoneError(RuntimeError):
    """Rank 0's process is gone (or the pipe closed): this rank has nothing left to serve."""


@dataclass
class ChannelStats:
    """Messages sent and the seconds rank 0 spent pickling and writing them (reset by the reader)."""

    num_messages: int = 0
    num_bytes: int = 0
    seconds: float = 0.0

    def take(self) -> tuple[int, int, float]:
        out = (self.num_messages, self.num_bytes, self.seconds)
        self.num_messages, self.num_bytes, self.seconds = 0, 0, 0.0
        return out


class PlanSender:
    """Rank 0's end: one segment, one pipe per local rank."""

    def __init__(self, conns: list[Connection], capacity: int = SEGMENT_BYTES):
        self.conns = conns
        self.segment = SharedMemory(create=True, size=capacity)
        self.stats = ChannelStats()

    @property
    def segment_name(self) -> str:
        return self.segment.name

    def send(self, message: object, inline: bool = False) -> bytes:
        """Send `message` to every local rank; returns its pickled bytes (relayed to the other
        nodes as they are: node.py)."""
        t0 = time.perf_counter()
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if inline or len(payload) > self.segment.size:
            frame = b"I" + payload
        else:
            self.segment.buf[: len(payload)] = payload
            frame = _HEADER.pack(b"S", len(payload))
        for conn in self.conns:
            conn.send_bytes(frame)
        self.stats.num_messages += 1
        self.stats.num_bytes += len(payload)
        self.stats.seconds += time.perf_counter() - t0
        return payload

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.segment.close()
        self.segment.unlink()


class PlanReceiver:
    """A rank's end: its pipe and the shared segment (attached, never unlinked here)."""

    def __init__(self, conn: Connection, segment_name: str):
        self.conn = conn
        self.segment = SharedMemory(name=segment_name)
        # The segment belongs to rank 0; keep this process's tracker from unlinking it at exit.
        resource_tracker.unregister(self.segment._name, "shared_memory")

    def recv(self, is_parent_alive: Callable[[], bool]) -> object:
        try:
            while not self.conn.poll(POLL_S):
                if not is_parent_alive():
                    raise RankGoneError("rank 0 is gone")
            frame = self.conn.recv_bytes()
        except (EOFError, OSError) as exc:
            raise RankGoneError(f"rank 0's pipe closed ({exc})") from None
        if frame[:1] == b"I":
            return pickle.loads(frame[1:])
        _, size = _HEADER.unpack(frame)
        return pickle.loads(bytes(self.segment.buf[:size]))

    def reply(self, message: object) -> None:
        self.conn.send(message)

    def close(self) -> None:
        self.segment.close()
