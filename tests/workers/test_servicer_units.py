"""The Worker service's two decisions, on plain objects: which gRPC status a caller's error gets
(`grpc_status`, `_caller_errors`) and where a Generate's prompt KV comes from (`_prefill_source`).

The end-to-end twins run real worker processes: tests/workers/test_worker_failures.py
(test_unknown_ids_are_not_found) and tests/workers/test_kv_pull.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.lora.adapter import AdapterFolderNotFoundError
from splitserve.platform.lora.registry import AdapterNotFoundError
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.workers.config import WorkerConfig
from splitserve.workers.kv_pull import BlocksNotHeldError
from splitserve.workers.servicer import PrefillSource, WorkerService, _caller_errors, grpc_status
from splitserve.workers.transfer.base import LayoutMismatchError, TransferError, UnknownTransferError
from splitserve.workers.transfer.sender import _error_from_reply

S = grpc.StatusCode


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (AdapterNotFoundError("no adapter 'x'"), S.NOT_FOUND, "no adapter 'x'"),
        (AdapterFolderNotFoundError("no folder /a"), S.NOT_FOUND, "no folder /a"),
        (InvalidRequestError("max_tokens must be > 0"), S.INVALID_ARGUMENT, "max_tokens must be > 0"),
        (BlocksNotHeldError("block 3 evicted"), S.FAILED_PRECONDITION, "pull refused: block 3 evicted"),
        (LayoutMismatchError("dtype differs"), S.FAILED_PRECONDITION, "KV layout mismatch: dtype differs"),
        (UnknownTransferError("unknown transfer id 't'"), S.NOT_FOUND, "KV transfer failed: unknown transfer id 't'"),
        (TransferError("connection lost"), S.UNAVAILABLE, "KV transfer failed: connection lost"),
    ],
)
def test_each_caller_error_has_one_status(error, code, message):
    assert grpc_status(error) == (code, message)


def test_our_own_errors_have_no_status():
    assert grpc_status(RuntimeError("bug")) is None
    assert grpc_status(KeyError("k")) is None


def test_the_status_follows_the_error_type_not_its_text():
    """A receiver's reply says what went wrong in `error_kind`; the text may say anything."""
    unknown = _error_from_reply({"ok": False, "error_kind": "unknown", "error": "no such id"})
    other = _error_from_reply(
        {
            "ok": False,
            "error_kind": "transfer",
            "state": "FAILED",
            "error": "unknown transfer id 'x' mentioned in passing",
        }
    )
    assert type(unknown) is UnknownTransferError and grpc_status(unknown)[0] == S.NOT_FOUND
    assert type(other) is TransferError and grpc_status(other)[0] == S.UNAVAILABLE


class _Aborted(Exception):
    pass


class _Context:
    """Records what grpc.aio's ServicerContext.abort is called with, and raises as it does."""

    def __init__(self):
        self.aborted = None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise _Aborted()


def test_caller_errors_abort_with_the_status_and_pass_the_rest():
    async def raising(error):
        context = _Context()
        try:
            async with _caller_errors(context):
                raise error
        except Exception as exc:
            return context.aborted, type(exc)
        return context.aborted, None

    assert asyncio.run(raising(InvalidRequestError("bad"))) == ((S.INVALID_ARGUMENT, "bad"), _Aborted)
    assert asyncio.run(raising(ValueError("ours"))) == (None, ValueError)


class _Engine:
    """The one engine call `_prefill_source` makes: the cached prefix of a prompt, in tokens."""

    def __init__(self, num_cached: int):
        self.num_cached = num_cached

    async def call(self, fn):
        return fn(self)

    def num_cached_prefix_tokens(self, token_ids, lora_name):
        return self.num_cached


def _service(num_cached=0, puller=True, remote=True, **config):
    return WorkerService(
        WorkerConfig(role="decode", **config),
        _Engine(num_cached),
        hub=None,
        remote=object() if remote else None,
        sender=None,
        layout=None,
        metrics=None,
        puller=object() if puller else None,
    )


def _request(mode=pb.DISAGGREGATION_MODE_CONDITIONAL, prefill=("p:1",), pull=False, resume=(), min_tokens=None):
    request = pb.GenerateRequest(
        request_id="r",
        prompt_token_ids=list(range(100)),
        disaggregation=mode,
        prefill_workers=list(prefill),
        resume_output_token_ids=list(resume),
    )
    if min_tokens is not None:
        request.min_prefill_tokens = min_tokens
    if pull:
        request.kv_pull.CopyFrom(pb.KVPull(holder="d:2", num_blocks=4))
    return request


def _source(service, request, params=None, lora=None):
    params = params or SamplingParams(max_tokens=4)
    return asyncio.run(service._prefill_source(request, params, list(request.prompt_token_ids), lora))


LOCAL, PULL, REMOTE = PrefillSource.LOCAL, PrefillSource.PULL, PrefillSource.REMOTE


@pytest.mark.parametrize(
    ("service", "request_", "params", "lora", "expected"),
    [
        # the prompt is needed here: always local, whatever else the request asks
        (dict(), dict(pull=True, resume=[7]), None, None, LOCAL),
        (dict(), dict(pull=True), SamplingParams(max_tokens=4, prompt_logprobs=1), None, LOCAL),
        (dict(), dict(mode=pb.DISAGGREGATION_MODE_ALWAYS), SamplingParams(max_tokens=1, embed=True), None, LOCAL),
        # a planned pull, for the base model, on a worker that can receive one
        (dict(), dict(pull=True), None, None, PULL),
        (dict(puller=False), dict(pull=True, mode=pb.DISAGGREGATION_MODE_NEVER), None, None, LOCAL),
        (dict(), dict(pull=True, mode=pb.DISAGGREGATION_MODE_ALWAYS), None, "an adapter", REMOTE),
        # the disaggregation mode, the request's own or the worker's when unset
        (dict(), dict(mode=pb.DISAGGREGATION_MODE_ALWAYS), None, None, REMOTE),
        (dict(), dict(mode=pb.DISAGGREGATION_MODE_NEVER), None, None, LOCAL),
        (dict(disaggregation="always"), dict(mode=pb.DISAGGREGATION_MODE_UNSPECIFIED), None, None, REMOTE),
        (dict(disaggregation="never"), dict(mode=pb.DISAGGREGATION_MODE_UNSPECIFIED), None, None, LOCAL),
        (dict(remote=False), dict(mode=pb.DISAGGREGATION_MODE_ALWAYS), None, None, LOCAL),
        (dict(), dict(mode=pb.DISAGGREGATION_MODE_ALWAYS, prefill=()), None, None, LOCAL),
        # conditional: the uncached tokens (100 - cached) against the threshold
        (dict(num_cached=40), dict(min_tokens=60), None, None, REMOTE),
        (dict(num_cached=41), dict(min_tokens=60), None, None, LOCAL),
        (dict(num_cached=0, min_prefill_tokens=101), dict(), None, None, LOCAL),
        (dict(num_cached=0, min_prefill_tokens=100), dict(), None, None, REMOTE),
    ],
)
def test_prefill_source(service, request_, params, lora, expected):
    assert _source(_service(**service), _request(**request_), params, lora) is expected
