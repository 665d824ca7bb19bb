"""Turns per-step token updates into RequestOutputs: incremental text, stop strings, logprobs.

Per request it keeps an incremental detokenizer and a stop-string matcher. The text of a
token that ended the request as EOS or a stop token id is not emitted (as in vLLM). A stop
string found in the text finishes the request: the output says finish_reason "stop" with the
string as stop_reason, and the engine frees the request in the scheduler.

It also owns the prompt logprobs of the requests that want them (prompt_logprobs.py): the
engine hands it each step's scores, and the request's first output carries the whole list.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.platform.detokenizer import IncrementalDetokenizer
from splitserve.platform.engine.outputs import RequestOutput, TokenLogprob
from splitserve.platform.engine.prompt_logprobs import PromptLogprobs
from splitserve.platform.sched.plan import StepResult
from splitserve.platform.sched.request import Request, RequestStatus
from splitserve.platform.sched.scheduler import TokenUpdate
from splitserve.platform.stop import StopStringMatcher


@dataclass
class _State:
    req: Request
    detok: IncrementalDetokenizer | None
    stops: StopStringMatcher
    text: str = ""


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}
        self.prompt_logprobs = PromptLogprobs()

    def add(self, req: Request) -> None:
        detok = None
        if self.tokenizer is not None:
            # A resumed request's earlier output is context, like the prompt: text starts after it.
            detok = IncrementalDetokenizer(self.tokenizer, list(req.all_token_ids),
                                           skip_special_tokens=req.params.skip_special_tokens)
        stops = StopStringMatcher(req.params.stop, req.params.include_stop_str_in_output)
        self._states[req.req_id] = _State(req, detok, stops)
        if req.params.prompt_logprobs is not None:
            self.prompt_logprobs.add(req.req_id, req.params.prompt_logprobs, req.prompt_token_ids)

    def process(self, update: TokenUpdate, result: StepResult) -> RequestOutput:
        st = self._states[update.req_id]
        req = st.req
        token = update.new_token_id
        finished = update.finish_status is not None
        ended_by_token = update.finish_status == RequestStatus.FINISHED_STOPPED
        delta = ""
        if st.detok is not None:
            if not ended_by_token:
                delta = st.detok.push([token])
            if finished:
                delta += st.detok.flush()
        text, stopped = st.stops.feed(delta)
        reason, stop_reason = (update.finish_status.value, token if ended_by_token else None) if finished else (None, None)
        if stopped:
            finished, reason, stop_reason = True, "stop", st.stops.matched_stop
        elif finished:
            text += st.stops.flush()
        st.text += text
        out = RequestOutput(
            req_id=req.req_id, new_token_ids=[token], new_text=text,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=req.num_output_tokens, finished=finished, finish_reason=reason,
            stop_reason=stop_reason, new_logprobs=_logprobs(update.req_id, token, result),
            output_token_ids=req.output_token_ids, text=st.text,
            prompt_logprobs=self.prompt_logprobs.take(req.req_id),
            embedding=(result.embeddings or {}).get(req.req_id))
        if finished:
            del self._states[req.req_id]
        return out

    def kv_ready(self, req: Request, ready) -> RequestOutput:
        return RequestOutput(
            req_id=req.req_id, new_token_ids=[], new_text="", num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0), num_output_tokens=0, kv_ready=ready)

    def finish_aborted(self, req: Request) -> RequestOutput:
        st = self._states.pop(req.req_id, None)
        self.prompt_logprobs.forget(req.req_id)
        return RequestOutput(
            req_id=req.req_id, new_token_ids=[], new_text="", num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0), num_output_tokens=req.num_output_tokens,
            finished=True, finish_reason="abort", output_token_ids=req.output_token_ids,
            text=st.text if st else "")


def _logprobs(req_id: str, token: int, result: StepResult) -> list[TokenLogprob] | None:
    if result.logprobs is None or result.logprobs.get(req_id) is None:
        return None
    top = (result.top_logprobs or {}).get(req_id) or ()
    return [TokenLogprob(token, result.logprobs[req_id], tuple(top))]
