"""Input processing: turns a caller's request into a validated RequestState, or says what is wrong.

Every check a request must pass before it may enter the scheduler lives here: exactly one of
prompt text or token ids, ids inside the vocabulary, a prompt that leaves room to generate, resumed
output that leaves room under max_tokens and max_model_len, a grammar the resumed output follows,
a known LoRA adapter, and a KV export range inside the prompt. A failed check raises
InvalidRequestError (a caller's mistake) and leaves no trace, so the engine keeps serving the
others. It reads the engine's configuration and the LoRA registry; it writes nothing the engine
owns, except that it builds the grammar backend on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from splitserve.platform.config import ModelConfig
from splitserve.platform.engine.kv_connector import KVConnector
from splitserve.platform.engine.kv_handoff import KVExport
from splitserve.platform.engine.request_state import RequestState
from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.hashing import BlockHasher, lora_extra_keys
from splitserve.platform.lora.registry import LoraRegistry
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.sampling.sampler import make_generator, skip_draw
from splitserve.platform.sampling.structured import GrammarBackend, Matcher
from splitserve.platform.sched.request import Request


class InputProcessor:
    def __init__(
        self,
        model_name: str,
        model_config: ModelConfig,
        tokenizer,
        max_model_len: int,
        hasher: BlockHasher,
        eos_token_ids: frozenset[int],
        loras: LoraRegistry,
        connector: KVConnector,
        device: torch.device,
        on_grammars: Callable[[GrammarBackend], None],
    ):
        self.model_name = model_name
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.hasher = hasher
        self.eos_token_ids = eos_token_ids
        self.loras = loras
        self.connector = connector
        self.device = device
        self._on_grammars = on_grammars
        self._grammars: GrammarBackend | None = None

    @property
    def grammars(self) -> GrammarBackend:
        """The grammar backend (built on first use; its compile() is safe from any thread)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise InvalidRequestError(f"model {self.model_name!r} has no tokenizer; constraints need one")
            self._grammars = GrammarBackend(self.tokenizer)
            self._on_grammars(self._grammars)
        return self._grammars

    @property
    def grammar_stats(self):
        """The grammar backend's CompileStats, or None before the first constrained request."""
        return None if self._grammars is None else self._grammars.stats

    def process(
        self,
        req_id: str,
        prompt: str | None,
        params: SamplingParams | None,
        *,
        prompt_token_ids: Sequence[int] | None,
        arrival_time: float | None,
        remote_prefill: bool,
        kv_export: KVExport | None,
        resume_output_token_ids: Sequence[int],
        lora_name: str | None,
        priority: int = 0,
        band: int = 0,
    ) -> RequestState:
        """The validated state of a new request (see LLMEngine.add_request for the arguments)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = self._prompt_token_ids(prompt, prompt_token_ids)
        resumed = self._resume_token_ids(resume_output_token_ids, params, len(token_ids))
        if resumed and (remote_prefill or kv_export is not None):
            raise InvalidRequestError("a resumed request is prefilled locally; it cannot use remote prefill or export")
        if (remote_prefill or kv_export is not None) and (problem := self.connector.transfer_refusal()):
            raise InvalidRequestError(problem)
        if (params.prompt_logprobs is not None or params.embed) and remote_prefill:
            raise InvalidRequestError("prompt_logprobs and embed need the prompt computed here; not remote prefill")
        self._checked_ids("logit_bias", [t for t, _ in params.logit_bias])
        matcher = self._matcher(params, resumed)
        adapter = self.loras.get(lora_name) if lora_name is not None else None
        if kv_export is not None and (problem := self.connector.check_export(kv_export, len(token_ids))):
            raise InvalidRequestError(problem)
        req = Request(
            req_id,
            token_ids,
            params,
            self.hasher,
            self.eos_token_ids,
            arrival_time,
            remote_prefill=remote_prefill,
            output_token_ids=resumed,
            lora_id=adapter.lora_id if adapter else None,
            extra_keys=lora_extra_keys(lora_name, adapter.digest if adapter else None),
            priority=priority,
            band=band,
        )
        generator = make_generator(params.seed, self.device)
        for _ in resumed:  # a seeded request continues its random stream where the first attempt left it
            skip_draw(params, generator)
        return RequestState(
            req,
            generator,
            matcher=matcher,
            adapter=adapter,
            export=kv_export,
            num_exported_blocks=kv_export.start_block if kv_export else 0,
        )

    def _matcher(self, params: SamplingParams, resumed: Sequence[int]) -> Matcher | None:
        """A fresh matcher for a constrained request, advanced past tokens it already generated."""
        if params.structured is None:
            return None
        matcher = self.grammars.matcher(params.structured)
        if not matcher.accept_all([t for t in resumed if t not in self.eos_token_ids]):
            raise InvalidRequestError("resume_output_token_ids do not follow the request's output constraint")
        return matcher

    def _prompt_token_ids(self, prompt: str | None, prompt_token_ids: Sequence[int] | None) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompt (text) or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise InvalidRequestError(f"model {self.model_name!r} has no tokenizer; pass prompt_token_ids")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = self._checked_ids("prompt_token_ids", prompt_token_ids)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty; allowed: at least 1 token")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}; "
                f"allowed: at most {self.max_model_len - 1} prompt tokens (one is needed to generate)"
            )
        return token_ids

    def _checked_ids(self, name: str, token_ids: Sequence[int]) -> list[int]:
        token_ids = list(token_ids)
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{name} has invalid ids {bad[:5]}; allowed: integers in [0, {vocab})")
        return token_ids

    def _resume_token_ids(self, token_ids: Sequence[int], params: SamplingParams, num_prompt: int) -> list[int]:
        token_ids = self._checked_ids("resume_output_token_ids", token_ids)
        if not token_ids:
            return token_ids
        if len(token_ids) >= params.max_tokens:
            raise InvalidRequestError(
                f"{len(token_ids)} resumed tokens leave nothing to generate under "
                f"max_tokens={params.max_tokens}; allowed: fewer than max_tokens"
            )
        if num_prompt + len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt ({num_prompt} tokens) and the resumed output ({len(token_ids)}) reach max_model_len "
                f"{self.max_model_len}; allowed: at most {self.max_model_len - 1} tokens together"
            )
        return token_ids
