"""SamplingParams <-> splitserve.v1.SamplingParams: one mapping for the router and the workers.

Optional fields left unset on the wire take SamplingParams' defaults; decoding validates
(InvalidRequestError naming the field). Torch-free.
"""

from __future__ import annotations

from splitserve.platform.sampling.constraints import StructuredSpec
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.wire import worker_pb2 as pb

OPTIONAL_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "skip_special_tokens",
    "prompt_logprobs",
)


def to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        embed=params.embed,
    )
    for name in OPTIONAL_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    if params.structured is not None:
        msg.structured.kind = params.structured.kind
        msg.structured.value = params.structured.value
        msg.structured.field = params.structured.field
    msg.logit_bias.update(dict(params.logit_bias))
    return msg


def from_proto(msg: pb.SamplingParams) -> SamplingParams:
    kwargs = {name: getattr(msg, name) for name in OPTIONAL_FIELDS if msg.HasField(name)}
    kwargs.update(
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        logit_bias=dict(msg.logit_bias),
        embed=msg.embed,
    )
    if msg.HasField("structured"):
        kwargs["structured"] = StructuredSpec(
            msg.structured.kind, msg.structured.value, msg.structured.field or "structured_outputs"
        )
    return SamplingParams(**kwargs)
