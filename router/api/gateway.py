"""Serving one OpenAI request over HTTP: who asks, the pipeline's run, a stream or a whole answer.

    access (401 / 429) -> model (404) -> scope (404) -> prepare (400)
    -> Pipeline.open: admission gates (429; tenancy/admission.py), flow control's queue (503 / 429;
       router/flow/, when enabled), dispatch (core/dispatch.py)
    -> a stream of events, or one JSON answer, written by the endpoint's formatter

The run is written as a stream of events or one JSON answer by api/respond.py, and closed (its
admission released, the workers' calls cancelled) however the response ends.

Each endpoint is a formatter over this: chat and completions (api/formatting.py, the
`ChatEvents` below), the Responses API (api/responses_api.py), embeddings (api/embeddings.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response

from splitserve.platform.observability import tracing
from splitserve.router import logctx
from splitserve.router.api.formatting import Formatter, TokenText, sse
from splitserve.router.api.prompts import num_choices, prepare_chat, prepare_completion
from splitserve.router.api.respond import DONE, StreamEvents, respond, wait_disconnect
from splitserve.router.config import ApiKey
from splitserve.router.config.keys import check_shared_quotas
from splitserve.router.core.pipeline import ChoiceChunk, Origin, Pipeline, Run
from splitserve.router.errors import APIError
from splitserve.router.flow import build_controller
from splitserve.router.router import Router
from splitserve.router.tenancy.access import (
    ANONYMOUS,
    Authenticator,
    RateLimiter,
    check_api_caller,
    check_metrics_reader,
)
from splitserve.router.tenancy.admission import AdmissionPipeline, Slots
from splitserve.router.tenancy.concurrency import Concurrency
from splitserve.router.tenancy.keyfile import check_scope
from splitserve.router.tenancy.prefix_owners import PrefixOwners
from splitserve.router.tenancy.quota import Quota


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who asks, for what: set up once per request, before anything is held."""

    key: ApiKey
    lora_name: str | None  # the LoRA adapter `model` names; None: the base model
    request_id: str  # names the response (and the log lines)
    job_id: str  # unique: prefixes the workers' request ids


OFFLOAD_BYTES = 64 * 1024  # bodies at least this large are tokenized in a worker thread


def is_large(request: Request) -> bool:
    length = request.headers.get("content-length", "")
    return not length.isdigit() or int(length) >= OFFLOAD_BYTES


class Gateway:
    def __init__(self, router: Router):
        self.router = router
        gateway = router.config.gateway
        self.auth = Authenticator(
            gateway.api_keys, gateway.api_keys_file, functools.partial(check_shared_quotas, gateway)
        )
        self.quota = Quota(
            router.metrics.registry,
            gateway.rate_limit_redis_url,
            router.config.index.key_prefix,
            gateway.quota_window_s,
        )
        self.limiter = RateLimiter(gateway, router.config.index.key_prefix)
        self.admission = AdmissionPipeline(
            Concurrency(gateway.max_concurrent_per_key),
            self.quota,
            Slots(gateway.max_concurrent_requests, gateway.max_queued_requests),
            router.metrics.rejected,
        )
        self.flow = build_controller(
            router.config.flow_control, router.pool, router.metrics.registry, getattr(router.dispatcher, "calls", None)
        )
        # With keys, cached_tokens tells a tenant only about prefixes it sent itself (tenancy/prefix_owners.py).
        owners = None if self.auth.is_open else PrefixOwners(router.dispatcher.hasher.block_size)
        self.pipeline = Pipeline(self.admission, router.dispatcher, self.flow, owners)
        self.tokens = TokenText(router.tokenizer)

    async def access(self, request: Request) -> ApiKey:
        """FastAPI dependency of every /v1 route: API key, then its rate limit."""
        key = self.auth.check(request.headers.get("authorization"))
        check_api_caller(key)
        with tracing.current().child("admission.rate_limit"):
            try:
                await self.limiter.check(key)
            except APIError:
                self.router.metrics.rejected.labels(reason="rate_limit").inc()
                raise
        request.state.api_key = key
        return key

    async def auth_only(self, request: Request) -> ApiKey:
        """FastAPI dependency of /docs and /openapi.json: the API key, no rate limit."""
        key = self.auth.check(request.headers.get("authorization"))
        request.state.api_key = key
        return key

    async def metrics_reader(self, request: Request) -> ApiKey:
        """FastAPI dependency of /metrics: a key with role admin or metrics (403 otherwise)."""
        key = await self.auth_only(request)
        check_metrics_reader(self.auth, key)
        return key

    def visible_models(self, key: ApiKey) -> tuple[list[str], list[str]]:
        """The served model names and adapter names `key` may use (its scope), in order."""
        names, adapters = list(self.router.config.served_model_names), self.router.adapters.names()
        if key.models is None:
            return names, list(adapters)
        return [n for n in names if n in key.models], [a for a in adapters if a in key.models]

    def check_model(self, model: str, key: ApiKey = ANONYMOUS) -> str | None:
        """The LoRA adapter `model` names (None: the base model); 404 for anything else, naming
        only the models within `key`'s scope (its scope is checked first, by the caller)."""
        names = self.router.config.served_model_names
        if model in names:
            return None
        adapters = self.router.adapters.names()
        if model in adapters:
            return model
        served = ", ".join(part for group in self.visible_models(key) for part in group) or "none for this key"
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves: {served}",
            param="model",
            code="model_not_found",
        )

    def scoped_model(self, request: Request, model: str) -> str | None:
        """The key's scope (404), then the model (404): check_model for the request's key."""
        key = getattr(request.state, "api_key", ANONYMOUS)
        check_scope(key, model)
        return self.check_model(model, key)

    def caller(self, request: Request, model: str) -> Caller:
        """The key's scope (404), the model (404) and the ids of one request."""
        key = getattr(request.state, "api_key", ANONYMOUS)
        lora_name = self.scoped_model(request, model)
        request_id = logctx.request_id.get()
        # A client's X-Request-Id may repeat; the workers get it with a unique suffix.
        job_id = f"{request_id}-{uuid.uuid4().hex[:8]}" if request.state.is_client_request_id else request_id
        return Caller(key, lora_name, request_id, job_id)

    async def open(self, request: Request, body, *, is_chat: bool) -> tuple[Run, Formatter]:
        """A chat or text completion admitted and dispatched, and the formatter of its answer."""
        span = tracing.current()
        t_parse = time.monotonic()
        caller = self.caller(request, body.model)
        limits = self.router.config.gateway
        choices = num_choices(body)
        if choices > limits.max_choices_per_request:
            raise APIError(
                400,
                f"the request asks for {choices} choices (prompts x n); one request may ask for at "
                f"most {limits.max_choices_per_request} (gateway.max_choices_per_request)",
                param="n",
            )
        prepare = functools.partial(
            prepare_chat if is_chat else prepare_completion,
            body,
            caller.request_id,
            caller.job_id,
            self.router.tokenizer,
            self.router.config.max_model_len,
            **(
                {"tool_call_parser": limits.tool_call_parser}
                if is_chat
                else {"max_prompt_tokens": limits.max_prompt_tokens_per_request}
            ),
        )
        # tokenizing a large body takes a while: off the event loop, so /health and streams keep flowing
        prepared = await asyncio.to_thread(prepare) if is_large(request) else prepare()
        if caller.lora_name is not None or body.priority:
            prepared.jobs[:] = [
                dataclasses.replace(job, lora_name=caller.lora_name, priority=body.priority) for job in prepared.jobs
            ]
        if span.is_recording:
            _trace_request(span, body.model, caller.lora_name, prepared, t_parse, is_chat)
        origin = (
            None
            if self.flow is None
            else Origin(
                request.headers, request.client.host if request.client else "", lambda: wait_disconnect(request)
            )
        )
        run = await self.pipeline.open(caller.key, body.model, prepared, origin=origin)
        return run, Formatter(prepared, is_chat, self.tokens)

    async def serve(self, request: Request, body, *, is_chat: bool) -> Response:
        """POST /v1/chat/completions (is_chat) and /v1/completions."""
        run, formatter = await self.open(request, body, is_chat=is_chat)
        return await self.respond(
            request, run, ChatEvents(formatter), lambda run: formatter.complete(run.choices, run.usage())
        )

    async def respond(
        self, request: Request, run: Run, events: StreamEvents, answer: Callable[[Run], dict]
    ) -> Response:
        """An open run's HTTP response (api/respond.py), timing a stream's first increment."""
        return await respond(request, run, events, answer, ttft=self.router.metrics.ttft)


class ChatEvents:
    """The SSE stream of a chat or text completion."""

    def __init__(self, formatter: Formatter):
        self.formatter = formatter

    def start(self, run: Run) -> list[bytes]:
        if not self.formatter.is_chat:
            return []
        return [sse(self.formatter.chunk(index, None, role=True)) for index in range(len(run.choices))]

    def chunk(self, run: Run, item: ChoiceChunk) -> list[bytes]:
        return [sse(data) for data in self.formatter.stream(item.index, item.chunk, run.choices[item.index])]

    def end(self, run: Run) -> list[bytes]:
        usage = [sse(self.formatter.usage_chunk(run.usage()))] if run.prepared.include_usage else []
        return [*usage, DONE]

    def error(self, run: Run, exc: APIError) -> list[bytes]:
        return [sse(exc.body()), DONE]


def _trace_request(span, model: str, lora_name: str | None, prepared, t_parse: float, is_chat: bool) -> None:
    """The request's gen_ai attributes, and its parse (model check, template, tokenization) span."""
    num_tokens = prepared.num_prompt_tokens
    span.record("gateway.parse", t_parse, time.monotonic(), {"gen_ai.usage.input_tokens": num_tokens})
    span.update(
        {
            "gen_ai.operation.name": "chat" if is_chat else "text_completion",
            "gen_ai.system": "splitserve",
            "gen_ai.request.model": model,
            "splitserve.lora_name": lora_name,
            "gen_ai.usage.input_tokens": num_tokens,
            "gen_ai.request.max_tokens": max(job.params.max_tokens for job in prepared.jobs),
            "splitserve.stream": prepared.stream,
            "gen_ai.request.choice.count": len(prepared.jobs),
        }
    )
