"""Structured outputs: grammar-constrained decoding and logit_bias, as one step of the sampler.

A request may carry a `StructuredSpec` (a JSON schema, "any JSON object", a regex, a choice
among strings, or a Lark grammar) and a `logit_bias` (token id -> added logit in [-100, 100]).

The grammar backend is llguidance. Its tokenizer is built once per engine from our own
`Tokenizer` (the same tokenizers.json the router and the engine encode with), with every EOS id
of ours as its end-of-sequence set, so the mask allows EOS exactly where the grammar may end
and only EOS once the grammar has terminated (the request then finishes with "stop").

    backend = GrammarBackend(tokenizer)          # one per engine
    backend.compile(spec)                        # any thread; cached by (kind, text); timeout
    matcher = backend.matcher(spec)              # per request: a fresh copy of the compiled one
    apply_constraints(logits, rows)              # in the sampler, before penalties/temperature
    matcher.accept(token_id) / rollback(n) / is_terminated

`apply_constraints` adds each row's logit_bias, then sets to -inf every token the row's
matcher forbids, for greedy and sampled rows alike. Compilation cannot be interrupted (the
library holds no cancel point), so a compile running past the timeout is left to finish in its
worker thread, the request gets InvalidRequestError at once, and the same grammar text is then
refused at once without compiling again.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import numpy as np
import torch

from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.sampling.constraints import StructuredSpec, validate_logit_bias  # noqa: F401 (re-export)

DEFAULT_COMPILE_TIMEOUT_S = 5.0
# JSON is written on one line with ", " and ": " and no other whitespace: a small model given
# free whitespace can fill max_tokens with newlines (seen with SmolLM2 on an off-topic prompt).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llg():
    import llguidance  # imported on first use: engines that never constrain never load it

    return llguidance


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar for a spec (not yet checked: compiling checks it)."""
    llg = _llg()
    if spec.kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
    if spec.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        return llg.grammar_from("choice", spec.value)
    return llg.grammar_from("grammar", spec.value)


class Matcher:
    """One request's grammar state. Not thread-safe: the engine thread alone uses it."""

    def __init__(self, inner):
        self._inner = inner

    def bitmask(self) -> bytes:
        """Allowed next tokens, one bit per token id (little-endian within each byte)."""
        return self._inner.compute_bitmask()

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar did not allow it."""
        return bool(self._inner.consume_token(token_id)) and not self._inner.is_error()

    def accept_all(self, token_ids: Sequence[int]) -> bool:
        return all(self.accept(t) for t in token_ids)

    def rollback(self, num_tokens: int) -> bool:
        return bool(self._inner.rollback(num_tokens))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and admits nothing more (only EOS is allowed next)."""
        return bool(self._inner.is_stopped())

    @property
    def can_end(self) -> bool:
        return bool(self._inner.is_accepting())

    @property
    def error(self) -> str | None:
        return self._inner.get_error() if self._inner.is_error() else None


@dataclass
class CompileStats:
    """Running totals the worker exports as metrics (written on the engine and compile threads,
    read by the metrics task; `take_compile_seconds` drains the durations not yet exported)."""

    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: list[float] = field(default_factory=list)  # the last 1,024 compile durations
    mask_seconds: float = 0.0
    mask_rows: int = 0
    requests: dict[str, int] = field(default_factory=dict)  # constrained requests by kind
    _unexported: list[float] = field(default_factory=list)

    def record_compile(self, seconds: float) -> None:
        self.compiles += 1
        self.compile_seconds = [*self.compile_seconds[-1023:], seconds]
        self._unexported.append(seconds)

    def take_compile_seconds(self) -> list[float]:
        taken, self._unexported = self._unexported, []
        return taken


class GrammarBackend:
    """Compiles specs for one tokenizer; thread-safe. See the module docstring."""

    def __init__(
        self,
        tokenizer,
        *,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        cache_size: int = 512,
        max_workers: int = 2,
    ):
        if not compile_timeout_s > 0:
            raise InvalidRequestError(f"compile_timeout_s={compile_timeout_s!r} is invalid; allowed: a number > 0")
        self.compile_timeout_s = compile_timeout_s
        self._tokenizer = tokenizer
        self._llg_tokenizer = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._cache_size = cache_size
        self._timed_out: set[tuple[str, str]] = set()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self.stats = CompileStats()

    @property
    def llg_tokenizer(self):
        with self._lock:
            if self._llg_tokenizer is None:
                tok = self._tokenizer
                self._llg_tokenizer = _llg().LLTokenizer(
                    tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_token_ids)
                )
            return self._llg_tokenizer

    def compile(self, spec: StructuredSpec):
        """The compiled (pristine) matcher for `spec`, from the cache or compiled now in a worker
        thread; raises InvalidRequestError for a bad grammar or one compiling past the timeout."""
        with self._lock:
            cached = self._cache.get(spec.key)
            if cached is not None:
                self._cache.move_to_end(spec.key)
                self.stats.cache_hits += 1
                return cached
            if spec.key in self._timed_out:
                raise self._timeout_error(spec)
        tokenizer = self.llg_tokenizer
        future = self._pool.submit(self._compile_now, spec, tokenizer)
        try:
            compiled = future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            with self._lock:
                self._timed_out.add(spec.key)
            raise self._timeout_error(spec) from None
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredSpec) -> Matcher:
        matcher = Matcher(self.compile(spec).deep_copy())
        self.stats.requests[spec.kind] = self.stats.requests.get(spec.kind, 0) + 1
        return matcher

    def _compile_now(self, spec: StructuredSpec, tokenizer):
        t0 = time.perf_counter()
        try:
            text = grammar_text(spec)
        except ValueError as exc:
            raise InvalidRequestError(f"{spec.field}: {exc}") from None
        inner = _llg().LLMatcher(tokenizer, text, log_level=0)
        if inner.is_error():
            raise InvalidRequestError(
                f"{spec.field}: the {spec.kind} constraint does not compile: {_first_line(inner.get_error())}"
            )
        self.stats.record_compile(time.perf_counter() - t0)
        return inner

    def _timeout_error(self, spec: StructuredSpec) -> InvalidRequestError:
        return InvalidRequestError(
            f"{spec.field}: the {spec.kind} constraint did not compile within "
            f"{self.compile_timeout_s:g} s; allowed: a simpler schema or pattern"
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _first_line(message: str) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return "; ".join(lines[:3])[:500]


def needs_constraints(row) -> bool:
    return getattr(row, "matcher", None) is not None or bool(row.params.logit_bias)


def apply_constraints(logits: torch.Tensor, rows: Sequence, stats: CompileStats | None = None) -> torch.Tensor:
    """logit_bias, then the grammar masks, for the rows that have them; returns new logits
    (the input is not modified) or the input itself when no row is constrained."""
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    masked = [i for i, row in enumerate(rows) if getattr(row, "matcher", None) is not None]
    if not biased and not masked:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in biased:
        ids, values = zip(*((t, b) for t, b in rows[i].params.logit_bias if t < vocab), strict=False) or ((), ())
        if ids:
            logits[i, list(ids)] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
    if masked:
        t0 = time.perf_counter()
        allowed = _allowed(rows, masked, vocab)
        rows_index = torch.tensor(masked, device=logits.device)
        picked = logits.index_select(0, rows_index).masked_fill(~allowed.to(logits.device), float("-inf"))
        logits.index_copy_(0, rows_index, picked)
        if stats is not None:
            stats.mask_seconds += time.perf_counter() - t0
            stats.mask_rows += len(masked)
    return logits


def _allowed(rows: Sequence, masked: list[int], vocab: int) -> torch.Tensor:
    """[len(masked), vocab] bool: the tokens each masked row's grammar allows next."""
    words = b"".join(rows[i].matcher.bitmask() for i in masked)
    bits = np.unpackbits(np.frombuffer(words, dtype=np.uint8), bitorder="little").reshape(len(masked), -1)
    if bits.shape[1] < vocab:  # logits wider than the tokenizer's vocabulary: the padding is never allowed
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    return torch.from_numpy(bits[:, :vocab].astype(bool))
