"""Streaming token ids -> text deltas, one request at a time.

Algorithm (vLLM's prefix-offset / read-offset technique). Decoding one token alone is wrong in
two ways: a byte-level token may hold only part of a UTF-8 character, and a SentencePiece
decoder strips the leading space of whatever it decodes first. So keep two offsets into the
output ids: text up to `read_offset` has been emitted, and `prefix_offset..read_offset` is a
short window of already-emitted tokens used as context. Each step decodes
`ids[prefix_offset:read_offset]` and `ids[prefix_offset:]` and emits the difference. While the
new text ends in U+FFFD (an incomplete character) or adds nothing (e.g. a skipped special
token), nothing is emitted and the offsets stay, so the window grows until the character
completes; on emit, the window slides: `prefix_offset = read_offset; read_offset = len(ids)`.
Each step decodes only the window, so the cost per token is O(1) amortised.

Invariant: the concatenation of every delta and `flush()` equals
`tokenizer.decode(output_ids, skip_special_tokens)` -- the output decoded on its own, as
transformers' generate + decode gives it. So the prompt is not used as context (with it, a
SentencePiece model's first word would gain a leading space the full decode strips); the
`prompt_token_ids` argument is kept so callers need not change if that policy ever does.
One exception, for invalid UTF-8 only: tokenizers' ByteFallback decoder (SentencePiece) turns a
whole run of <0xNN> tokens into U+FFFD once any byte of the run is invalid, so a full decode
replaces characters the stream had already shown; the stream keeps them (as vLLM's does).
"""

from __future__ import annotations

from splitserve.platform.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Owns the output ids and offsets of one request; `push` and `flush` are its only writers."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self._backend = tokenizer.backend
        del prompt_token_ids  # not used as context: see the module docstring
        self._skip_special_tokens = skip_special_tokens
        self._output_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    @property
    def output_token_ids(self) -> list[int]:
        return list(self._output_ids)

    def push(self, token_ids: list[int]) -> str:
        """Append newly generated ids; return the text they complete ("" while a character is
        still incomplete or the ids decode to nothing)."""
        self._output_ids.extend(token_ids)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(_INCOMPLETE):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """At the end of generation: the held-back text, U+FFFD included for a character that
        never completed."""
        if self._read_offset == len(self._output_ids):
            return ""
        prefix_text, new_text = self._decode_window()
        return self._emit(new_text[len(prefix_text) :])

    def _decode_window(self) -> tuple[str, str]:
        ids, start = self._output_ids, self._prefix_offset
        prefix_text = self._backend.decode(
            ids[start : self._read_offset], skip_special_tokens=self._skip_special_tokens
        )
        new_text = self._backend.decode(ids[start:], skip_special_tokens=self._skip_special_tokens)
        return prefix_text, new_text

    def _emit(self, delta: str) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._output_ids)
        if delta:
            self._chunks.append(delta)
        return delta
