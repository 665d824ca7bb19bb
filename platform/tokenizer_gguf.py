"""A GGUF file's tokenizer metadata, read fast and turned into a `tokenizers.Tokenizer`.

A GGUF has no tokenizer.json: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`), its
token types, scores, merges and special ids as metadata key/values at the head of the file.

Reading. `gguf.GGUFReader` builds a numpy view per array element and parses every tensor
header: 3.4 s for SmolLM2's 49152 tokens + 48900 merges. The metadata is a flat sequence of
(key, type, value) records, so we walk it once over an mmap with `struct` and stop before the
tensor infos (~0.1 s). Strings are UTF-8 with a u64 length; arrays are (elem type u32, count
u64, elems); numeric arrays are sliced out whole with numpy.

Building, mirroring what transformers' GGUF converter does (so ids match it exactly):
- "gpt2" (byte-level BPE): tokens not spelled in the byte alphabet are respelled byte by byte;
  merges come from the file. Pre-tokenizer by `tokenizer.ggml.pre`: "smollm" splits each digit
  first then ByteLevel with the GPT-2 regex (SmolLM2's own tokenizer.json; same ids as
  transformers' plain ByteLevel because the vocab holds no multi-digit tokens); llama3-style and
  qwen2-style names use their split regex followed by ByteLevel without regex, as llama.cpp and
  transformers do; anything else gets ByteLevel with the GPT-2 regex.
- "llama" (SentencePiece BPE): BPE with byte fallback over the tokens as spelled ("▁" = space);
  merges from the file, or rebuilt from the scores (every split of a token into two vocab pieces,
  best score first). Metaspace prepends "▁" to the first text segment only ("first", as
  transformers) when `add_space_prefix` (default true); the decoder undoes it.
Control tokens (type 3) become special added tokens (matched whole, skipped on decode with
skip_special_tokens); user-defined ones (type 4) become non-special added tokens: matched whole
but kept on decode, as transformers and llama.cpp render them (e.g. `<think>`).
"""

from __future__ import annotations

import mmap
import struct

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from splitserve.platform.errors import UnsupportedModelError

TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4
_STRING, _ARRAY = 8, 9
_SCALAR_FORMAT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_DTYPE = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")}
_PRE_SPLITS.update({name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen")})


def read_gguf_metadata(path: str, prefixes: tuple[str, ...] = ("tokenizer.", "general.")) -> dict:
    """The metadata values whose keys start with one of `prefixes` (others are skipped unread)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise UnsupportedModelError(f"{path} is not a GGUF file (magic {buf[:4]!r})")
        endian = "<" if struct.unpack_from("<I", buf, 4)[0] in (2, 3) else ">"
        version = struct.unpack_from(endian + "I", buf, 4)[0]
        if version not in (2, 3):
            raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        _, num_kv = struct.unpack_from(endian + "QQ", buf, 8)
        reader, metadata = _Reader(buf, 24, endian), {}
        try:
            for _ in range(num_kv):
                key = reader.string()
                value = reader.value(reader.scalar(4), keep=key.startswith(prefixes))
                if key.startswith(prefixes):
                    metadata[key] = value
        except (struct.error, KeyError, UnicodeDecodeError) as exc:
            raise UnsupportedModelError(
                f"{path}: corrupt GGUF metadata near byte {reader.pos} ({exc!r}); re-download or re-convert the file"
            ) from exc
        return metadata


class _Reader:
    """A cursor over the metadata section; `keep=False` skips a value without decoding it."""

    def __init__(self, buf: mmap.mmap, pos: int, endian: str):
        self.buf, self.pos, self.endian = buf, pos, endian

    def scalar(self, vtype: int):
        fmt = self.endian + _SCALAR_FORMAT[vtype]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self, keep: bool = True) -> str | None:
        (size,) = struct.unpack_from(self.endian + "Q", self.buf, self.pos)
        start, self.pos = self.pos + 8, self.pos + 8 + size
        return self.buf[start : self.pos].decode("utf-8") if keep else None

    def value(self, vtype: int, keep: bool = True):
        if vtype == _STRING:
            return self.string(keep)
        if vtype != _ARRAY:
            return self.scalar(vtype)
        elem_type, count = self.scalar(4), self.scalar(10)
        if elem_type in _NUMPY_DTYPE:
            dtype = np.dtype(_NUMPY_DTYPE[elem_type]).newbyteorder(self.endian)
            start, self.pos = self.pos, self.pos + count * dtype.itemsize
            # Slicing the mmap copies, so no numpy view pins the mapping open.
            return np.frombuffer(self.buf[start : self.pos], dtype=dtype).tolist() if keep else None
        return [self.value(elem_type, keep) for _ in range(count)] if keep else self._skip(elem_type, count)

    def _skip(self, elem_type: int, count: int) -> None:
        for _ in range(count):
            self.value(elem_type, keep=False)


def build_gguf_tokenizer(metadata: dict) -> Tokenizer:
    """The `tokenizers.Tokenizer` the metadata describes (no post-processor: BOS/EOS are the caller's)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(metadata)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(metadata)
    elif kind is None:
        raise UnsupportedModelError(
            "the GGUF file has no tokenizer metadata (tokenizer.ggml.model); "
            "use a GGUF converted with its tokenizer, or send token ids"
        )
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer.ggml.model={kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
            "'llama' (SentencePiece BPE)"
        )
    _add_typed_tokens(tokenizer, metadata, byte_level=kind == "gpt2")
    return tokenizer


def _byte_level_bpe(metadata: dict) -> Tokenizer:
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spelling = _bytes_to_unicode()
    vocab = {}
    for index, token in enumerate(metadata["tokenizer.ggml.tokens"]):
        if not alphabet.issuperset(token):
            token = "".join(spelling[byte] for byte in token.encode("utf-8"))
        vocab[token] = index
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", ())]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_level_pre_tokenizer(pre: str):
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _PRE_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level tokens are spelled in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra, printable = {}, 0, set(printable)
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte], extra = chr(256 + extra), extra + 1
    return chars


def _sentencepiece_bpe(metadata: dict) -> Tokenizer:
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    else:
        scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = merges_from_scores(tokens, scores, vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    return tokenizer


def merges_from_scores(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece merges implied by a scored vocabulary: every way to cut a token into two
    vocab pieces, best score first, then the longer left and right pieces first (transformers'
    `generate_merges` order, so the BPE model agrees with it).

    That order as one sort key, compared in C: score, left length and right length descending,
    ties in vocabulary order (transformers also sorts each token's cuts by the pieces' ids, but a
    token's cuts all differ in left length, so that never decides). 262k tokens: 0.7x the time of
    the two keyed sorts."""
    candidates = []
    for order, (token, score) in enumerate(dict(zip(tokens, scores)).items()):
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab:
                candidates.append((-score, -i, -len(right), order, left, right))
    candidates.sort()  # (order, i) is unique: the pieces themselves are never compared
    return [(left, right) for *_, left, right in candidates]


def _add_typed_tokens(tokenizer: Tokenizer, metadata: dict, byte_level: bool) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens.

    In a byte-level vocabulary a control token spelled outside the byte alphabet is a llama.cpp
    mislabel (adding it would grow the vocabulary), so it is skipped, as transformers does."""
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or ()
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if byte_level else None
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, types)
        if kind == TOKEN_TYPE_CONTROL and (alphabet is None or set(tok) <= alphabet)
    ]
    tokenizer.add_special_tokens(control)
    vocab = tokenizer.get_vocab()
    user = [
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, types)
        if kind == TOKEN_TYPE_USER_DEFINED and tok in vocab
    ]
    tokenizer.add_tokens(user)
