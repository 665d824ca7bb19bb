"""The FastAPI application of the gateway: routes, error handlers, the edge middleware.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, POST
/v1/load_lora_adapter, POST /v1/unload_lora_adapter (these need the API key when keys are
configured; `model` may name a loaded LoRA adapter, listed in /v1/models with `parent` = the
base model), GET /health (the process is up), GET /ready (the model
can be served: router/core/readiness.py; until then /v1/models lists no model), GET /metrics
(Prometheus), GET /openapi.json and /docs. With API keys configured, /metrics, /openapi.json and /docs need
a key too (unless `gateway.public_metrics` / `public_docs`), and LoRA load/unload an admin key whose
`lora_path` lies under `gateway.lora_roots` (router/tenancy/access.py).

Every error leaves as OpenAI's error JSON (errors.py): our APIErrors, FastAPI's validation
errors and unparsable bodies (400), unknown paths (404), bodies over `max_body_bytes` (413,
checked on Content-Length and again while reading: api/edge.py), and anything unexpected (500, logged).
"""

from __future__ import annotations

import logging
import re
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitserve.router.api import embeddings, openapi, responses_api, tokenize_api
from splitserve.router.api.edge import EdgeMiddleware
from splitserve.router.api.gateway import Gateway
from splitserve.router.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from splitserve.router.core import readiness
from splitserve.router.errors import APIError, error_body
from splitserve.router.router import Router
from splitserve.router.tenancy.access import check_admin, check_lora_path

log = logging.getLogger(__name__)


def create_app(router: Router, manage_router: bool = True) -> FastAPI:
    """The gateway app; with manage_router its lifespan starts and stops the router."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_router:
            await router.start()
        try:
            yield
        finally:
            if manage_router:
                await router.stop()
            await gateway.limiter.buckets.close()
            await gateway.quota.close()

    app = FastAPI(
        title="splitserve gateway",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible API in front of splitserve's prefill/decode workers",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )  # _add_docs serves them behind the API's auth
    gateway = Gateway(router)
    router.metrics.watch_admission(gateway.admission, router.dispatcher)
    app.state.router = router
    app.state.gateway = gateway
    _add_error_handlers(app)
    _add_routes(app, router, gateway)
    _add_docs(app, gateway, router.config.gateway.public_docs)
    tokenize_api.add_routes(app, router, gateway)
    embeddings.add_routes(app, gateway)
    responses_api.add_routes(app, gateway)
    openapi.install(
        app, router.config.served_model_names, router.tokenizer.vocab_size if router.tokenizer is not None else None
    )
    app.add_middleware(EdgeMiddleware, max_body_bytes=router.config.gateway.max_body_bytes, metrics=router.metrics)
    return app


def _add_routes(app: FastAPI, router: Router, gateway: Gateway) -> None:
    access = [Depends(gateway.access)]

    @app.post("/v1/chat/completions", dependencies=access, summary="Chat completion (OpenAI)")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await gateway.serve(request, body, is_chat=True)

    @app.post("/v1/completions", dependencies=access, summary="Text completion (OpenAI)")
    async def completions(body: CompletionRequest, request: Request):
        return await gateway.serve(request, body, is_chat=False)

    @app.get("/v1/models", dependencies=access, summary="Served models (OpenAI)")
    async def models(request: Request):
        created = int(time.time())
        names, adapter_names = gateway.visible_models(request.state.api_key)
        if not router.is_ready:
            return {"object": "list", "data": []}
        base = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "splitserve",
                "max_model_len": router.config.max_model_len,
                "root": router.config.model,
                "parent": None,
            }
            for name in names
        ]
        parent = router.config.served_model_names[0]
        adapters = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "splitserve",
                "max_model_len": router.config.max_model_len,
                "root": name,
                "parent": parent,
            }
            for name in adapter_names
        ]
        return {"object": "list", "data": base + adapters}

    @app.post(
        "/v1/load_lora_adapter", dependencies=access, summary="Load a LoRA adapter on every worker (vLLM; an admin key)"
    )
    async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request):
        check_admin(gateway.auth, request.state.api_key)
        lora_path = check_lora_path(gateway.auth, router.config.gateway.lora_roots, body.lora_path)
        if body.lora_name in router.config.served_model_names:
            raise APIError(
                400, f"lora_name {body.lora_name!r} is the base model's name; choose another", param="lora_name"
            )
        await router.adapters.load(body.lora_name, lora_path)
        return {
            "object": "lora_adapter",
            "lora_name": body.lora_name,
            "status": "loaded",
            "message": f"Success: LoRA adapter '{body.lora_name}' added successfully.",
        }

    @app.post(
        "/v1/unload_lora_adapter", dependencies=access, summary="Unload a LoRA adapter everywhere (vLLM; an admin key)"
    )
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request):
        check_admin(gateway.auth, request.state.api_key)
        await router.adapters.unload(body.lora_name)
        return {
            "object": "lora_adapter",
            "lora_name": body.lora_name,
            "status": "unloaded",
            "message": f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
        }

    @app.get("/health", summary="Liveness: the gateway process serves")
    async def health():
        return {"status": "ok"}

    @app.get("/ready", summary="Readiness: a healthy decode worker (and prefill worker where required)")
    async def ready():
        status, body = readiness.ready_answer(router)
        return JSONResponse(body, status, headers={"Retry-After": "1"} if status != 200 else None)

    metrics_access = [] if router.config.gateway.public_metrics else [Depends(gateway.metrics_reader)]

    @app.get(
        "/metrics", dependencies=metrics_access, summary="Prometheus metrics (an admin or metrics key unless public)"
    )
    async def metrics():
        return Response(router.metrics.render(router.pool), media_type=CONTENT_TYPE_LATEST)


def _add_docs(app: FastAPI, gateway: Gateway, public: bool) -> None:
    """/openapi.json, /docs and /redoc: behind the API's key unless `gateway.public_docs`."""
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html

    deps = [] if public else [Depends(gateway.auth_only)]

    @app.get("/openapi.json", include_in_schema=False, dependencies=deps)
    async def openapi_json():
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=deps)
    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - Swagger UI")

    @app.get("/redoc", include_in_schema=False, dependencies=deps)
    async def redoc():
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), exc.status, headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        message, param = describe_validation(exc.errors())
        return JSONResponse(error_body(400, message, param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:
            message = "the request body could not be parsed: send UTF-8 JSON"
        return JSONResponse(error_body(exc.status_code, message), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), 500)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|dict|list|none|[\w-]*\[.*\])$")


def describe_validation(errors) -> tuple[str, str | None]:
    """A readable 400 message from pydantic errors: the field, what was wrong, what was sent.
    A field that failed every form of a union ("prompt": string, strings, ids...) is one entry."""
    fields: dict[str, list[dict]] = {}
    for error in errors:
        if error.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {error.get('ctx', {}).get('error', error.get('msg'))}", None
        loc = [str(x) for x in error.get("loc", ()) if x != "body" and not _TYPE_TAG.match(str(x))]
        fields.setdefault(".".join(loc) or "body", []).append(error)
    parts = []
    for where, errs in list(fields.items())[:3]:
        if errs[0].get("type") == "missing":
            parts.append(f"{where}: required field missing")
        elif len(errs) > 1:
            parts.append(f"{where}: none of the allowed types (got {errs[0].get('input')!r:.60})")
        else:
            parts.append(f"{where}: {errs[0].get('msg')} (got {errs[0].get('input')!r:.60})")
    return "invalid request: " + "; ".join(parts), next(iter(fields), None)
