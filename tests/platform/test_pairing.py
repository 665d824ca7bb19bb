"""Topology-aware pairing (platform/pairing.py): table-driven, on plain objects."""

from __future__ import annotations

import pytest

from splitserve.platform.pairing import PairingModel, PrefillCandidate, pairing_cost_s, pick_prefill

GIB = 2**30
MODEL = PairingModel(
    prefill_tokens_per_s=20_000, same_node_bytes_per_s=400e9, cross_node_bytes_per_s=45e9, exposed_fraction=0.25
)


def test_cost_is_queue_plus_compute_plus_the_exposed_transfer():
    near = PrefillCandidate("p1", "node-a", queued_prefill_tokens=2_000)
    far = PrefillCandidate("p2", "node-b")
    assert pairing_cost_s(near, "node-a", 8192, GIB, MODEL) == pytest.approx(
        (2_000 + 8192) / 20_000 + 0.25 * GIB / 400e9
    )
    assert pairing_cost_s(far, "node-a", 8192, GIB, MODEL) == pytest.approx(8192 / 20_000 + 0.25 * GIB / 45e9)


@pytest.mark.parametrize(
    "near_queue, far_queue, kv_bytes, winner, words",
    [
        (0, 0, GIB, "near", "decode worker's node node-a"),  # a tie on load: same node wins on transfer
        (0, 0, 0, "near", "decode worker's node"),  # nothing to move: same node by the tie-break
        (100, 0, GIB, "near", "less than the best other-node"),  # 5 ms of queue < 5.3 ms of transfer saved
        (2_000, 0, GIB, "far", "prefill on node node-b"),  # 100 ms of queue > the transfer
        (2_000, 0, 32 * GIB, "near", "decode worker's node"),  # a huge KV: the transfer dominates again
    ],
)
def test_a_same_node_prefill_wins_unless_another_node_is_less_busy_by_more_than_the_transfer(
    near_queue, far_queue, kv_bytes, winner, words
):
    candidates = [PrefillCandidate("far", "node-b", far_queue), PrefillCandidate("near", "node-a", near_queue)]
    pick = pick_prefill(candidates, "node-a", 8192, kv_bytes, MODEL)
    assert pick.address == winner and words in pick.reason


def test_an_unknown_node_is_never_taken_for_the_decode_workers_and_inputs_are_validated():
    pick = pick_prefill([PrefillCandidate("x", "")], "", 100, GIB, MODEL)
    assert pick.address == "x" and "node unknown" in pick.reason
    with pytest.raises(ValueError, match="at least one"):
        pick_prefill([], "node-a", 1, 1)
    with pytest.raises(ValueError, match="must be >= 0"):
        pick_prefill([PrefillCandidate("x", "a")], "a", -1, 1)
    with pytest.raises(ValueError, match="exposed_fraction must be in"):
        PairingModel(exposed_fraction=2)
    with pytest.raises(ValueError, match="prefill_tokens_per_s must be > 0"):
        PairingModel(prefill_tokens_per_s=0)
