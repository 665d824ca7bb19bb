"""The receiver's transfer table: the one writer of every incoming transfer's state.

The public half (expect, poll, abort, wait, release) is what the decode worker calls; the
connection half (bind, write, finish, disconnect) is what a connection's serving loop calls
as messages arrive. Both run in the receiver's asyncio loop, so no locks.

State machine (see base.TransferState): WAITING -bind-> RECEIVING -finish, all blocks of all
layers-> DONE. Each layer arrives as one or more pieces, runs of blocks in order; a piece that
does not start where the layer's previous one ended is a protocol error. A layer with a
`layer_skip` of k (a sliding-window layer of a model with KV groups: only its window is sent)
starts at block k. Any non-terminal
state goes to ABORTED (abort), TIMED_OUT (the deadline timer armed by
expect), or FAILED (layout mismatch at bind, a bad or out-of-order piece, write_layer raising,
the sender disconnecting or finishing with layers missing). A terminal state never changes.
When a transfer bound to a connection fails early, `notify` sends the sender a "failed"
event at once, so it can stop sending; the final reply to its "end" repeats the outcome.

Quarantine (CUDA IPC). A transfer whose destination blocks went to a CUDA IPC sender
(`expose_blocks`) and that ends other than DONE before that sender's "end" is quarantined
(quarantine.py): `quarantine(transfer_id)` says when its blocks may go to another request.

Replies are plain dicts (the stream module frames them): `{"transfer_id", "type": "failed" |
"final", "ok", "state", "error", "error_kind": "layout" | "unknown" | "transfer",
"mismatches"}`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from splitserve.workers.transfer.base import KVLayout, LayoutMismatchError, TransferState, TransferStatus, WriteLayer
from splitserve.workers.transfer.quarantine import GRACE_S, Quarantines

Notify = Callable[[dict], None]


@dataclass
class _Transfer:
    layout: KVLayout
    num_blocks: int
    write_layer: WriteLayer
    deadline_s: float
    block_ids: list[int] | None = None  # the decode worker's destination blocks (CUDA IPC writes there)
    layer_skip: tuple[int, ...] = ()  # per layer, the leading blocks not sent (() : none)
    state: TransferState = TransferState.WAITING
    blocks_done: dict[int, int] = field(default_factory=dict)  # layer -> blocks landed
    num_bytes: int = 0
    error: str | None = None
    error_kind: str = "transfer"
    mismatches: dict | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None
    notify: Notify | None = None
    hang_up: Callable[[], None] | None = None  # closes the connection the transfer is bound to
    is_exposed: bool = False  # its block ids went to a CUDA IPC sender that has not said "end"


class TransferTable:
    def __init__(self, grace_s: float = GRACE_S):
        self._transfers: dict[str, _Transfer] = {}
        self._quarantines = Quarantines(grace_s)

    def __len__(self) -> int:
        return len(self._transfers)

    # -- the decode worker's side --------------------------------------------------------------
    def expect(
        self,
        transfer_id: str,
        layout: KVLayout,
        num_blocks: int,
        write_layer: WriteLayer,
        deadline_s: float,
        block_ids=None,
        layer_skip: tuple[int, ...] = (),
    ) -> None:
        if transfer_id in self._transfers:
            raise ValueError(f"transfer id {transfer_id!r} is already registered")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_ids is not None and len(block_ids) != num_blocks:
            raise ValueError(f"block_ids must name the {num_blocks} destination blocks, got {len(block_ids)}")
        if layer_skip and (len(layer_skip) != layout.num_layers or not all(0 <= k < num_blocks for k in layer_skip)):
            raise ValueError(f"layer_skip must give each of {layout.num_layers} layers 0..{num_blocks - 1} blocks")
        t = _Transfer(
            layout,
            num_blocks,
            write_layer,
            deadline_s,
            None if block_ids is None else [int(b) for b in block_ids],
            tuple(layer_skip),
        )
        t.timer = asyncio.get_running_loop().call_later(deadline_s, self._on_deadline, transfer_id)
        self._transfers[transfer_id] = t

    def poll(self, transfer_id: str) -> TransferStatus:
        t = self._get(transfer_id)
        return TransferStatus(t.state, _layers_done(t), t.num_bytes, t.error)

    def abort(self, transfer_id: str) -> None:
        t = self._transfers.get(transfer_id)
        if t is not None:
            self._end(t, transfer_id, TransferState.ABORTED, "transfer aborted by the receiver")

    async def wait(self, transfer_id: str) -> TransferStatus:
        t = self._get(transfer_id)
        # The timer ends it at the deadline; the margin only guards against a stalled loop.
        if not t.done.is_set():
            try:
                await asyncio.wait_for(t.done.wait(), t.deadline_s + 1.0)
            except TimeoutError:
                self._on_deadline(transfer_id)
        return self.poll(transfer_id)

    def release(self, transfer_id: str) -> None:
        t = self._transfers.get(transfer_id)
        if t is not None:
            self.abort(transfer_id)
            del self._transfers[transfer_id]

    def quarantine(self, transfer_id: str) -> asyncio.Event | None:
        """The event set when an ended CUDA IPC transfer's blocks may be given to another request,
        or None when nothing holds them back (no IPC sender had them, or it already ended)."""
        return self._quarantines.event(transfer_id)

    @property
    def num_quarantined(self) -> int:
        return len(self._quarantines)

    def close_all(self, reason: str) -> None:
        for tid, t in list(self._transfers.items()):
            self._end(t, tid, TransferState.FAILED, reason)
        self._quarantines.lift_all()  # the worker is stopping: its cache goes with it

    # -- a connection's side ---------------------------------------------------------------
    def bind(
        self, transfer_id: str, layout_dict: dict, num_blocks: int, notify: Notify, hang_up: Callable[[], None]
    ) -> dict | None:
        """The sender opened `transfer_id`: None if accepted, else the "failed" reply to send.
        `hang_up()` closes its connection (a quarantine whose sender never ends)."""
        t = self._transfers.get(transfer_id)
        if t is None:
            return self._unknown(transfer_id, "failed")
        if t.state is not TransferState.WAITING:
            if not t.state.is_terminal:  # RECEIVING from another connection: leave that one alone
                return {
                    "transfer_id": transfer_id,
                    "type": "failed",
                    "ok": False,
                    "state": t.state.name,
                    "error": f"transfer {transfer_id!r} is already being received",
                    "error_kind": "transfer",
                }
            return self._reply(transfer_id, t, "failed")
        try:
            got = KVLayout.from_dict(layout_dict)
            t.layout.check_compatible(got)
            if num_blocks != t.num_blocks:
                raise ValueError(f"num_blocks: expected {t.num_blocks}, got {num_blocks}")
        except LayoutMismatchError as e:
            t.error_kind, t.mismatches = "layout", {k: list(v) for k, v in e.mismatches.items()}
            self._end(t, transfer_id, TransferState.FAILED, f"receiver rejected {transfer_id!r}: {e}")
            return self._reply(transfer_id, t, "failed")
        except ValueError as e:
            self._end(t, transfer_id, TransferState.FAILED, f"receiver rejected {transfer_id!r}: {e}")
            return self._reply(transfer_id, t, "failed")
        t.state, t.notify, t.hang_up = TransferState.RECEIVING, notify, hang_up
        return None

    def expose_blocks(self, transfer_id: str) -> list[int] | None:
        """The destination blocks given to expect(), handed to a CUDA IPC sender: from now on the
        transfer is quarantined if it ends before the sender's "end". None: send bytes."""
        t = self._transfers.get(transfer_id)
        if t is None or t.block_ids is None or t.state is not TransferState.RECEIVING:
            return None
        t.is_exposed = True
        return t.block_ids

    def mark_written(self, transfer_id: str, layer: int, first_block: int, num_blocks: int) -> None:
        """A CUDA IPC sender wrote `num_blocks` blocks of `layer` from `first_block` on straight
        into the destination blocks: checked and counted as write() does, with no payload."""
        t = self._transfers.get(transfer_id)
        if t is None or t.state is not TransferState.RECEIVING:
            return
        if t.block_ids is None or not isinstance(num_blocks, int) or not isinstance(first_block, int):
            self._end(
                t,
                transfer_id,
                TransferState.FAILED,
                f"protocol error: an IPC write of layer {layer} for a transfer without destination blocks",
            )
            return
        self._land(t, transfer_id, layer, first_block, num_blocks, 0, None)

    def write(self, transfer_id: str, layer: int, first_block: int, data: torch.Tensor) -> None:
        """A piece of a layer, blocks from `first_block` on (uint8, only valid during this call),
        arrived on a bound connection."""
        t = self._transfers.get(transfer_id)
        if t is None or t.state is not TransferState.RECEIVING:
            return  # rejected, aborted, timed out or released: discard
        num_blocks, rest = divmod(data.numel(), t.layout.layer_payload_nbytes(1))
        self._land(t, transfer_id, layer, first_block, num_blocks, rest, data)

    def _land(
        self,
        t: _Transfer,
        transfer_id: str,
        layer: int,
        first_block: int,
        num_blocks: int,
        rest: int,
        data: torch.Tensor | None,
    ) -> None:
        block_nbytes = t.layout.layer_payload_nbytes(1)
        skip = t.layer_skip[layer] if t.layer_skip and isinstance(layer, int) and 0 <= layer < len(t.layer_skip) else 0
        done = t.blocks_done.get(layer, skip) if isinstance(layer, int) else 0
        if (
            not isinstance(layer, int)
            or not 0 <= layer < t.layout.num_layers
            or rest
            or num_blocks < 1
            or first_block != done
            or done + num_blocks > t.num_blocks
        ):
            what = f"{data.numel()} bytes" if data is not None else f"{num_blocks} blocks over CUDA IPC"
            self._end(
                t,
                transfer_id,
                TransferState.FAILED,
                f"protocol error: layer {layer}, blocks from {first_block}, {what} (expected "
                f"layers 0...{t.layout.num_layers - 1}, each layer's {t.num_blocks} blocks once and in order "
                f"in pieces of whole blocks of {block_nbytes} bytes; layer {layer} has {done} so far)",
            )
            return
        if data is not None:  # bytes on the wire; a CUDA IPC sender already wrote the blocks
            payload = data.view(t.layout.torch_dtype).view(t.layout.layer_payload_shape(num_blocks))
            try:
                t.write_layer(layer, payload, first_block)
            except Exception as e:  # the decode worker's callback: its failure fails this transfer only
                self._end(t, transfer_id, TransferState.FAILED, f"write_layer({layer}) raised {e!r}")
                return
        t.blocks_done[layer] = done + num_blocks
        t.num_bytes += num_blocks * block_nbytes  # the bytes on the wire (or over CUDA IPC)

    def finish(self, transfer_id: str, aborted_by_sender: bool) -> dict:
        """The sender's "end": settle the transfer and return the final reply. The sender writes
        nothing more for it, so its quarantine, if any, is lifted."""
        self._quarantines.lift(transfer_id)
        t = self._transfers.get(transfer_id)
        if t is None:
            return self._unknown(transfer_id, "final")
        t.is_exposed = False
        if t.state is TransferState.RECEIVING:
            t.notify = None  # the final reply carries the outcome
            if aborted_by_sender:
                self._end(t, transfer_id, TransferState.FAILED, "transfer aborted by the sender")
            elif _layers_done(t) == t.layout.num_layers:
                self._end(t, transfer_id, TransferState.DONE, None)
            else:
                self._end(
                    t,
                    transfer_id,
                    TransferState.FAILED,
                    f"sender finished after {_layers_done(t)} of {t.layout.num_layers} layers",
                )
        return self._reply(transfer_id, t, "final")

    def disconnect(self, transfer_id: str) -> None:
        """The connection `transfer_id` is bound to closed before its "end": the transfer fails, and
        a quarantine of its blocks is lifted `grace_s` from now."""
        t = self._transfers.get(transfer_id)
        if t is not None and t.state is TransferState.RECEIVING:
            t.notify = t.hang_up = None
            self._end(
                t,
                transfer_id,
                TransferState.FAILED,
                f"sender disconnected after {_layers_done(t)} of {t.layout.num_layers} layers",
            )
        self._quarantines.disconnected(transfer_id)

    # -- internals ---------------------------------------------------------------------
    def _get(self, transfer_id: str) -> _Transfer:
        t = self._transfers.get(transfer_id)
        if t is None:
            raise KeyError(f"unknown transfer id {transfer_id!r}")
        return t

    def _on_deadline(self, transfer_id: str) -> None:
        t = self._transfers.get(transfer_id)
        if t is not None:
            self._end(
                t,
                transfer_id,
                TransferState.TIMED_OUT,
                f"transfer not complete within its deadline of "
                f"{t.deadline_s:g} s ({_layers_done(t)} of {t.layout.num_layers} layers landed)",
            )

    def _end(self, t: _Transfer, transfer_id: str, state: TransferState, error: str | None) -> None:
        if t.state.is_terminal:
            return
        t.state, t.error = state, error
        if t.timer is not None:
            t.timer.cancel()
            t.timer = None
        t.done.set()
        if t.is_exposed and state is not TransferState.DONE:
            self._quarantines.start(transfer_id, t.hang_up)
        notify, t.notify = t.notify, None
        if notify is not None and state is not TransferState.DONE:
            notify(self._reply(transfer_id, t, "failed"))

    @staticmethod
    def _reply(transfer_id: str, t: _Transfer, kind: str) -> dict:
        ok = t.state is TransferState.DONE
        return {
            "transfer_id": transfer_id,
            "type": kind,
            "ok": ok,
            "state": t.state.name,
            "error": t.error,
            "error_kind": t.error_kind,
            "mismatches": t.mismatches,
        }

    @staticmethod
    def _unknown(transfer_id: str, kind: str) -> dict:
        return {
            "transfer_id": transfer_id,
            "type": kind,
            "ok": False,
            "state": None,
            "error": f"unknown transfer id {transfer_id!r} (never expected by the receiver, or released)",
            "error_kind": "unknown",
        }


def _layers_done(t: _Transfer) -> int:
    """Layers whose every block landed."""
    return sum(1 for n in t.blocks_done.values() if n == t.num_blocks)
