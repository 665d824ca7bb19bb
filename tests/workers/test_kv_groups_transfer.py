"""P/D of a model with KV groups over the inproc transport (the reference implementation): a
sliding-window layer's `layer_skip` leading blocks are not sent, the receiver expects exactly
the rest of each layer, and a sender that sends a skipped block is a protocol error."""

from __future__ import annotations

import asyncio

import torch

from splitserve.workers.transfer import KVLayout, TransferError, TransferState, make_receiver, make_sender

LAYOUT = KVLayout("tiny-gemma3", "float32", block_size=16, num_layers=3, num_kv_heads=1, head_dim=16)
NUM_BLOCKS = 4
SKIP = (3, 0, 3)  # layers 0 and 2 slide: only their last block goes


def payload(num_blocks: int, value: float) -> torch.Tensor:
    return torch.full(LAYOUT.layer_payload_shape(num_blocks), value, dtype=LAYOUT.torch_dtype)


async def transfer(pieces):
    written = []
    receiver = make_receiver("inproc")
    await receiver.start()
    receiver.expect(
        "t", LAYOUT, NUM_BLOCKS, lambda layer, t, first: written.append((layer, first, t.shape[1])), 10.0, None, SKIP
    )
    handle = await make_sender("inproc").open(receiver.address, "t", LAYOUT, NUM_BLOCKS)
    handle.skip_leading(SKIP)
    error = None
    for layer, first, n in pieces:
        handle._queue.put_nowait((layer, payload(n, float(layer)), first))  # as a peer would send it
    try:
        await handle.finish()
    except TransferError as exc:
        error = str(exc)
    status = await receiver.wait("t")
    await receiver.close()
    return written, status, error


def test_only_the_window_blocks_of_sliding_layers_travel():
    written, status, error = asyncio.run(transfer([(0, 3, 1), (1, 0, 4), (2, 3, 1)]))
    assert error is None and written == [(0, 3, 1), (1, 0, 4), (2, 3, 1)]
    block_bytes = LAYOUT.layer_payload_nbytes(1)
    assert (status.state, status.num_layers_done, status.num_bytes) == (TransferState.DONE, 3, 6 * block_bytes)


def test_a_skipped_block_sent_anyway_fails_the_transfer():
    _, status, error = asyncio.run(transfer([(0, 0, 4), (1, 0, 4), (2, 3, 1)]))
    assert status.state == TransferState.FAILED and "layer 0, blocks from 0" in status.error and error


def test_sender_refuses_a_piece_before_its_layers_skip():
    async def go():
        receiver = make_receiver("inproc")
        await receiver.start()
        receiver.expect("t", LAYOUT, NUM_BLOCKS, lambda *a: None, 10.0, None, SKIP)
        handle = await make_sender("inproc").open(receiver.address, "t", LAYOUT, NUM_BLOCKS)
        handle.skip_leading(SKIP)
        try:
            await handle.send_layer(0, payload(4, 0.0), 0)
        except ValueError as exc:
            return str(exc)
        finally:
            await handle.abort()
            await receiver.close()

    assert "do not continue its 3 blocks queued so far" in asyncio.run(go())
