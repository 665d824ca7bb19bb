"""Building the worker protocol's messages (proto/splitserve/v1/worker.proto) from router types.

The router cannot import workers/convert.py (layering), so the SamplingParams mapping is
written out here; tests/router/test_router_wire.py checks it round-trips every field.
"""

from __future__ import annotations

from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.router.config import DisaggregationConfig

_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "max_tokens", "min_tokens", "logprobs", "skip_special_tokens")
_MODES = {"conditional": pb.DISAGGREGATION_MODE_CONDITIONAL, "always": pb.DISAGGREGATION_MODE_ALWAYS,
          "never": pb.DISAGGREGATION_MODE_NEVER}


def sampling_params(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
                            ignore_eos=params.ignore_eos, include_stop_str_in_output=params.include_stop_str_in_output)
    for name in _OPTIONAL:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def generate_request(request_id: str, token_ids: list[int], params: SamplingParams, decision,
                     disaggregation: DisaggregationConfig) -> pb.GenerateRequest:
    """The decode worker's request. With prefill workers listed, the worker re-checks the
    conditional threshold against its exact cache (the router's index may lag by a few events)."""
    request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=token_ids, params=sampling_params(params),
                                 prefill_workers=list(decision.prefill))
    if decision.prefill:
        request.disaggregation = _MODES[disaggregation.mode]
        request.min_prefill_tokens = disaggregation.min_prefill_tokens
    else:
        request.disaggregation = pb.DISAGGREGATION_MODE_NEVER
    return request
