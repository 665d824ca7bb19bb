"""The model's tokenizer, torch-free: text <-> token ids, chat templates, end-of-sequence ids.

The router and the engine both load it (the router to hash prompt token ids), so it imports
only `tokenizers`, `jinja2`, numpy and the stdlib. One `Tokenizer` wraps a
`tokenizers.Tokenizer` built from a GGUF file's metadata (tokenizer/gguf_vocab.py) or loaded from a
Hugging Face folder's tokenizer.json. Whether `encode` adds BOS/EOS is baked into the wrapped
tokenizer's post-processor, so `save_tokenizer_json` writes a file that encodes identically.

End-of-sequence rule (`eos_token_ids`): the eos id; plus the GGUF's `eot_token_id` /
`eom_token_id` or the folder's generation_config.json `eos_token_id` (int or list); plus every
token of `END_OF_TURN_TOKENS` that is a special token of this vocabulary and appears literally
in the chat template (the template closes turns with it, so an instruct model emits it when done).
"""

from __future__ import annotations

import json
import os

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as Backend

from splitserve.platform.errors import ConfigError, InvalidRequestError
from splitserve.platform.formats.gguf_file import GGUFFile
from splitserve.platform.model_source import resolve_model
from splitserve.platform.tokenizer.chat_template import render_chat_template, validate_messages
from splitserve.platform.tokenizer.gguf_vocab import build_gguf_tokenizer

END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|end|>",
    "<|return|>",
    "</s>",
)
_NAMED_SPECIALS = ("bos", "eos", "unk", "pad")


LARGE_TEXT_CHARS = 64 * 1024  # from here on `encode` goes through encode_batch (same ids, GIL released)

# Template variables the tokenizer sets itself: a request's chat_template_kwargs may not name them.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "source", "special_tokens"})


def check_chat_template_kwargs(kwargs: dict | None) -> None:
    """InvalidRequestError when a request's chat_template_kwargs name a variable the tokenizer sets
    itself. Call it before spreading them into encode_chat / apply_chat_template."""
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & (kwargs or {}).keys())
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(reserved)}: send the "
            "conversation as `messages` and the flag as `add_generation_prompt`"
        )


class Tokenizer:
    """Text <-> ids for one model. Immutable after construction; safe to share between threads."""

    def __init__(
        self,
        backend: Backend,
        *,
        special_tokens: dict[str, str | None],
        chat_template: str | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
    ):
        """`backend` already carries its post-processor; `special_tokens` maps "bos"/"eos"/"unk"/
        "pad" to token strings (or None); those in the vocab are marked special if not yet."""
        self._backend = backend
        self._special_tokens = {name: special_tokens.get(name) for name in _NAMED_SPECIALS}
        _mark_special(backend, [tok for tok in self._special_tokens.values() if tok is not None])
        self._chat_template = chat_template
        self._special_ids = frozenset(i for i, added in backend.get_added_tokens_decoder().items() if added.special)
        self._eos_token_ids = self._collect_eos_ids(extra_eos_token_ids)

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        """The tokenizer a GGUF file's metadata describes (see tokenizer/gguf_vocab.py for the rules)."""
        metadata = GGUFFile(path, with_tensors=False).metadata
        backend = build_gguf_tokenizer(metadata)
        tokens = metadata["tokenizer.ggml.tokens"]
        keys = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}
        specials = {name: _token_at(tokens, metadata.get(f"tokenizer.ggml.{key}")) for name, key in keys.items()}
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", metadata["tokenizer.ggml.model"] == "llama")
        add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
        backend.post_processor = _bos_eos_processor(backend, specials, add_bos, add_eos)
        extra = tuple(
            metadata[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in metadata
        )
        return cls(
            backend,
            special_tokens=specials,
            chat_template=metadata.get("tokenizer.chat_template"),
            extra_eos_token_ids=extra,
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        """A Hugging Face folder: tokenizer.json, and tokenizer_config.json /
        chat_template.jinja / generation_config.json when present."""
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise ConfigError(
                f"{path} has no tokenizer.json; convert the tokenizer with transformers' "
                "AutoTokenizer.from_pretrained(...).save_pretrained(...)"
            )
        backend = Backend.from_file(tokenizer_file)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        specials = {name: _token_content(config.get(f"{name}_token")) for name in _NAMED_SPECIALS}
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            backend.post_processor = _bos_eos_processor(
                backend, specials, config.get("add_bos_token", False), config.get("add_eos_token", False)
            )
        eos = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id")
        extra = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return cls(
            backend, special_tokens=specials, chat_template=_hf_chat_template(path, config), extra_eos_token_ids=extra
        )

    @classmethod
    def from_model(cls, model: str) -> Tokenizer:
        """The tokenizer of what `--model` names; ConfigError for a random preset (it has none)."""
        source = resolve_model(model)
        if source.kind == "gguf":
            return cls.from_gguf(source.path)
        if source.kind == "hf":
            return cls.from_hf_dir(source.path)
        raise ConfigError(
            f"model {model!r} is a random preset, which has no tokenizer; send token ids "
            "(prompt_token_ids) or serve a GGUF file / Hugging Face folder"
        )

    # ---- text <-> ids --------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS/EOS added only when the model asks and add_special_tokens."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}")
        if len(text) >= LARGE_TEXT_CHARS:  # encode_batch releases the GIL: a worker thread then stalls no event loop
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`; InvalidRequestError for an id outside [0, vocab_size)."""
        ids = list(token_ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise InvalidRequestError(
                f"token ids must lie in [0, {self.vocab_size}), got min {min(ids)}, max {max(ids)}"
            )
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for a conversation, rendered as transformers renders it."""
        if self._chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt (completions) instead of messages"
            )
        check_chat_template_kwargs(kwargs)
        specials = {f"{name}_token": tok for name, tok in self._special_tokens.items() if tok is not None}
        return render_chat_template(
            self._chat_template, validate_messages(messages), add_generation_prompt, specials, **kwargs
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Token ids of the rendered conversation; the template writes any BOS itself."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    # ---- vocabulary ----------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        """The wrapped `tokenizers.Tokenizer` (read-only use: the detokenizer decodes with it)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (the model's embedding may be larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of(self._special_tokens["bos"])

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of(self._special_tokens["eos"])

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation (rule in the module docstring)."""
        return self._eos_token_ids

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of every special token (the ones decode drops with skip_special_tokens), sorted."""
        return sorted(self._special_ids)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def id_to_token(self, token_id: int) -> str | None:
        """The token's spelling in the vocabulary (byte-level or "▁" form), None if unknown."""
        return self._backend.id_to_token(token_id)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str | None]:
        return [self._backend.id_to_token(i) for i in token_ids]

    def save_tokenizer_json(self, path: str) -> None:
        """Write tokenizer.json; `tokenizers.Tokenizer.from_file(path)` encodes identically."""
        self._backend.save(path)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _collect_eos_ids(self, extra: tuple[int, ...]) -> frozenset[int]:
        ids = {i for i in (self.eos_token_id, *extra) if i is not None}
        for token in END_OF_TURN_TOKENS:
            token_id = self._backend.token_to_id(token)
            if token_id in self._special_ids and token in (self._chat_template or ""):
                ids.add(token_id)
        return frozenset(ids)


def load_tokenizer(model: str) -> Tokenizer | None:
    """`Tokenizer.from_model(model)`, or None for a random preset (it has no tokenizer)."""
    if resolve_model(model).kind == "random":
        return None
    return Tokenizer.from_model(model)


def _mark_special(backend: Backend, tokens: list[str]) -> None:
    """Make named special tokens that sit in the vocabulary as plain tokens special added
    tokens (transformers does the same); existing added tokens keep their settings."""
    added = {tok.content for tok in backend.get_added_tokens_decoder().values()}
    new = [
        AddedToken(tok, normalized=False, special=True)
        for tok in dict.fromkeys(tokens)
        if tok not in added and backend.token_to_id(tok) is not None
    ]
    backend.add_special_tokens(new)


def _bos_eos_processor(backend: Backend, specials: dict, add_bos: bool, add_eos: bool):
    """transformers' `update_post_processor`: `[bos] $A [eos]` as the flags say."""
    bos, eos = specials.get("bos"), specials.get("eos")
    add_bos, add_eos = bool(add_bos and bos is not None), bool(add_eos and eos is not None)
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    pairs = [(tok, backend.token_to_id(tok)) for tok, used in ((bos, add_bos), (eos, add_eos)) if used]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=pairs)


def _token_at(tokens: list[str], token_id: int | None) -> str | None:
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _token_content(value: object) -> str | None:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(path: str, config: dict) -> str | None:
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template") or _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
