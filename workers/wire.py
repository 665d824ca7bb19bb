"""The worker side of wire conversion: the protocol's messages (splitserve.v1) to and from the
engine's types, validating.

Every check that can fail on a caller's input raises InvalidRequestError with the field, the
value and what is allowed; the servicer (servicer.py) turns it into INVALID_ARGUMENT. The router
builds what this reads in router/core/worker_messages.py.
"""

from __future__ import annotations

from splitserve.platform.engine.outputs import RequestOutput, TokenLogprob
from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.wire import sampling as wire_sampling
from splitserve.platform.wire import worker_pb2 as pb

_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
# One mapping, shared with the router.
sampling_params = wire_sampling.from_proto
sampling_params_to_proto = wire_sampling.to_proto


def prompt_token_ids(request_id: str, token_ids, vocab_size: int, max_model_len: int) -> list[int]:
    if not request_id:
        raise InvalidRequestError("request_id is empty; allowed: a non-empty string")
    ids = list(token_ids)
    if not ids:
        raise InvalidRequestError("prompt_token_ids is empty; allowed: at least 1 token id")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt_token_ids has ids {bad[:5]} outside the vocabulary; allowed: [0, {vocab_size})"
        )
    if len(ids) >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(ids)} tokens but max_model_len is {max_model_len}; "
            f"allowed: at most {max_model_len - 1}"
        )
    return ids


def logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
    )


def logprob_from_proto(msg: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top))


def generate_response(out: RequestOutput, prefill_worker: str = "") -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=out.req_id,
        token_ids=out.new_token_ids,
        text=out.new_text,
        logprobs=[logprob_to_proto(lp) for lp in out.new_logprobs or ()],
        finish_reason=_FINISH[out.finish_reason],
        usage=pb.Usage(
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            cached_tokens=out.num_cached_tokens,
        ),
        prefill_worker=prefill_worker,
        prompt_logprobs=[logprob_to_proto(lp) for lp in (out.prompt_logprobs or ())[1:]],
        embedding=out.embedding or (),
    )
    if isinstance(out.stop_reason, str):
        msg.stop_string = out.stop_reason
    elif isinstance(out.stop_reason, int):
        msg.stop_token_id = out.stop_reason
    return msg
