"""The engine halves of prefill/decode disaggregation, wired together in one process.

A prefill engine P exports each layer's KV through `KVExport`; a decode engine D receives it
into the blocks it allocated for a `remote_prefill` request. Here the "transport" is a direct
function call, so these tests pin the engine logic; tests/workers/ repeat them across
processes over real gRPC and UCX/TCP.
"""

import pytest

from splitserve.platform.engine.kv_handoff import KVExport
from splitserve.platform.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def run_to_end(engine):
    outs = []
    while engine.has_work():
        outs += engine.step()
    return outs


def disaggregated(p_engine, d_engine, prompt, params=GREEDY, req_id="r"):
    """D allocates, P prefills and exports, D writes the KV and decodes.

    Returns (D outputs, exported pieces as (P's step, layer, first block, payload shape), KVReady)."""
    d_engine.add_request(params=params, prompt_token_ids=prompt, req_id=req_id, remote_prefill=True)
    ready = [o for o in d_engine.step() if o.kv_ready is not None]
    assert len(ready) == 1
    kv_ready = ready[0].kv_ready
    received, steps = [], [0]

    def sink(layer, staged, first_block):
        staged.ready.wait()  # the export's copy (done at once on a CPU)
        payload = staged.tensor
        received.append((steps[0], layer, first_block, tuple(payload.shape)))
        dst = kv_ready.block_ids[kv_ready.start_block + first_block :][: payload.shape[1]]
        d_engine.write_kv_layer(dst, layer, payload)

    p_params = SamplingParams(**{**params.__dict__, "max_tokens": 1, "min_tokens": 0})
    p_engine.add_request(
        params=p_params, prompt_token_ids=prompt, req_id=req_id + "-p", kv_export=KVExport(kv_ready.start_block, sink)
    )
    p_outs = []
    while p_engine.has_work():
        steps[0] += 1
        p_outs += p_engine.step()
    [p_out] = [o for o in p_outs if o.finished]
    first = d_engine.complete_remote_prefill(req_id, p_out.new_token_ids[0])
    outs = [first] + run_to_end(d_engine)
    return outs, received, kv_ready


@pytest.mark.parametrize("prompt_len", [1, 15, 16, 17, 500])
def test_disaggregated_equals_colocated(make_engine, prompt_len):
    p_engine, d_engine, local = make_engine(), make_engine(), make_engine()
    prompt = [(i * 7919) % 40000 + 100 for i in range(prompt_len)]
    [ref] = local.generate([prompt], GREEDY)
    outs, received, kv_ready = disaggregated(p_engine, d_engine, prompt)
    assert outs[-1].finished and outs[-1].output_token_ids == ref.output_token_ids
    num_blocks = -(-prompt_len // 16)
    assert [(layer, first) for _, layer, first, _ in received] == [(layer, 0) for layer in range(30)]
    assert {shape for *_, shape in received} == {(2, num_blocks, 16, 3, 64)}
    assert d_engine.scheduler.stats.num_remote_prefill_tokens == prompt_len
    for e in (p_engine, d_engine):
        e.kv.check_invariants()
        assert e.pool.num_free_blocks == e.pool.num_blocks


def test_chunked_prefill_exports_each_chunks_blocks_as_it_completes(make_engine):
    """A 500-token prompt in 128-token chunks: each chunk's full blocks leave in the step that
    computed them (a block split across chunks goes with the next), every block exactly once per
    layer and in order, and the answer is the colocated one."""
    p_engine, d_engine, local = make_engine(max_num_batched_tokens=128), make_engine(), make_engine()
    prompt = [(i * 7919) % 40000 + 100 for i in range(500)]
    [ref] = local.generate([prompt], GREEDY)
    outs, received, _ = disaggregated(p_engine, d_engine, prompt)
    assert outs[-1].output_token_ids == ref.output_token_ids
    # Chunks end at tokens 128, 256, 384, 500: blocks [0, 8), [8, 16), [16, 24), [24, 32).
    pieces = sorted({(step, first, shape[1]) for step, _, first, shape in received})
    assert pieces == [(1, 0, 8), (2, 8, 8), (3, 16, 8), (4, 24, 8)]
    for layer in range(30):
        assert [(first, shape[1]) for _, lay, first, shape in received if lay == layer] == [
            (0, 8),
            (8, 8),
            (16, 8),
            (24, 8),
        ]
    for e in (p_engine, d_engine):
        e.kv.check_invariants()
        assert e.pool.num_free_blocks == e.pool.num_blocks


def test_only_missing_blocks_travel_when_decode_holds_a_prefix(make_engine):
    p_engine, d_engine, local = make_engine(), make_engine(), make_engine()
    turn1 = [(i * 31) % 30000 + 200 for i in range(100)]
    turn2 = turn1 + [(i * 17) % 30000 + 300 for i in range(60)]
    d_engine.generate([turn1], GREEDY)  # D now caches turn1's 6 full blocks
    [ref] = local.generate([turn2], GREEDY)
    outs, received, kv_ready = disaggregated(p_engine, d_engine, turn2)
    assert kv_ready.num_cached_tokens == 96 and kv_ready.start_block == 6
    assert {shape for *_, shape in received} == {(2, 10 - 6, 16, 3, 64)}
    assert outs[0].num_cached_tokens == 96
    assert outs[-1].output_token_ids == ref.output_token_ids


def test_fallback_to_local_prefill_after_a_failed_transfer(make_engine):
    d_engine, local = make_engine(), make_engine()
    prompt = [(i * 13) % 30000 + 500 for i in range(40)]
    [ref] = local.generate([prompt], GREEDY)
    d_engine.add_request(params=GREEDY, prompt_token_ids=prompt, req_id="r", remote_prefill=True)
    [ready] = d_engine.step()
    assert ready.kv_ready is not None and not d_engine.has_work()
    # Half the layers arrive, then the prefill worker dies: D computes the prompt itself.
    import torch

    garbage = torch.full((2, 3, 16, 3, 64), 7.0)
    for layer in range(15):
        d_engine.write_kv_layer(ready.kv_ready.block_ids, layer, garbage)
    assert d_engine.fallback_to_local_prefill("r")
    outs = run_to_end(d_engine)
    assert outs[-1].output_token_ids == ref.output_token_ids
    assert d_engine.pool.num_free_blocks == d_engine.pool.num_blocks


def test_abort_while_waiting_for_kv_frees_blocks(make_engine):
    d_engine = make_engine()
    d_engine.add_request(params=GREEDY, prompt_token_ids=list(range(100, 150)), req_id="r", remote_prefill=True)
    d_engine.step()
    assert d_engine.pool.num_free_blocks == d_engine.pool.num_blocks - 4
    assert d_engine.abort("r")
    assert d_engine.step()[0].finish_reason == "abort"
    assert d_engine.complete_remote_prefill("r", 5) is None  # a late completion is ignored
    d_engine.kv.check_invariants()
    assert d_engine.pool.num_free_blocks == d_engine.pool.num_blocks


def test_export_start_block_is_validated(make_engine):
    from splitserve.platform.errors import InvalidRequestError

    with pytest.raises(
        InvalidRequestError, match="skip_blocks=2 is invalid for a prompt of 20 tokens; allowed: 0 to 1"
    ):
        make_engine().add_request(
            params=GREEDY,
            prompt_token_ids=list(range(1, 21)),
            kv_export=KVExport(2, lambda layer, payload, first_block: None),
        )
