"""Fixtures for worker-process tests."""

import pytest


@pytest.fixture(scope="module")
def reference(make_engine):
    """Greedy tokens from the engine in the test process (same weights, the workers' default
    --quantization): "the same answer"."""
    from workerproc import WORKER_QUANTIZATION

    from splitserve.platform.sampling.params import SamplingParams

    engine = make_engine(max_model_len=2048, quantization=WORKER_QUANTIZATION)

    def ref(token_ids, max_tokens=8):
        [out] = engine.generate([token_ids], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return out.output_token_ids

    return ref


@pytest.fixture(scope="session")
def loop():
    """One event loop for every test in the process that sends KV over UCX in-process: UCXX binds
    its context to the first loop it runs in, so a second loop (another module's) fails with
    "attached to a different loop"."""
    import asyncio

    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
