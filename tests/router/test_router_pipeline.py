"""The request pipeline (router/core/pipeline.py): admission, the choices' generations and one
release with the typed Usage, on every way a request can end. The dispatcher here is a scripted
stand-in for core/dispatch.py (it yields the Chunks a worker's stream would become); admission,
quota and slots are the real ones, with the in-memory quota store."""

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter

from splitserve.platform.sampling.params import SamplingParams
from splitserve.router.config import ApiKey
from splitserve.router.core.job import Chunk, Job
from splitserve.router.core.pipeline import ChoiceChunk, Pipeline
from splitserve.router.core.prepared import Prepared
from splitserve.router.errors import APIError
from splitserve.router.tenancy.admission import AdmissionPipeline, Slots
from splitserve.router.tenancy.concurrency import Concurrency
from splitserve.router.tenancy.quota import Quota
from splitserve.router.usage import Usage

KEY = ApiKey("", name="team-a", rpm=100, tpm=1000, max_concurrent=4)


class ScriptedDispatcher:
    """generate(job) yields the chunks scripted for the job's request id, then raises `fail` if set;
    it records which generations were closed (the gateway's cancel reaches the workers this way)."""

    def __init__(self, script: dict[str, list[Chunk]], fail: dict[str, Exception] | None = None):
        self.script, self.fail = script, fail or {}
        self.closed: list[str] = []

    async def generate(self, job: Job):
        try:
            for chunk in self.script[job.request_id]:
                await asyncio.sleep(0)
                yield chunk
            if job.request_id in self.fail:
                raise self.fail[job.request_id]
        finally:
            self.closed.append(job.request_id)


def chunk(ids, *, completion, finish=None, cached=0):
    return Chunk(
        list(ids),
        "x" * len(ids),
        finish_reason=finish,
        num_completion_tokens=completion,
        num_cached_tokens=cached,
        decode_worker="d:1",
    )


def prepared(n_choices=2, max_tokens=50, prompt=10):
    jobs = [Job(f"r-{i}", list(range(prompt)), SamplingParams(max_tokens=max_tokens)) for i in range(n_choices)]
    return Prepared("r", "m", jobs, prompt, None, False, False)


def setup(script, fail=None, max_concurrent=4):
    registry = CollectorRegistry()
    quota = Quota(registry, clock=lambda: 1_000_000.0)
    admission = AdmissionPipeline(
        Concurrency(), quota, Slots(max_concurrent, 0), Counter("rejected", "", ["reason"], registry=registry)
    )
    dispatcher = ScriptedDispatcher(script, fail)
    return Pipeline(admission, dispatcher), admission, quota, dispatcher


def window_tokens(quota: Quota) -> int:
    return sum(h["tok"] for k, h in quota.store.hashes.items() if ":quota:" in k)


def usage_row(quota: Quota) -> dict:
    [(_, row)] = [(k, v) for k, v in quota.store.hashes.items() if ":usage:" in k]
    return row


def test_a_finished_request_is_billed_its_usage_once_and_holds_nothing():
    async def steps():
        script = {
            "r-0": [chunk([1, 2], completion=2, cached=4), chunk([3], completion=3, finish="stop", cached=4)],
            "r-1": [chunk([7], completion=1, finish="length", cached=4)],
        }
        pipeline, admission, quota, dispatcher = setup(script)
        run = await pipeline.open(KEY, "m", prepared())
        assert window_tokens(quota) == 10 + 2 * 50  # reserved: prompt + every choice's max_tokens
        items = [item async for item in run]
        assert sorted((i.index, i.chunk.token_ids) for i in items) == [(0, [1, 2]), (0, [3]), (1, [7])]
        assert all(isinstance(i, ChoiceChunk) for i in items)
        assert [c.token_ids for c in run.choices] == [[1, 2, 3], [7]]
        assert run.usage() == Usage(prompt_tokens=10, completion_tokens=4, cached_tokens=4)
        await run.close()
        await run.close()  # once: the second close does nothing
        assert window_tokens(quota) == 14  # settled to what was used
        assert usage_row(quota) == {"requests": 1, "prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 4}
        assert admission.num_running == 0 and admission.gates[0].concurrency.in_flight == {}
        assert sorted(dispatcher.closed) == ["r-0", "r-1"]

    asyncio.run(steps())


def test_a_cut_request_is_billed_what_it_got_and_its_generations_are_closed():
    async def steps():
        script = {"r-0": [chunk([1], completion=1), chunk([2], completion=2), chunk([3], completion=3, finish="stop")]}
        pipeline, admission, quota, dispatcher = setup(script)
        async with await pipeline.open(KEY, "m", prepared(n_choices=1)) as run:
            first = await run.next()
            assert first.index == 0 and first.chunk.token_ids == [1]
        assert dispatcher.closed == ["r-0"]
        assert usage_row(quota)["completion_tokens"] == 1 and window_tokens(quota) == 11
        assert admission.num_running == 0

    asyncio.run(steps())


def test_a_request_that_got_nothing_is_released_not_billed():
    async def steps():
        pipeline, admission, quota, _ = setup({"r-0": []}, fail={"r-0": APIError(503, "no worker")})
        run = await pipeline.open(KEY, "m", prepared(n_choices=1))
        with pytest.raises(APIError):
            await run.next()
        await run.close()
        assert window_tokens(quota) == 0 and not [k for k in quota.store.hashes if ":usage:" in k]
        assert admission.num_running == 0 and admission.gates[0].concurrency.in_flight == {}

    asyncio.run(steps())


def test_a_refused_admission_starts_no_generation():
    async def steps():
        pipeline, admission, quota, dispatcher = setup(
            {"r-0": [chunk([1], completion=1, finish="stop")]}, max_concurrent=1
        )
        held = await pipeline.open(KEY, "m", prepared(n_choices=1))
        with pytest.raises(APIError) as exc:
            await pipeline.open(KEY, "m", prepared(n_choices=1))
        assert exc.value.status == 429 and exc.value.code == "queue_full"
        assert window_tokens(quota) == 60  # only the admitted request's reservation
        await held.close()  # closed unread: no worker was ever called
        assert dispatcher.closed == [] and admission.num_running == 0 and window_tokens(quota) == 0

    asyncio.run(steps())


def test_embeddings_style_runs_reserve_and_bill_the_prompt_only():
    async def steps():
        pipeline, _, quota, _ = setup({"r-0": [chunk([5], completion=1, finish="length")]})
        run = await pipeline.open(KEY, "m", prepared(n_choices=1, max_tokens=1), bills_completion=False)
        assert window_tokens(quota) == 10
        async for _ in run:
            pass
        await run.close()
        assert run.usage() == Usage(prompt_tokens=10, completion_tokens=0)
        assert usage_row(quota)["completion_tokens"] == 0 and window_tokens(quota) == 10

    asyncio.run(steps())
