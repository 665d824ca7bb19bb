"""Pull instead of recompute (workers/kv_pull.py) between real worker processes: real gRPC with
mTLS, real UCX (over TCP) and TCP KV transfer with the service secret.

Worker A serves a prompt and caches its blocks; worker B gets the same prompt with
`kv_pull = (A, n)` and must answer exactly as if it had computed everything (the reference is
the engine in the test process), whether the pull worked or failed: A killed mid-pull, A's
blocks evicted before the pull, a payload altered on the way, another KV layout. Neither side
may keep a block afterwards.

The pullers (B) are plain workers shared by the module, one per transport (a worker start is
the most expensive step here): each test sends its own prompt (its own salt), so a prefix one
test left in B's cache is never another's, and counters are read as differences.
"""

import asyncio
import signal
import time

import grpc
import pytest
from test_worker_disaggregation import prompt, run
from workerproc import WorkerProc, worker_channel

from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

NUM_TOKENS = 300  # 18 full blocks below the last prompt token
NUM_PULL_BLOCKS = (NUM_TOKENS - 1) // 16


async def generate(address: str, token_ids, holder: str = "", num_blocks: int = 0, max_tokens: int = 8):
    async with worker_channel(address) as channel:
        request = pb.GenerateRequest(
            request_id=f"t-{time.monotonic_ns()}",
            prompt_token_ids=token_ids,
            params=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            disaggregation=pb.DISAGGREGATION_MODE_NEVER,
        )
        if holder:
            request.kv_pull.CopyFrom(pb.KVPull(holder=holder, num_blocks=num_blocks))
        msgs = [m async for m in pb_grpc.WorkerStub(channel).Generate(request)]
    last = msgs[-1]
    last.timings.CopyFrom(msgs[0].timings)  # the timings come with the first message
    return [t for m in msgs for t in m.token_ids], last


def assert_clean(*workers):
    for w in workers:
        state = w.wait_idle()
        assert state["invariants_ok"] and state["num_free_blocks"] == state["num_blocks"], state


@pytest.fixture(scope="module")
def ucx_puller():
    b = WorkerProc("both", "ucx").start()
    yield b
    b.terminate()


@pytest.fixture(scope="module")
def tcp_puller():
    b = WorkerProc("both", "tcp").start()
    yield b
    b.terminate()


@pytest.fixture(params=["ucx", "tcp"])
def puller(request):
    """The module's puller of each transport in turn."""
    return request.getfixturevalue(f"{request.param}_puller")


def test_pulled_prefix_gives_the_computed_answer(puller, reference):
    a = WorkerProc("both", puller.transport).start()
    try:
        tokens = prompt(NUM_TOKENS, salt=11)
        computed, _ = run(generate(a.address, tokens))
        assert computed == reference(tokens)
        pulled, last = run(generate(puller.address, tokens, a.address, NUM_PULL_BLOCKS))
        assert pulled == computed
        assert last.usage.pulled_tokens == NUM_PULL_BLOCKS * 16 and last.timings.kv_pull_s > 0
        assert puller.metric('splitserve_kv_pulls_total{outcome="ok"}') >= 1
        assert puller.metric('splitserve_kv_pull_blocks_total{direction="in"}') >= NUM_PULL_BLOCKS
        assert a.metric('splitserve_kv_pull_blocks_total{direction="out"}') == NUM_PULL_BLOCKS
        # the pulled blocks are B's own cache now: the same prompt again is a local hit, no pull
        again, last = run(generate(puller.address, tokens))
        assert again == computed and last.usage.cached_tokens == NUM_PULL_BLOCKS * 16
        assert_clean(a, puller)
    finally:
        a.terminate()


def test_holder_killed_mid_pull_recomputes(puller, reference):
    a = WorkerProc("both", puller.transport, env={"SPLITSERVE_FAULT_KILL_AFTER_LAYERS": "5"}).start()
    tokens = prompt(NUM_TOKENS, salt=12)
    run(generate(a.address, tokens))
    failed = puller.metric('splitserve_kv_pulls_total{outcome="failed"}')
    got, last = run(generate(puller.address, tokens, a.address, NUM_PULL_BLOCKS))
    assert a.proc.wait(30) == -signal.SIGKILL, "the fault switch should have killed the holder"
    assert got == reference(tokens) and last.usage.pulled_tokens == 0
    assert puller.metric('splitserve_kv_pulls_total{outcome="failed"}') == failed + 1
    assert_clean(puller)


@pytest.fixture(scope="module")
def small_holder():
    """A holder with room for ~145 blocks: two 1500-token prompts evict an earlier prompt."""
    a = WorkerProc("both", "tcp", kv_cache_gib=0.05).start()
    yield a
    a.terminate()


def test_blocks_evicted_before_the_pull_are_recomputed(small_holder, tcp_puller, reference):
    b = tcp_puller
    tokens = prompt(NUM_TOKENS, salt=13)
    run(generate(small_holder.address, tokens))
    for salt in (14, 15):
        run(generate(small_holder.address, prompt(1500, salt=salt), max_tokens=1))
    got, last = run(generate(b.address, tokens, small_holder.address, NUM_PULL_BLOCKS))
    assert got == reference(tokens) and last.usage.pulled_tokens == 0
    assert "no longer cached here (evicted)" in b.log()

    async def direct():  # what B was told: FAILED_PRECONDITION, nothing sent
        async with worker_channel(small_holder.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.WorkerStub(ch).Prefill(
                    pb.PrefillRequest(
                        request_id="x",
                        prompt_token_ids=tokens,
                        cached_only=True,
                        skip_blocks=0,
                        num_blocks=2,
                        block_hashes=[b"\0" * 16] * 2,
                        transfer_id="t",
                        kv_address="tcp://127.0.0.1:1",
                        layout=pb.KVLayout(
                            model_id="smollm2-135m",
                            dtype="float16",
                            block_size=16,
                            num_layers=30,
                            num_kv_heads=3,
                            head_dim=64,
                            weights="auto",
                        ),
                    )
                )
            return err.value

    err = run(direct())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "not this worker's hashes" in err.details()
    assert_clean(small_holder, b)


@pytest.mark.parametrize(
    "holder_args, env, message, salt",
    [
        ((), {"SPLITSERVE_FAULT_TAMPER_PULL": "1"}, "digest mismatch", 16),
        (("--kv-cache-dtype", "float32"), {}, "KV layout mismatch", 20),
    ],
)
def test_tampered_or_mismatched_pull_is_rejected_and_recomputed(holder_args, env, message, salt, tcp_puller, reference):
    a = WorkerProc("both", "tcp", *holder_args, env=env).start()
    b = tcp_puller
    try:
        tokens = prompt(NUM_TOKENS, salt=salt)
        run(generate(a.address, tokens))
        failed = b.metric('splitserve_kv_pulls_total{outcome="failed"}')
        got, last = run(generate(b.address, tokens, a.address, NUM_PULL_BLOCKS))
        assert got == reference(tokens) and last.usage.pulled_tokens == 0
        assert message in b.log()
        assert b.metric('splitserve_kv_pulls_total{outcome="failed"}') == failed + 1
        # nothing from the failed pull entered B's prefix cache: served again, B computes it again
        again, last = run(generate(b.address, tokens))
        assert again == got
        assert_clean(a, b)
    finally:
        a.terminate()


def test_pull_racing_evictions_on_the_holder(small_holder, tcp_puller, reference):
    """The holder evicts under load while a pull of its blocks is under way: whichever comes
    first, the puller's answer is the computed one and neither side keeps a block."""
    b = tcp_puller
    tokens = prompt(NUM_TOKENS, salt=17)
    run(generate(small_holder.address, tokens))

    async def race():
        load = [generate(small_holder.address, prompt(1500, salt=s), max_tokens=1) for s in (18, 19)]
        pulled = generate(b.address, tokens, small_holder.address, NUM_PULL_BLOCKS)
        return (await asyncio.gather(pulled, *load))[0]

    got, last = run(race())
    assert got == reference(tokens) and last.usage.pulled_tokens in (0, NUM_PULL_BLOCKS * 16)
    assert_clean(small_holder, b)
