"""Turns per-step token updates into RequestOutputs: incremental text, stop strings, logprobs.

Per request it keeps, on the request's RequestState, an incremental detokenizer and a stop-string
matcher. The text of a token that ended the request as EOS or a stop token id is not emitted (as
in vLLM). A stop string found in the text finishes the request: the output says finish_reason
"stop" with the string as stop_reason, and the engine frees the request in the scheduler.

With prompt logprobs asked for (prompt_logprobs.py), the request's first output carries the whole
list, collected on its RequestState while its prompt was computed.
"""

from __future__ import annotations

from splitserve.platform.engine import prompt_logprobs
from splitserve.platform.engine.detokenizer import IncrementalDetokenizer
from splitserve.platform.engine.outputs import RequestOutput, TokenLogprob
from splitserve.platform.engine.request_state import RequestState
from splitserve.platform.engine.stop import StopStringMatcher
from splitserve.platform.sched.plan import StepResult
from splitserve.platform.sched.request import Request, RequestStatus
from splitserve.platform.sched.scheduler import TokenUpdate


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def start(self, state: RequestState) -> None:
        """Give a new request its detokenizer and stop-string matcher."""
        req = state.req
        if self.tokenizer is not None:
            # A resumed request's earlier output is context, like the prompt: text starts after it.
            state.detok = IncrementalDetokenizer(
                self.tokenizer, list(req.all_token_ids), skip_special_tokens=req.params.skip_special_tokens
            )
        state.stops = StopStringMatcher(req.params.stop, req.params.include_stop_str_in_output)
        if req.params.prompt_logprobs is not None:
            state.prompt_logprobs = prompt_logprobs.Collected.start(req.params.prompt_logprobs, req.prompt_token_ids)

    def process(self, state: RequestState, update: TokenUpdate, result: StepResult) -> RequestOutput:
        req = state.req
        token = update.new_token_id
        finished = update.finish_status is not None
        ended_by_token = update.finish_status == RequestStatus.FINISHED_STOPPED
        delta = ""
        if state.detok is not None:
            if not ended_by_token:
                delta = state.detok.push([token])
            if finished:
                delta += state.detok.flush()
        text, stopped = state.stops.feed(delta)
        reason, stop_reason = None, None
        if finished:
            reason, stop_reason = update.finish_status.value, token if ended_by_token else None
        if stopped:
            finished, reason, stop_reason = True, "stop", state.stops.matched_stop
        elif finished:
            text += state.stops.flush()
        state.text += text
        scored = None
        if state.prompt_logprobs is not None:  # handed over once, with the first output
            scored, state.prompt_logprobs = prompt_logprobs.finished(state.prompt_logprobs, req.req_id), None
        return RequestOutput(
            req_id=req.req_id,
            new_token_ids=[token],
            new_text=text,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=req.num_output_tokens,
            finished=finished,
            finish_reason=reason,
            stop_reason=stop_reason,
            new_logprobs=_logprobs(update.req_id, token, result),
            output_token_ids=req.output_token_ids,
            text=state.text,
            prompt_logprobs=scored,
            embedding=(result.embeddings or {}).get(req.req_id),
            first_scheduled_time=req.first_scheduled_time,
        )

    def kv_ready(self, req: Request, ready) -> RequestOutput:
        return RequestOutput(
            req_id=req.req_id,
            new_token_ids=[],
            new_text="",
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=0,
            kv_ready=ready,
            first_scheduled_time=req.first_scheduled_time,
        )

    def finish_aborted(self, req: Request, text: str = "") -> RequestOutput:
        return RequestOutput(
            req_id=req.req_id,
            new_token_ids=[],
            new_text="",
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=req.num_output_tokens,
            finished=True,
            finish_reason="abort",
            output_token_ids=req.output_token_ids,
            text=text,
        )


def _logprobs(req_id: str, token: int, result: StepResult) -> list[TokenLogprob] | None:
    if result.logprobs is None or result.logprobs.get(req_id) is None:
        return None
    top = (result.top_logprobs or {}).get(req_id) or ()
    return [TokenLogprob(token, result.logprobs[req_id], tuple(top))]
