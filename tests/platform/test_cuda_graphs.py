"""Decode steps through the CUDA-graph buckets and static buffers (engine/cuda_graphs.py).

Capture and replay need a GPU; their logic does not: on a CPU `DecodeGraphs.run` runs the very
forward a graph would record, over the same static buffers, eagerly. So the bucket list, the
padding and the buffer filling are checked here exactly, and end to end on the real SmolLM2
weights: a batch padded to its bucket must give the same tokens as the plain runner.
"""

import pytest
import torch

from splitserve.platform.config import CacheConfig, DeviceConfig
from splitserve.platform.engine.cuda_graphs import (
    PAD_SLOT,
    DecodeBuffers,
    bucket_for,
    capture_cost,
    capture_sizes,
    decode_graph_bytes,
    graph_memory_bytes,
    uses_decode_graphs,
)
from splitserve.platform.errors import ConfigError
from splitserve.platform.kv.cache import plan_num_blocks
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.sched.plan import ScheduledSeq

GiB = 1024**3


@pytest.mark.parametrize(
    "max_num_seqs,expected",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (6, [1, 2, 4, 6]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 20]),
        (64, [1, 2, 4, *range(8, 65, 8)]),
        (300, [1, 2, 4, *range(8, 256, 8), 256, 272, 288, 300]),
    ],
)
def test_capture_sizes_are_vllms_list_up_to_max_num_seqs(max_num_seqs, expected):
    assert capture_sizes(max_num_seqs) == expected


@pytest.mark.parametrize(
    "batch,bucket", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (63, 64), (64, 64), (65, None), (0, None)]
)
def test_a_batch_runs_in_the_smallest_bucket_that_holds_it(batch, bucket):
    assert bucket_for(batch, capture_sizes(64)) == bucket


def test_fill_writes_real_rows_and_harmless_padding():
    bs = 4
    buffers = DecodeBuffers(max_rows=8, max_blocks=5, block_size=bs, device=torch.device("cpu"))
    seqs = [
        ScheduledSeq("a", (11,), 6, (7, 3), True),  # position 6: block 3, offset 2
        ScheduledSeq("b", (12,), 0, (9,), True),  # the first token
        ScheduledSeq("c", (13,), 16, (1, 2, 4, 5, 6), True),
    ]  # the table's full width
    buffers.fill(seqs, bucket=4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [6, 0, 16, 0]
    assert buffers.slot_mapping[:4].tolist() == [3 * bs + 2, 9 * bs, 6 * bs, PAD_SLOT]
    assert buffers.context_lens[:4].tolist() == [7, 1, 17, 1]
    assert buffers.block_tables[:4].tolist() == [[7, 3, 0, 0, 0], [9, 0, 0, 0, 0], [1, 2, 4, 5, 6], [0] * 5]
    assert buffers.decode_mask[:4].sum(-1).tolist() == [7, 1, 17, 1]
    # a smaller step afterwards leaves nothing of the bigger one in its rows
    buffers.fill(seqs[1:2], bucket=2)
    assert buffers.block_tables[:2].tolist() == [[9, 0, 0, 0, 0], [0] * 5]
    assert buffers.slot_mapping[:2].tolist() == [9 * bs, PAD_SLOT]
    meta = buffers.metadata(2, num_splits=1)
    assert meta.num_decodes == 2 and meta.prefills == [] and meta.decode_block_table.shape == (2, 5)


def test_fill_gives_a_verifying_slice_one_row_per_token():
    """A speculating request's slice (its last token and 2 proposals at positions 5..7) fills
    three rows, each seeing keys up to its own position; a plain decode beside it keeps one row."""
    bs = 4
    buffers = DecodeBuffers(max_rows=8, max_blocks=3, block_size=bs, device=torch.device("cpu"))
    seqs = [
        ScheduledSeq("v", (21, 22, 23), 5, (7, 3), True, num_draft_tokens=2),
        ScheduledSeq("d", (31,), 2, (9,), True),
    ]
    buffers.fill(seqs, bucket=4)
    assert buffers.input_ids[:4].tolist() == [21, 22, 23, 31]
    assert buffers.positions[:4].tolist() == [5, 6, 7, 2]
    assert buffers.slot_mapping[:4].tolist() == [3 * bs + 1, 3 * bs + 2, 3 * bs + 3, 9 * bs + 2]
    assert buffers.context_lens[:4].tolist() == [6, 7, 8, 3]
    assert buffers.block_tables[:4].tolist() == [[7, 3, 0], [7, 3, 0], [7, 3, 0], [9, 0, 0]]
    assert buffers.decode_mask[:4].sum(-1).tolist() == [6, 7, 8, 3]


PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3, 4,", "Why is the sky blue?"]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=7, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=8, presence_penalty=0.5, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
]


def test_padded_buckets_give_the_plain_runners_tokens(make_engine):
    """Five requests decode together (bucket 8: three padded rows) and finish at different steps,
    so batches of 4, 3 and 2 run in buckets 4, 4 and 2: every token equals the plain runner's,
    greedy and seeded sampling alike."""
    plain = make_engine(max_num_seqs=8)
    expected = [o.output_token_ids for o in plain.generate(PROMPTS, PARAMS)]

    engine = make_engine(max_num_seqs=8)
    graphs = engine.runner.enable_decode_graphs(8, engine.max_model_len, capture=False)
    buckets = []
    real_run = graphs.run
    graphs.run = lambda seqs: buckets.append(len(seqs)) or real_run(seqs)
    got = [o.output_token_ids for o in engine.generate(PROMPTS, PARAMS)]
    assert got == expected
    assert {5, 4, 3, 2} <= set(buckets), f"batch sizes through the graph buffers: {sorted(set(buckets))}"
    assert len(got[0]) == 12 and len(got[4]) == 6


def test_speculative_verification_replays_the_decode_buffers_with_plain_tokens(make_engine):
    """With n-gram speculation on, verification steps (each speculating request's last token and
    its proposals as rows) go through the graph buffers too, and greedy output is token for token
    the output without speculation and without graphs."""
    from splitserve.platform.config import SpeculativeConfig

    prompts = [
        "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig.\nList: apple, banana,",
        "def add(a, b):\n    return a + b\n\n# The same function again:\ndef add(a, b):",
        "The capital of France is",
    ]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.output_token_ids for o in make_engine(max_num_seqs=8).generate(prompts, params)]

    engine = make_engine(max_num_seqs=8, speculative=SpeculativeConfig(num_speculative_tokens=3))
    graphs = engine.runner.enable_decode_graphs(32, engine.max_model_len, capture=False)
    steps = []
    real_run = graphs.run
    graphs.run = lambda seqs: steps.append(seqs) or real_run(seqs)
    got = [o.output_token_ids for o in engine.generate(prompts, params)]
    assert got == expected
    verifying = [s for step in steps for s in step if s.num_draft_tokens]
    assert verifying, "no verification step went through the graph buffers"
    assert engine.speculator.stats.num_accepted_tokens > 0


def test_graph_memory_is_counted_in_the_kv_budget():
    """The cache and the graphs must fit together; the error names both and the remedies."""
    from splitserve.platform.weights.presets import preset_config

    cfg = preset_config("llama-3-8b", "random:llama-3-8b")
    graph = graph_memory_bytes(
        256, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, 2
    )
    assert 100 * 2**20 < graph < 2 * GiB  # the largest bucket's activations, not the model
    cache = CacheConfig(kv_cache_memory_bytes=8 * GiB)
    free = int((8 * GiB + graph // 2) / 0.9)  # room for the cache, not for cache + graphs
    cuda = torch.device("cuda")
    assert plan_num_blocks(cache, cfg, torch.bfloat16, 8192, cuda, free_bytes=free) > 0
    with pytest.raises(ConfigError, match="decode CUDA graphs.*--enforce-eager"):
        plan_num_blocks(cache, cfg, torch.bfloat16, 8192, cuda, free_bytes=free, graph_bytes=graph)
    assert decode_graph_bytes(True, cuda, cfg, 256, torch.bfloat16) == 0  # --enforce-eager
    assert decode_graph_bytes(False, torch.device("cpu"), cfg, 256, torch.bfloat16) == 0
    assert not uses_decode_graphs(False, torch.device("cpu"))


def test_enforce_eager_is_validated_and_reaches_the_config():
    import argparse

    from splitserve.platform.cli import add_engine_args, engine_config

    with pytest.raises(ConfigError, match="enforce_eager must be true or false"):
        DeviceConfig(enforce_eager="yes")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["--enforce-eager"])).device.enforce_eager is True
    assert engine_config(p.parse_args([])).device.enforce_eager is False


def test_a_failed_capture_leaves_the_engine_eager(make_engine, caplog):
    """Capture cannot run on a CPU; the runner logs why and serves eagerly instead of failing."""
    engine = make_engine(max_num_seqs=4)
    assert engine.runner.enable_decode_graphs(4, engine.max_model_len, capture=True) is None
    assert engine.runner.graphs is None and "CUDA graphs for decode are off" in caplog.text
    [out] = engine.generate(["Hi"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out.output_token_ids) == 3


def test_graph_buffers_refuse_the_fused_cpu_kernels():
    from splitserve.platform.engine.cuda_graphs import DecodeGraphs

    class Model:
        fused_ops = object()  # a CpuOps stand-in: no attends_paged

    with pytest.raises(ValueError, match="Triton ops .CUDA. or the torch path .CPU."):
        DecodeGraphs(Model(), [], 16, torch.device("cpu"), 4, 64)


def test_only_plain_decode_steps_go_through_the_graphs():
    """Prefill chunks, rows that sample nothing, grammar rows and batches past the last bucket run
    eagerly (the runner also keeps steps with LoRA adapters or a KV export hook eager)."""
    from types import SimpleNamespace

    from splitserve.platform.engine.cuda_graphs import DecodeGraphs

    class Model:
        fused_ops = None

    graphs = DecodeGraphs(Model(), [], 16, torch.device("cpu"), 4, 64)
    decode = [ScheduledSeq(f"r{i}", (5,), 3, (0,), True) for i in range(5)]
    plain = {s.req_id: SimpleNamespace(matcher=None) for s in decode}
    assert graphs.can_run(decode[:4], plain)
    assert not graphs.can_run(decode, plain), "5 rows: past the largest bucket (4)"
    assert not graphs.can_run([ScheduledSeq("p", (5, 6), 0, (0,), True)], {"p": plain["r0"]}), "a prefill chunk"
    assert not graphs.can_run([ScheduledSeq("r0", (5,), 3, (0,), False)], plain), "a row that samples nothing"
    assert not graphs.can_run(decode[:2], {**plain, "r1": SimpleNamespace(matcher=object())}), "a grammar row"
    verifying = ScheduledSeq("v", (5, 6, 7), 3, (0,), True, num_draft_tokens=2)
    assert graphs.can_run([verifying, decode[0]], {"v": plain["r0"], **plain}), "3 + 1 rows fit bucket 4"
    assert not graphs.can_run([verifying, *decode[:2]], {"v": plain["r0"], **plain}), "3 + 2 rows: past bucket 4"


GiB_ = 2**30


@pytest.mark.parametrize(
    "before, after, cost",
    [
        (80 * GiB_, 79 * GiB_, GiB_),  # the graphs took 1 GiB
        (10 * GiB_, 10 * GiB_, 0),  # nothing
        (10 * GiB_, 10 * GiB_ + 30 * 2**20, 0),  # memory was released meanwhile: never negative (was "-30 MiB")
    ],
)
def test_capture_cost_is_free_memory_before_minus_after_and_never_negative(before, after, cost, caplog):
    assert capture_cost(before, after) == cost
    assert ("counting the graphs as 0 bytes" in caplog.text) == (after > before)


def test_capture_cost_rejects_a_negative_reading():
    with pytest.raises(ValueError, match="free memory cannot be negative"):
        capture_cost(-1, 0)
