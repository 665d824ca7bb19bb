"""The quarantine of CUDA IPC transfers that ended before their sender did.

A CUDA IPC sender writes the decode worker's blocks itself, without passing through the transfer
table: a layer copy under way when a transfer fails, or one started before the sender hears of
it, lands anyway. So when a transfer whose destination blocks went to a CUDA IPC sender ends in
any other way than DONE while that sender may still write, the table quarantines it here
(`start`), and `event(transfer_id)` gives the decode worker an asyncio.Event that is set once the
blocks may go to another request:

- at the sender's "end" for the transfer (`lift`): an honest sender sends it only after its last
  copy completed (workers/transfer/sender.py waits for its pump);
- `grace_s` after the sender's connection closed (`disconnected`): a copy already submitted
  finishes within that;
- a sender that does neither within `grace_s` of the start is hung up on (the connection's
  `hang_up`), which ends in one of the two above; if its close is never seen, the quarantine is
  lifted `grace_s` after the hang-up. So a quarantine lasts at most about 2 x `grace_s`.

The blocks are the decode worker's to hold meanwhile (workers/decode.py holds them in the engine);
this only says when. Runs in the receiver's asyncio loop, as the table does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

GRACE_S = 2.0  # after a CUDA IPC sender's connection closed, its copies have landed


@dataclass
class _Held:
    lifted: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None
    hang_up: Callable[[], None] | None = None  # closes the sender's connection (None: closed, or asked to)


class Quarantines:
    def __init__(self, grace_s: float = GRACE_S):
        if not grace_s > 0:
            raise ValueError(f"the quarantine's grace_s must be a positive number of seconds, got {grace_s!r}")
        self.grace_s = grace_s
        self._held: dict[str, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def event(self, transfer_id: str) -> asyncio.Event | None:
        """Set when the transfer's blocks may be given to another request; None if not quarantined."""
        held = self._held.get(transfer_id)
        return None if held is None else held.lifted

    def start(self, transfer_id: str, hang_up: Callable[[], None] | None) -> None:
        """The transfer ended while its sender may still write: hold its blocks back until its end."""
        held = self._held[transfer_id] = _Held(hang_up=hang_up)
        held.timer = asyncio.get_running_loop().call_later(self.grace_s, self._overdue, transfer_id)

    def disconnected(self, transfer_id: str) -> None:
        """The sender's connection closed: lift the quarantine `grace_s` from now."""
        held = self._held.get(transfer_id)
        if held is not None:
            held.hang_up = None
            held.timer.cancel()
            held.timer = asyncio.get_running_loop().call_later(self.grace_s, self.lift, transfer_id)

    def lift(self, transfer_id: str) -> None:
        """The sender writes nothing more for the transfer (or the worker is stopping)."""
        held = self._held.pop(transfer_id, None)
        if held is not None:
            held.timer.cancel()
            held.lifted.set()

    def lift_all(self) -> None:
        for transfer_id in list(self._held):
            self.lift(transfer_id)

    def _overdue(self, transfer_id: str) -> None:
        held = self._held.get(transfer_id)
        if held is None:
            return
        if held.hang_up is None:  # its connection was closed here `grace_s` ago
            self.lift(transfer_id)
            return
        hang_up, held.hang_up = held.hang_up, None
        hang_up()
        held.timer = asyncio.get_running_loop().call_later(self.grace_s, self._overdue, transfer_id)
