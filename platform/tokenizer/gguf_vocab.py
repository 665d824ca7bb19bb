"""A GGUF file's tokenizer metadata turned into a `tokenizers.Tokenizer`.

A GGUF has no tokenizer.json: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`), its
token types, scores, merges and special ids as metadata key/values at the head of the file. They
are read by the one GGUF reader (formats/gguf_file.py, metadata only: ~0.1 s for SmolLM2's 49152
tokens + 48900 merges, where `gguf.GGUFReader` takes 3.4 s).

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

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from splitserve.platform.errors import UnsupportedModelError

TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4

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
