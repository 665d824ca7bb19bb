"""From an OpenAI request to the jobs the dispatcher runs: tokenize, check lengths, map sampling.

Token ids come from the engine's own tokenizer and chat template (platform/tokenizer/), so
the router hashes exactly the ids the workers cache. A completions request may carry several
prompts; each prompt gets `n` choices, numbered prompt-major as OpenAI does. Choice i of a
seeded request uses seed + i, so choice 0 equals an n=1 request with the same seed.

Length rule (vLLM's): the prompt plus max_tokens must fit in `max_model_len`; without
max_tokens, chat completions may use the whole rest of the context and completions default to
16 tokens (OpenAI's default), capped to what is left.
"""

from __future__ import annotations

import dataclasses

from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.sampling.params import MAX_LOGPROBS
from splitserve.platform.tokenizer import Tokenizer, check_chat_template_kwargs
from splitserve.router.api import echo
from splitserve.router.api.sampling import sampling_params
from splitserve.router.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    message_dicts,
    unsupported_fields,
)
from splitserve.router.api.structured import constraint_fields
from splitserve.router.api.tools import plan_tools, render_messages
from splitserve.router.core.job import Job
from splitserve.router.core.prepared import Prepared
from splitserve.router.errors import bad_request

COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def prepare_chat(
    req: ChatCompletionRequest,
    request_id: str,
    job_id: str,
    tokenizer: Tokenizer | None,
    max_model_len: int,
    tool_call_parser: str = "hermes",
) -> Prepared:
    """`request_id` names the response; `job_id` (unique) prefixes the workers' request ids."""
    _reject_unsupported(req)
    if tokenizer is None:
        raise bad_request("this model has no tokenizer; use /v1/completions with token ids", "messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    plan, forced = plan_tools(req, tool_call_parser)
    messages, template_kwargs = message_dicts(req.messages), {}
    if plan is not None:
        messages, template_kwargs = render_messages(messages, req.tools, tokenizer.chat_template)
    try:
        check_chat_template_kwargs(req.chat_template_kwargs)
        token_ids = tokenizer.encode_chat(
            messages, req.add_generation_prompt, **{**(req.chat_template_kwargs or {}), **template_kwargs}
        )
    except InvalidRequestError as exc:
        raise bad_request(str(exc), "messages") from None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    constraints = constraint_fields(req, tokenizer.vocab_size)
    if forced is not None:
        if constraints["structured"] is not None:
            raise bad_request(
                "a forced tool_choice cannot be combined with response_format/structured_outputs", "tool_choice"
            )
        constraints["structured"] = forced
    jobs = _jobs(req, job_id, [token_ids], max_tokens, None, logprobs, max_model_len, constraints)
    return Prepared(
        request_id,
        req.model,
        jobs,
        len(token_ids),
        logprobs,
        req.stream,
        _include_usage(req),
        plan,
        return_token_ids=req.return_token_ids,
    )


def num_choices(req: CompletionRequest | ChatCompletionRequest) -> int:
    """Jobs a request asks for (prompts x n), read from the body before anything is tokenized."""
    prompt = getattr(req, "prompt", None)
    num_prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return num_prompts * req.n


def prepare_completion(
    req: CompletionRequest,
    request_id: str,
    job_id: str,
    tokenizer: Tokenizer | None,
    max_model_len: int,
    max_prompt_tokens: int | None = None,
) -> Prepared:
    echo.check(req)
    _reject_unsupported(req)
    prompts = _prompt_token_ids(req.prompt, tokenizer)
    num_prompt_tokens = sum(map(len, prompts))
    if max_prompt_tokens is not None and num_prompt_tokens > max_prompt_tokens:
        raise bad_request(
            f"the prompts hold {num_prompt_tokens} tokens in all; one request may send at most "
            f"{max_prompt_tokens} (gateway.max_prompt_tokens_per_request): split the request",
            "prompt",
        )
    max_tokens = 1 if req.echo and req.max_tokens == 0 else req.max_tokens  # the token is dropped (echo.py)
    jobs = _jobs(
        req,
        job_id,
        prompts,
        max_tokens,
        COMPLETIONS_DEFAULT_MAX_TOKENS,
        req.logprobs,
        max_model_len,
        constraint_fields(req, tokenizer.vocab_size if tokenizer is not None else None),
    )
    scored = echo.worker_prompt_logprobs(req)
    if scored is not None:
        if not 0 <= scored <= MAX_LOGPROBS:
            raise bad_request(
                f"prompt_logprobs={scored} is invalid; allowed: an integer in [0, {MAX_LOGPROBS}]", "prompt_logprobs"
            )
        jobs = [
            dataclasses.replace(job, params=dataclasses.replace(job.params, prompt_logprobs=scored)) for job in jobs
        ]
    return Prepared(
        request_id,
        req.model,
        jobs,
        sum(map(len, prompts)),
        req.logprobs,
        req.stream,
        _include_usage(req),
        return_token_ids=req.return_token_ids,
        echo=echo.plan(req, prompts, tokenizer),
    )


def _reject_unsupported(req: SamplingFields) -> None:
    _reject_lone_surrogates(req.model_dump(), "")
    bad = unsupported_fields(req)
    if bad:
        raise bad_request(f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not supported by this server", bad[0])


def _reject_lone_surrogates(value, where: str) -> None:
    """JSON may escape a lone UTF-16 surrogate (\\ud800); it is no character and cannot be
    tokenized or sent to a worker: a 400 naming the field, not a 500."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(
                f"{where or 'body'}: a string holds a lone UTF-16 surrogate; allowed: valid Unicode", where or None
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _reject_lone_surrogates(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _reject_lone_surrogates(item, f"{where}[{i}]")


def _include_usage(req: SamplingFields) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def _prompt_token_ids(prompt, tokenizer: Tokenizer | None) -> list[list[int]]:
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
        if tokenizer is None:
            raise bad_request("this model has no tokenizer; send the prompt as token ids", "prompt")
        texts = [prompt] if isinstance(prompt, str) else prompt
        prompts = [tokenizer.encode(text) for text in texts]
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = prompt
    if not prompts or any(len(ids) == 0 for ids in prompts):
        raise bad_request("prompt is empty; allowed: a non-empty string, list of strings, or token ids", "prompt")
    vocab = tokenizer.vocab_size if tokenizer is not None else None
    for ids in prompts:
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise bad_request(f"prompt has token ids {bad[:5]} outside the vocabulary; allowed: [0, {vocab})", "prompt")
    return prompts


def _jobs(
    req: SamplingFields,
    job_id: str,
    prompts: list[list[int]],
    max_tokens: int | None,
    default_max_tokens: int | None,
    logprobs: int | None,
    max_model_len: int,
    constraints: dict | None = None,
) -> list[Job]:
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs={logprobs} is invalid; allowed: an integer in [0, {MAX_LOGPROBS}]", "logprobs")
    jobs = []
    for p, token_ids in enumerate(prompts):
        budget = _max_tokens(len(token_ids), max_tokens, default_max_tokens, max_model_len)
        for i in range(req.n):
            index = p * req.n + i
            seed = None if req.seed is None else req.seed + i
            name = job_id if len(prompts) * req.n == 1 else f"{job_id}-{index}"
            jobs.append(Job(name, token_ids, sampling_params(req, budget, logprobs, seed, constraints)))
    return jobs


def _max_tokens(num_prompt: int, requested: int | None, default: int | None, max_model_len: int) -> int:
    if num_prompt >= max_model_len:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt} tokens; shorten the prompt to at most {max_model_len - 1} tokens",
            "messages",
        )
    if requested is None:
        left = max_model_len - num_prompt
        return left if default is None else min(default, left)
    if requested >= 1 and num_prompt + requested > max_model_len:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, but "
            f"{num_prompt + requested} were requested ({num_prompt} in the prompt, {requested} for "
            "the completion); reduce the prompt or max_tokens",
            "max_tokens",
        )
    return requested
