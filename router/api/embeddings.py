"""POST /v1/embeddings for the served model (OpenAI's API).

    input  a string, a list of strings, token ids, or a list of token-id lists (at most
           MAX_INPUTS, none empty, each shorter than max_model_len)
    encoding_format  "float" (default) or "base64" (little-endian float32, as the openai client
           decodes it); `dimensions` is a 400: the vectors have the model's hidden size, and a
           decoder model's truncated vector is no Matryoshka embedding

Pooling is vLLM's default for decoder models: the last token's hidden state after the final
norm, L2-normalized. Each input is one job through the ordinary path — access, scope, per-key
concurrency and token quota, admission, the router's placement, a decode worker's batch — run as
a one-token generation with `embed` set (the worker computes the prompt itself, never on a
prefill worker: the hidden state is needed where the answer is made; prefix-cache hits are
reused, the last token is always computed): the gateway's one pipeline (core/pipeline.py), with
this module formatting its chunks. The generated token is dropped; usage counts the prompt
tokens only, in the response and in the key's tenancy records.
"""

from __future__ import annotations

import base64
import struct
from typing import Literal

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict

from splitserve.platform.sampling.params import SamplingParams
from splitserve.router.api.schemas import Int, Prompt
from splitserve.router.core.job import Job
from splitserve.router.core.prepared import Prepared
from splitserve.router.errors import APIError, bad_request

MAX_INPUTS = 2048  # OpenAI's limit per request


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    user: str | None = None


def token_ids(req: EmbeddingRequest, tokenizer, max_model_len: int) -> list[list[int]]:
    """Each input's token ids; a 400 naming `input` for anything that cannot be embedded."""
    if req.dimensions is not None:
        raise bad_request(
            "dimensions is not supported: the embeddings have the model's hidden size; leave it unset", "dimensions"
        )
    raw = req.input
    texts_or_ids = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not texts_or_ids:
        raise bad_request("input is empty; allowed: a non-empty string, list of strings or token ids", "input")
    if len(texts_or_ids) > MAX_INPUTS:
        raise bad_request(f"input has {len(texts_or_ids)} items; allowed: at most {MAX_INPUTS}", "input")
    out = []
    for i, item in enumerate(texts_or_ids):
        if isinstance(item, str):
            if tokenizer is None:
                raise bad_request("this model has no tokenizer; send token ids", "input")
            try:
                ids = tokenizer.encode(item)
            except UnicodeEncodeError:
                raise bad_request(
                    f"input[{i}] holds a lone UTF-16 surrogate; allowed: valid Unicode", "input"
                ) from None
        else:
            ids = list(item)
        if not ids:
            raise bad_request(f"input[{i}] is empty; allowed: at least one token", "input")
        vocab = tokenizer.vocab_size if tokenizer is not None else None
        if any(t < 0 or (vocab is not None and t >= vocab) for t in ids):
            raise bad_request(f"input[{i}] has token ids outside the vocabulary; allowed: [0, {vocab})", "input")
        if len(ids) >= max_model_len:
            raise bad_request(
                f"input[{i}] has {len(ids)} tokens; this model's context is {max_model_len} "
                f"tokens: at most {max_model_len - 1}",
                "input",
            )
        out.append(ids)
    return out


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def serve(gateway, request: Request, body: EmbeddingRequest) -> dict:
    router = gateway.router
    caller = gateway.caller(request, body.model)
    prompts = token_ids(body, router.tokenizer, router.config.max_model_len)
    params = SamplingParams(temperature=0, max_tokens=1, embed=True)
    jobs = [Job(f"{caller.job_id}-{i}", ids, params, caller.lora_name) for i, ids in enumerate(prompts)]
    prepared = Prepared(
        caller.request_id, body.model, jobs, sum(map(len, prompts)), logprobs=None, stream=False, include_usage=False
    )
    vectors: list[list[float] | None] = [None] * len(jobs)
    async with await gateway.pipeline.open(
        caller.key, body.model, prepared, bills_completion=False, num_slots=len(jobs)
    ) as run:
        async for index, chunk in run:
            vectors[index] = list(chunk.embedding) or vectors[index]
    if any(v is None for v in vectors):
        raise APIError(500, "a worker answered without an embedding")
    usage = run.usage()
    return {
        "object": "list",
        "model": body.model,
        "data": [
            {"object": "embedding", "index": i, "embedding": encode(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
    }


def add_routes(app: FastAPI, gateway) -> None:
    @app.post("/v1/embeddings", dependencies=[Depends(gateway.access)], summary="Embeddings (OpenAI)")
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await serve(gateway, request, body)
