"""vLLM's /tokenize, /detokenize and /version on the gateway.

    POST /tokenize    {prompt, add_special_tokens=true}                       (completion form)
                      {messages, add_generation_prompt=true, add_special_tokens=false,
                       chat_template_kwargs}                                  (chat form)
                      -> {count, max_model_len, tokens, token_strs}
    POST /detokenize  {tokens} -> {prompt}
    GET  /version     -> {version}

Both forms use the router's tokenizer, the one the workers and the completions endpoints use
(platform/tokenizer/), so the ids are exactly what a completion of the same text would run.
`model` is optional (the served model); when given it must name a served model or adapter (404).
Detokenizing keeps special tokens, as vLLM's does.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from splitserve.platform.__about__ import __version__
from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.tokenizer import check_chat_template_kwargs
from splitserve.router.api.gateway import is_large
from splitserve.router.api.schemas import ChatMessage, TokenIds, message_dicts
from splitserve.router.errors import bad_request
from splitserve.router.tenancy.access import ANONYMOUS


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: TokenIds = Field(max_length=1 << 20)


def add_routes(app: FastAPI, router, gateway) -> None:
    access = [Depends(gateway.access)]

    def tokenizer(model: str | None, request: Request):
        if model is not None:
            gateway.scoped_model(request, model)
        if router.tokenizer is None:
            raise bad_request("this model has no tokenizer", "model")
        return router.tokenizer

    @app.post("/tokenize", dependencies=access, summary="Tokenize a prompt or a conversation (vLLM)")
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request):
        tok = tokenizer(body.model, request)
        size = (
            len(body.prompt)
            if isinstance(body, TokenizeCompletionRequest)
            else sum(len(str(m.content or "")) for m in body.messages)
        )
        limit = router.config.gateway.max_tokenize_chars
        if size > limit:
            raise bad_request(
                f"the input holds {size} characters; /tokenize takes at most {limit} (gateway.max_tokenize_chars)",
                "prompt" if isinstance(body, TokenizeCompletionRequest) else "messages",
            )
        # through admission (a slot like any request) and off the event loop when large
        ticket = await gateway.admission.admit(
            getattr(request.state, "api_key", ANONYMOUS), body.model or router.config.served_model_names[0], 0
        )
        try:
            if is_large(request):  # tokenizing and encoding a large answer (a million ids) both take seconds
                content = await asyncio.to_thread(
                    lambda: json.dumps(_tokenize(tok, body, router.config.max_model_len)).encode()
                )
                return Response(content, media_type="application/json")
            return _tokenize(tok, body, router.config.max_model_len)
        finally:
            await gateway.admission.release(ticket, None)

    @app.post("/detokenize", dependencies=access, summary="Token ids back to text (vLLM)")
    async def detokenize(body: DetokenizeRequest, request: Request):
        tok = tokenizer(body.model, request)
        try:
            return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}
        except InvalidRequestError as exc:
            raise bad_request(f"tokens: {exc}", "tokens") from None

    @app.get("/version", summary="The server's version (vLLM)")
    async def version():
        return {"version": __version__}


def _tokenize(tok, body, max_model_len: int) -> dict:
    """The /tokenize answer (runs in a worker thread for large inputs)."""
    try:
        if isinstance(body, TokenizeChatRequest):
            check_chat_template_kwargs(body.chat_template_kwargs)
            text = tok.apply_chat_template(
                message_dicts(body.messages), body.add_generation_prompt, **(body.chat_template_kwargs or {})
            )
            ids = tok.encode(text, add_special_tokens=body.add_special_tokens)
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), "messages" if isinstance(body, TokenizeChatRequest) else "prompt") from None
    except UnicodeEncodeError:
        raise bad_request("the text holds a lone UTF-16 surrogate; allowed: valid Unicode", None) from None
    strs = [s or "" for s in tok.convert_ids_to_tokens(ids)] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}
