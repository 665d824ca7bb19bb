"""`echo` and prompt logprobs on /v1/completions (OpenAI's legacy API, vLLM's extension).

    echo: true                  the prompt comes back at the start of `text`; with `logprobs: N`
                                its tokens open `logprobs` (the first token's logprob and top
                                alternatives are null), then the generated tokens follow
    echo + max_tokens: 0        the prompt alone: the worker runs with max_tokens 1 (the prompt's
                                last logits are computed anyway) and the token is dropped here;
                                usage counts 0 completion tokens
    prompt_logprobs: N (vLLM)   `choices[i].prompt_logprobs`: null, then per prompt token a map
                                token id -> {logprob, decoded_token} of the token and its top N

The prompt's logprobs are computed by the decode worker in the prompt's prefill
(platform/engine/prompt_logprobs.py) and arrive on its first message. One choice per prompt with
echo (n > 1 or best_of > 1 is a 400): a scoring request has one answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.router.api.schemas import CompletionRequest
from splitserve.router.core.prepared import EchoPlan
from splitserve.router.errors import bad_request


@dataclass(frozen=True)
class PromptHead:
    """The first prompt token in `logprobs`: nothing precedes it, so no logprob."""

    token_id: int
    logprob: None = None
    top: None = None


def check(req: CompletionRequest) -> None:
    if req.echo and (req.n > 1 or (req.best_of or 1) > 1):
        raise bad_request(f"echo allows one choice per prompt; got n={req.n}, best_of={req.best_of}", "echo")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens=0 is only allowed with echo=true (the prompt alone); allowed: >= 1", "max_tokens")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request(
            "prompt_logprobs is not available with stream=true; use echo with logprobs", "prompt_logprobs"
        )


def worker_prompt_logprobs(req: CompletionRequest) -> int | None:
    """How many top alternatives per prompt token the worker must compute (None: no scoring)."""
    if req.prompt_logprobs is not None:
        return max(req.prompt_logprobs, req.logprobs or 0) if req.echo else req.prompt_logprobs
    return req.logprobs if req.echo else None


def plan(req: CompletionRequest, prompts: list[list[int]], tokenizer) -> EchoPlan | None:
    if not req.echo and req.prompt_logprobs is None:
        return None
    if isinstance(req.prompt, str):
        texts = [req.prompt]
    elif isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str):
        texts = list(req.prompt)
    else:
        texts = [tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else "" for ids in prompts]
    per_choice = [(texts[p], tuple(ids)) for p, ids in enumerate(prompts) for _ in range(req.n)]
    return EchoPlan(
        tuple(t for t, _ in per_choice),
        tuple(i for _, i in per_choice),
        req.echo,
        req.echo and req.max_tokens == 0,
        req.prompt_logprobs is not None,
    )


def prompt_entries(plan: EchoPlan, index: int, prompt_logprobs: list) -> list:
    """The prompt's rows of `logprobs`: the head (no logprob), then what the worker scored."""
    return [PromptHead(plan.token_ids[index][0]), *prompt_logprobs]


def echoed(
    plan: EchoPlan, index: int, text: str, logprobs: list, prompt_logprobs: list, is_first: bool
) -> tuple[str, list]:
    """A choice's (text, logprob entries) with the prompt in front (on its first piece) and the
    generated part dropped for max_tokens 0."""
    if plan.is_prompt_only:
        text, logprobs = "", []
    if plan.is_echo and is_first:
        text = plan.texts[index] + text
        logprobs = prompt_entries(plan, index, prompt_logprobs) + list(logprobs)
    return text, logprobs


def vllm_prompt_logprobs(plan: EchoPlan, index: int, prompt_logprobs: list, token_text) -> list | None:
    """vLLM's `prompt_logprobs` field: None for the first token, then {id: {logprob, decoded_token}}."""
    if not plan.has_prompt_logprobs_field:
        return None
    out: list = [None]
    for lp in prompt_logprobs:
        entry = {str(t.token_id): {"logprob": t.logprob, "decoded_token": token_text(t.token_id)} for t in lp.top}
        entry[str(lp.token_id)] = {"logprob": lp.logprob, "decoded_token": token_text(lp.token_id)}
        out.append(entry)
    return out
