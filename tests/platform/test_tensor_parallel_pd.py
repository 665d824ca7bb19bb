"""P/D between tensor-parallel sizes, the engine halves in one process (gloo on the CPU).

A prefill engine of TP a exports each layer's KV with all heads (rank 0 gathers the other ranks'
heads after every layer); a decode engine of TP b lands it (rank 0 scatters each rank its heads
before the next step). One process holds one tensor-parallel group at a time, so the prefill
engine runs first and its payloads are kept, then the decode engine receives them exactly as a
transport would hand them over. Every pair (1 -> 2, 2 -> 1, 2 -> 2) gives the colocated TP 1
tokens, the payloads have the same shape and the same bytes up to summation order at every TP
size, and both block pools are whole again afterwards. tests/workers/test_worker_tp_pd.py runs
the same pairs as worker processes over tcp and ucx. The prompts prefill together, so each
step exports several requests (one gather per request per layer, in the order rank 0 stages
them), and once in 16-token chunks, so a prompt's blocks leave over several steps.

The second KV tier under TP 2 keeps every head of an evicted block (gathered from the ranks) and
restores it to every rank: a prompt evicted to the tier and asked again gives TP 1's tokens.
"""

import pytest
import torch
from test_tensor_parallel import GREEDY, children, engine, folders  # noqa: F401  (folders: a fixture)

from splitserve.platform.config import KVTierConfig, ModelConfig, SchedulerConfig
from splitserve.platform.engine.kv_handoff import KVExport
from splitserve.platform.engine.kv_parallel import HeadShards
from splitserve.platform.parallel.group import TPGroup
from splitserve.platform.parallel.layout import ShardLayout
from splitserve.platform.sampling.params import SamplingParams

PROMPTS = [[(11 * i + 5 * j) % 49000 + 100 for j in range(n)] for i, n in enumerate((7, 16, 41))]
FIRST = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def prefill(eng, prompts: list[list[int]]) -> list[tuple[int, list[tuple[int, int, torch.Tensor]]]]:
    """Run `prompts` together (their exports share the steps) on a prefill engine exporting from
    block 0: per prompt (first token, [(layer, first block, payload)])."""
    pieces: list[list] = [[] for _ in prompts]

    def sink_of(i):
        def sink(layer, staged, first_block):
            staged.ready.wait()
            pieces[i].append((layer, first_block, staged.tensor.clone()))
            staged.release()

        return sink

    ids = [
        eng.add_request(params=FIRST, prompt_token_ids=p, kv_export=KVExport(0, sink_of(i)))
        for i, p in enumerate(prompts)
    ]
    first = {}
    while eng.has_unfinished_requests():
        first.update({o.req_id: o.new_token_ids[0] for o in eng.step() if o.finished})
    return [(first[req_id], got) for req_id, got in zip(ids, pieces, strict=True)]


def layers(pieces) -> list[torch.Tensor]:
    """Each layer's whole payload (its pieces in block order)."""
    by_layer: dict[int, list] = {}
    for layer, _, payload in sorted(pieces, key=lambda p: (p[0], p[1])):
        by_layer.setdefault(layer, []).append(payload)
    return [torch.cat(by_layer[layer], dim=1) for layer in sorted(by_layer)]


def decode(eng, prompt: list[int], first_token: int, pieces) -> list[int]:
    """Land `pieces` on a decode engine for a remote-prefill request and decode it."""
    eng.add_request(params=GREEDY, prompt_token_ids=prompt, req_id="d", remote_prefill=True)
    [ready] = [o.kv_ready for o in eng.step() if o.kv_ready is not None]
    assert ready.start_block == 0
    for layer, first_block, payload in pieces:
        eng.write_kv_layer(ready.block_ids[first_block : first_block + payload.shape[1]], layer, payload)
    outs = [eng.complete_remote_prefill("d", first_token)]
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].finished
    return outs[-1].output_token_ids


def run(model: str, tp: int, job, **options):
    """`job(engine)` on a fresh engine of TP `tp`, then its pool checked whole and its ranks ended."""
    eng = engine(model, tp, **options)
    try:
        start = eng.pool.num_free_blocks
        result = job(eng)
        eng.kv.check_invariants()
        assert eng.pool.num_free_blocks == start, "a KV block leaked"
        return result
    finally:
        eng.close()
        assert not children(), "a rank outlived close()"


@pytest.fixture(scope="module")
def exported(folders):  # noqa: F811
    """Per prefill engine (TP 1, TP 2, TP 2 in 16-token chunks): each prompt's first token and
    exported pieces; and the TP 1 reference."""
    model = folders("llama")
    out = {tp: run(model, tp, lambda e: prefill(e, PROMPTS)) for tp in (1, 2)}
    chunked = SchedulerConfig(max_num_batched_tokens=16, max_model_len=512)
    out["2c"] = run(model, 2, lambda e: prefill(e, PROMPTS), scheduler=chunked)
    reference = run(model, 1, lambda e: [o.output_token_ids for o in e.generate(PROMPTS, GREEDY)])
    return model, out, reference


@pytest.mark.parametrize("prefill", [2, "2c"], ids=["tp2", "tp2-chunked"])
def test_exports_carry_every_head_whatever_the_prefill_tp(exported, prefill):
    _, out, _ = exported
    for (t1, p1), (t2, p2) in zip(out[1], out[prefill], strict=True):
        assert t1 == t2
        assert p1[0][2].shape[-2] == 2  # both KV heads of the model, not rank 0's one
        if prefill == 2:  # the same pieces; chunked, each chunk sends the blocks it completed
            assert [(layer, first, t.shape) for layer, first, t in p1] == [(ly, f, t.shape) for ly, f, t in p2]
        for a, b in zip(layers(p1), layers(p2), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # equal up to summation order


@pytest.mark.parametrize(
    "prefill_tp, decode_tp", [(1, 2), (2, 1), (2, 2), ("2c", 2)], ids=["1to2", "2to1", "2to2", "2chunkedto2"]
)
def test_pd_across_tp_sizes_gives_the_colocated_tokens(exported, prefill_tp, decode_tp):
    model, out, reference = exported
    got = run(
        model,
        decode_tp,
        lambda e: [decode(e, p, first, pieces) for p, (first, pieces) in zip(PROMPTS, out[prefill_tp], strict=True)],
    )
    assert got == reference


def test_head_shards_cut_and_reassemble_replicated_heads():
    """At TP 4 over 2 KV heads, ranks 0-1 hold head 0 and ranks 2-3 head 1: a full payload is
    the first owner's heads of each, and each rank's cut is its own head."""
    config = ModelConfig("m", "llama", 256, 96, 96, 2, 4, 2, 24)
    shards = HeadShards(TPGroup(0, 4), ShardLayout(config, 0, 4), [], torch.device("cpu"))
    assert shards.heads == [(0, 1), (0, 1), (1, 2), (1, 2)] and shards.owners == [0, 2]
    full = torch.arange(2 * 1 * 4 * 2 * 3, dtype=torch.float32).view(2, 1, 4, 2, 3)
    assert torch.equal(shards.cut(full, 3), full[..., 1:2, :])
    assert torch.equal(shards.cut(full, 1), full[..., 0:1, :])


def test_the_kv_tier_under_tp2_restores_every_ranks_heads(folders):  # noqa: F811
    """8 blocks: B takes the 4 A did not use, C (one block longer) evicts A's 3 cached blocks to
    the tier, then A again is restored from it (tier hits) and decodes TP 1's tokens. The pool
    hands out blocks without a hash first (A's and B's last ones), so C needs 5 to reach all of A's."""
    model = folders("llama")
    a, b, c = ([(13 * k + 7 * j) % 49000 + 100 for j in range(n)] for k, n in ((0, 50), (1, 50), (2, 66)))
    reference = [o.output_token_ids for o in engine(model, 1).generate([a, b, c, a], GREEDY)]

    def job(eng):
        got = [eng.generate([p], GREEDY)[0].output_token_ids for p in (a, b, c, a)]
        return got, eng.kv_tier.stats.num_hits, eng.kv_tier.block_bytes

    tiered = dict(num_blocks=8, scheduler=SchedulerConfig(max_model_len=128), kv_tier=KVTierConfig(max_bytes=2**20))
    got, hits, block_bytes = run(model, 2, job, **tiered)
    assert got == reference
    assert hits == 3, "A's three full blocks came back from the tier"
    assert block_bytes == 3 * 2 * 16 * 2 * 16 * 4  # layers, K/V, block size, both KV heads, head dim, fp32
