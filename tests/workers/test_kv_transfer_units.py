"""KV transfer in one process: the layout descriptor, the factories, the UCX defaults, and the
receiver's state machine driven through the inproc transport (the reference implementation)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from splitserve.workers.transfer import (
    KVLayout,
    LayoutMismatchError,
    TransferError,
    TransferState,
    make_receiver,
    make_sender,
)
from splitserve.workers.transfer.ucx import configure_ucx_env

LAYOUT = KVLayout("smollm2-135m", "float32", block_size=16, num_layers=4, num_kv_heads=3, head_dim=64)
NUM_BLOCKS = 2


def payload(layout=LAYOUT, num_blocks=NUM_BLOCKS, value=1.0):
    return torch.full(layout.layer_payload_shape(num_blocks), value, dtype=layout.torch_dtype)


# -- the layout descriptor ---------------------------------------------------------------------
def test_layout_round_trips_and_sizes():
    assert KVLayout.from_dict(LAYOUT.to_dict()) == LAYOUT
    assert LAYOUT.to_dict() == {
        "model_id": "smollm2-135m",
        "dtype": "float32",
        "block_size": 16,
        "num_layers": 4,
        "num_kv_heads": 3,
        "head_dim": 64,
        "weights": "none",
        "lora_digest": "",
    }
    # a peer from before the `weights` field: its layout reads as "none"
    assert KVLayout.from_dict({k: v for k, v in LAYOUT.to_dict().items() if k != "weights"}) == LAYOUT
    assert LAYOUT.layer_payload_shape(94) == (2, 94, 16, 3, 64)
    assert LAYOUT.layer_payload_nbytes(94) == 2 * 94 * 16 * 3 * 64 * 4 == 2_310_144
    assert KVLayout(**{**LAYOUT.to_dict(), "dtype": "bfloat16"}).layer_payload_nbytes(94) == 1_155_072
    LAYOUT.check_compatible(KVLayout.from_dict(LAYOUT.to_dict()))  # equal: no error


def test_kv_from_weights_served_another_way_is_a_layout_mismatch():
    """An int4 prefill's KV would not give a float32 decode the colocated answer."""
    with pytest.raises(LayoutMismatchError, match="weights: expected 'none', got 'int4'"):
        LAYOUT.check_compatible(KVLayout(**{**LAYOUT.to_dict(), "weights": "int4"}))


def test_kv_from_another_adapter_is_a_layout_mismatch():
    """Same adapter name, other weights: the digests differ, so the KV would not be the decode's."""
    a, b = "ab" * 32, "cd" * 32
    with pytest.raises(LayoutMismatchError, match=f"lora_digest: expected '{a}', got '{b}'") as err:
        KVLayout(**{**LAYOUT.to_dict(), "lora_digest": a}).check_compatible(
            KVLayout(**{**LAYOUT.to_dict(), "lora_digest": b})
        )
    assert list(err.value.mismatches) == ["lora_digest"]
    with pytest.raises(LayoutMismatchError, match=f"lora_digest: expected '', got '{a}'"):  # base KV vs adapter KV
        LAYOUT.check_compatible(KVLayout(**{**LAYOUT.to_dict(), "lora_digest": a}))
    with pytest.raises(ValueError, match="lora_digest must be '' or 64 hex digits"):
        KVLayout(**{**LAYOUT.to_dict(), "lora_digest": "xyz"})


def test_layout_mismatch_names_every_field_with_both_values():
    other = KVLayout("qwen", "bfloat16", block_size=32, num_layers=5, num_kv_heads=2, head_dim=128)
    with pytest.raises(LayoutMismatchError) as err:
        LAYOUT.check_compatible(other)
    assert str(err.value) == (
        "KV layout mismatch: model_id: expected 'smollm2-135m', got 'qwen'; dtype: expected 'float32', got "
        "'bfloat16'; block_size: expected 16, got 32; num_layers: expected 4, got 5; num_kv_heads: expected 3, "
        "got 2; head_dim: expected 64, got 128"
    )
    assert err.value.mismatches["num_kv_heads"] == (3, 2) and len(err.value.mismatches) == 6
    assert isinstance(err.value, TransferError)


def test_layout_rejects_bad_values():
    with pytest.raises(ValueError, match="KVLayout.dtype 'int8' is not supported; allowed: float32, bfloat16, float16"):
        KVLayout("m", "int8", 16, 4, 3, 64)
    with pytest.raises(ValueError, match="KVLayout.block_size must be a positive int, got 0"):
        KVLayout("m", "float32", 0, 4, 3, 64)
    with pytest.raises(ValueError, match=r"missing \['head_dim'\], unknown \['heads'\]"):
        KVLayout.from_dict({**{k: v for k, v in LAYOUT.to_dict().items() if k != "head_dim"}, "heads": 1})


def test_factories_reject_an_unknown_kind():
    for make in (make_receiver, make_sender):
        with pytest.raises(ValueError, match="unknown KV transport 'rdma'; allowed: ucx, tcp, inproc"):
            make("rdma")


def test_ucx_env_defaults_never_override_the_user():
    defaults = {"UCXPY_ENABLE_PYTHON_FUTURE": "1", "UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_TLS": "tcp,self"}
    env = {}
    assert configure_ucx_env(env, has_gpu=False) == defaults and env == defaults
    env = {"UCX_TLS": "rc,cuda_copy", "UCXPY_ENABLE_PYTHON_FUTURE": "0"}
    assert configure_ucx_env(env, has_gpu=False) == {"UCX_WARN_UNUSED_ENV_VARS": "n"}
    assert env == {"UCX_TLS": "rc,cuda_copy", "UCXPY_ENABLE_PYTHON_FUTURE": "0", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    # With a GPU, UCX picks its transports (RDMA, NVLink, cuda_ipc) itself.
    assert configure_ucx_env({}, has_gpu=True) == {"UCXPY_ENABLE_PYTHON_FUTURE": "1", "UCX_WARN_UNUSED_ENV_VARS": "n"}


# -- the state machine, through inproc ---------------------------------------------------------
async def setup(deadline_s=10.0, write_layer=None):
    receiver = make_receiver("inproc")
    await receiver.start()
    written = {}
    receiver.expect(
        "t", LAYOUT, NUM_BLOCKS, write_layer or (lambda i, t, first: written.__setitem__(i, t.clone())), deadline_s
    )
    sender = make_sender("inproc")
    handle = await sender.open(receiver.address, "t", LAYOUT, NUM_BLOCKS)
    return receiver, sender, handle, written


async def outcome(receiver, handle):
    with pytest.raises(TransferError) as err:
        await handle.finish()
    status = await receiver.wait("t")
    receiver.release("t")
    assert receiver.num_transfers == 0
    return str(err.value), status


def test_send_layer_checks_its_arguments():
    async def go():
        receiver, sender, handle, _ = await setup()
        errors = []
        for layer, p, first in [
            (0, payload()[:, :1], 0),
            (0, payload().to(torch.bfloat16), 0),
            (0, payload().transpose(3, 4), 0),
            (4, payload(), 0),
            (1, payload(num_blocks=1), 1),
        ]:
            with pytest.raises(ValueError) as err:
                await handle.send_layer(layer, p, first)
            errors.append(str(err.value))
        await handle.send_layer(2, payload())
        with pytest.raises(ValueError) as err:  # layer 2 is complete: nothing more of it
            await handle.send_layer(2, payload(num_blocks=1), 2)
        errors.append(str(err.value))
        await handle.abort()
        with pytest.raises(RuntimeError, match="send_layer after finish/abort of transfer 't'"):
            await handle.send_layer(0, payload())
        status = await receiver.wait("t")
        await receiver.close()
        return errors, status

    errors, status = asyncio.run(go())
    assert errors[0] == (
        "layer payload must be a contiguous float32 tensor of shape (2, 2, 16, 3, 64) (or fewer "
        "blocks), got torch.float32 (2, 1, 16, 3, 64) (contiguous=False)"
    )
    assert "got torch.bfloat16 (2, 2, 16, 3, 64) (contiguous=True)" in errors[1]
    assert "got torch.float32 (2, 2, 16, 64, 3) (contiguous=False)" in errors[2]
    assert errors[3] == "layer 4 is outside 0..3"
    assert errors[4] == "layer 1: blocks 1..1 do not continue its 0 blocks queued so far within the transfer's 2"
    assert errors[5] == "layer 2: blocks 2..2 do not continue its 2 blocks queued so far within the transfer's 2"
    assert (status.state, status.error) == (TransferState.FAILED, "transfer aborted by the sender")


def test_write_layer_raising_fails_the_transfer():
    def write_layer(layer, t, first):
        if layer == 1:
            raise RuntimeError("no free slot")

    async def go():
        receiver, sender, handle, _ = await setup(write_layer=write_layer)
        for layer in range(4):
            await handle.send_layer(layer, payload())
        return await outcome(receiver, handle)

    message, status = asyncio.run(go())
    assert message == status.error == "write_layer(1) raised RuntimeError('no free slot')"
    assert (status.state, status.num_layers_done) == (TransferState.FAILED, 1)


def test_layers_in_pieces_land_in_order():
    """With chunked prefill a layer goes in pieces, one per chunk: write_layer sees each piece
    with its first block; the transfer is DONE once every block of every layer landed."""

    async def go():
        pieces = []
        receiver, sender, handle, _ = await setup(
            write_layer=lambda layer, t, first: pieces.append((layer, first, t[0, :, 0, 0, 0].tolist()))
        )
        for layer in range(4):
            await handle.send_layer(layer, payload(num_blocks=1, value=1.0), 0)
        for layer in range(4):
            await handle.send_layer(layer, payload(num_blocks=1, value=2.0), 1)
        await handle.finish()
        status = await receiver.wait("t")
        await receiver.close()
        return pieces, status

    pieces, status = asyncio.run(go())
    assert pieces == [(layer, 0, [1.0]) for layer in range(4)] + [(layer, 1, [2.0]) for layer in range(4)]
    assert (status.state, status.num_layers_done, status.num_bytes) == (TransferState.DONE, 4, 4 * 49152)


def test_duplicate_layer_and_missing_layers_fail():
    async def go(layers):
        receiver, sender, handle, _ = await setup()
        for layer in layers:
            # Past send_layer's own checks, as a faulty peer would send it.
            handle._queue.put_nowait((layer, payload(), 0))
        return await outcome(receiver, handle)

    message, status = asyncio.run(go([0, 0]))
    assert (
        message
        == status.error
        == (
            "protocol error: layer 0, blocks from 0, 49152 bytes (expected layers 0...3, "
            "each layer's 2 blocks once and in order in pieces of whole blocks of 24576 bytes; layer 0 has 2 so far)"
        )
    )
    message, status = asyncio.run(go([0, 2]))
    assert message == status.error == "sender finished after 2 of 4 layers"
    assert (status.state, status.num_layers_done, status.num_bytes) == (TransferState.FAILED, 2, 2 * 49152)


def test_deadline_mid_transfer_tells_the_sender_at_once():
    async def go():
        receiver, sender, handle, written = await setup(deadline_s=0.3)
        await handle.send_layer(0, payload(value=7.0))
        status = await receiver.wait("t")
        await asyncio.sleep(0.01)
        early = handle.error
        await handle.send_layer(1, payload())
        message, _ = await outcome(receiver, handle)
        return status, str(early), message, handle.bytes_sent, written

    status, early, message, bytes_sent, written = asyncio.run(go())
    expected = "transfer not complete within its deadline of 0.3 s (1 of 4 layers landed)"
    assert (status.state, status.num_layers_done, status.error) == (TransferState.TIMED_OUT, 1, expected)
    assert early == message == expected
    assert bytes_sent == 49152 and list(written) == [0] and torch.equal(written[0], payload(value=7.0))


def test_receiver_bookkeeping():
    async def go():
        receiver, sender, handle, _ = await setup()
        with pytest.raises(ValueError, match="transfer id 't' is already registered"):
            receiver.expect("t", LAYOUT, NUM_BLOCKS, lambda i, t, first: None, 1.0)
        receiver.abort("nobody")  # unknown: no-op
        receiver.release("nobody")
        receiver.expect("w", LAYOUT, NUM_BLOCKS, lambda i, t, first: None, 10.0)
        await receiver.close()  # transfers not yet terminal fail
        w = receiver.poll("w")
        receiver.release("w")
        receiver.release("w")  # idempotent
        message, t = await outcome(receiver, handle)
        return w, message, t, receiver.num_transfers

    w, message, t, num_transfers = asyncio.run(go())
    assert (w.state, w.error) == (TransferState.FAILED, "receiver closed")
    assert (t.state, t.error) == (TransferState.FAILED, "receiver closed")
    assert message.startswith("connection to inproc://receiver-") and " lost: ChannelClosed(" in message
    assert num_transfers == 0


# A real UCX listener holds a port while a receiver asks for it; in a child process, since UCXX
# binds to the first event loop that uses it.
BUSY_PORT_SCRIPT = """
import asyncio, sys, time
from splitserve.workers.transfer import ucx

async def main(release_after_s):
    ucxx = ucx._ucxx()

    async def on_endpoint(endpoint):
        pass

    holder = ucxx.create_listener(on_endpoint, 0)
    port = holder.port
    receiver = ucx.UcxReceiver(port=port)
    if release_after_s >= 0:
        asyncio.get_running_loop().call_later(release_after_s, holder.close)
    t0 = time.monotonic()
    try:
        address = await receiver._listen()
        print("LISTENING", address == f"ucx://127.0.0.1:{port}", round(time.monotonic() - t0, 2))
        await receiver._stop_listening()
    except RuntimeError as exc:
        print("FAILED", port, exc)

asyncio.run(main(float(sys.argv[1])))
"""


@pytest.mark.parametrize("release_after_s", [0.5, -1.0])
def test_a_busy_kv_port_is_retried_while_it_frees_and_named_when_it_stays_busy(release_after_s):
    """A worker restarted on a node finds its KV port held for a moment by the process that just
    exited: it waits for it (about 3 s) instead of dying; a port another process keeps is named."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", BUSY_PORT_SCRIPT, str(release_after_s)], capture_output=True, text=True, timeout=120
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith(("LISTENING", "FAILED")))
    if release_after_s >= 0:
        _, same_address, waited_s = line.split()
        assert same_address == "True" and float(waited_s) >= release_after_s
    else:
        port = line.split()[1]
        assert f"the KV transfer port {port} stayed busy for 3.1 s" in line and "--kv-port" in line
