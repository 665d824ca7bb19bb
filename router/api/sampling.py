"""An OpenAI request's sampling fields as the engine's SamplingParams: the engine's own checks
become 400s naming the field, and values the worker protocol cannot carry (its int32 / int64
fields) are a 400 too, not a crash on the wire."""

from __future__ import annotations

from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.sampling.params import SamplingParams
from splitserve.router.api.schemas import SamplingFields
from splitserve.router.errors import APIError, bad_request

INT32, INT64 = 2**31, 2**63  # the worker protocol's int32 and int64 bounds (openapi.py publishes them)


def sampling_params(
    req: SamplingFields, max_tokens: int, logprobs: int | None, seed: int | None, constraints: dict | None = None
) -> SamplingParams:
    """The engine's SamplingParams; its own validation errors become 400s naming the field."""
    optional = {
        name: getattr(req, name)
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        )
        if getattr(req, name) is not None
    }
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    _check_wire_ranges(req, seed)
    try:
        return SamplingParams(
            **optional,
            seed=seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            **(constraints or {}),
        )
    except InvalidRequestError as exc:
        message = str(exc)
        raise APIError(400, message, param=message.split("=", 1)[0]) from None


def _check_wire_ranges(req: SamplingFields, seed: int | None) -> None:
    """Values the worker protocol cannot carry (int32 / int64 fields) are a 400, not a crash."""
    if seed is not None and not -INT64 <= seed < INT64:
        raise bad_request(f"seed={req.seed} is invalid; allowed: a 64-bit signed integer", "seed")
    if req.top_k is not None and not -INT32 <= req.top_k < INT32:
        raise bad_request(f"top_k={req.top_k} is invalid; allowed: an integer >= 1, or 0 / -1 to disable", "top_k")
    if any(not 0 <= t < INT32 for t in req.stop_token_ids or ()):
        raise bad_request("stop_token_ids must be token ids in [0, 2^31)", "stop_token_ids")
    if not 0 <= req.min_tokens < INT32:
        raise bad_request(f"min_tokens={req.min_tokens} is invalid; allowed: an integer >= 0", "min_tokens")
