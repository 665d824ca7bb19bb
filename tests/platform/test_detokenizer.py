"""Streaming detokenization: the deltas always add up to the full decode, and never show half a
character."""

import random

import pytest

from splitserve.platform.engine.detokenizer import IncrementalDetokenizer
from splitserve.platform.tokenizer import Tokenizer
from splitserve.platform.tokenizer.gguf_vocab import build_gguf_tokenizer

REPLACEMENT = "\ufffd"
TEXTS = [
    "Hello, world! How are you today?",
    "emoji 😀👍🏽 and 🇫🇷 flags 😀😀",
    "中文字符和日本語のテキスト",
    "Ünïcödé àccénts: façade, naïve",
    "def f(x):\n    return x ** 2\n\n\n",
    "  spaces   everywhere  ",
    "digits 1234567890",
]

# A tiny SentencePiece vocabulary (see test_tokenizer.py), built from metadata without a file.
SPM_PIECES = [
    "▁",
    "h",
    "e",
    "l",
    "o",
    "w",
    "r",
    "d",
    "t",
    "a",
    "he",
    "ll",
    "llo",
    "hello",
    "▁hello",
    "or",
    "wor",
    "ld",
    "world",
    "▁world",
    "▁t",
    "▁the",
    "th",
]
SPM_TOKENS = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *SPM_PIECES, "<|user|>"]
SPM_ID = {token: index for index, token in enumerate(SPM_TOKENS)}


@pytest.fixture(scope="module")
def smollm(smollm2_gguf_path):
    return Tokenizer.from_gguf(smollm2_gguf_path)


@pytest.fixture(scope="module")
def spm():
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": SPM_TOKENS,
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [3],
    }
    return Tokenizer(build_gguf_tokenizer(metadata), special_tokens={"bos": "<s>", "eos": "</s>", "unk": "<unk>"})


def stream(tokenizer, ids, chunk_sizes=(1,), skip_special_tokens=True):
    """Push `ids` in chunks (sizes cycled); return the deltas, the flush last."""
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[1, 2, 3], skip_special_tokens=skip_special_tokens)
    deltas, start, index = [], 0, 0
    while start < len(ids):
        size = chunk_sizes[index % len(chunk_sizes)]
        deltas.append(detok.push(ids[start : start + size]))
        start, index = start + size, index + 1
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk_sizes", [(1,), (2, 3), (7,)])
def test_deltas_add_up_to_the_full_decode(smollm, text, chunk_sizes):
    ids = smollm.encode(text)
    deltas = stream(smollm, ids, chunk_sizes)
    assert "".join(deltas) == smollm.decode(ids) == text
    assert not any(REPLACEMENT in delta for delta in deltas), deltas


def test_emoji_is_held_until_its_last_byte_token(smollm):
    ids = smollm.encode("a😀b")
    assert smollm.convert_ids_to_tokens(ids) == ["a", "ðŁ", "ĺ", "Ģ", "b"]
    assert stream(smollm, ids) == ["a", "", "", "😀", "b", ""]


def test_a_character_that_never_completes_is_flushed_as_replacement(smollm):
    ids = smollm.encode("ok😀")[:-1]  # the emoji's last byte never arrives
    deltas = stream(smollm, ids)
    assert deltas == ["ok", "", "", REPLACEMENT]
    assert "".join(deltas) == smollm.decode(ids)


@pytest.mark.parametrize(
    "skip_special_tokens, expected",
    [
        (True, ["", "Hi", "", " there", "", "", ""]),
        (False, ["<|im_start|>", "Hi", "<|im_end|>", " there", "<|endoftext|>", "<|im_end|>", ""]),
    ],
)
def test_skip_special_tokens(smollm, skip_special_tokens, expected):
    ids = [1, *smollm.encode("Hi"), 2, *smollm.encode(" there"), 0, 2]
    deltas = stream(smollm, ids, skip_special_tokens=skip_special_tokens)
    assert deltas == expected
    assert "".join(deltas) == smollm.decode(ids, skip_special_tokens=skip_special_tokens)


def test_sentencepiece_leading_space_matches_full_decode(spm):
    ids = [SPM_ID["▁hello"], SPM_ID["▁world"], SPM_ID["▁the"], SPM_ID["▁"], SPM_ID["▁hello"]]
    assert stream(spm, ids) == ["hello", " world", " the", " ", " hello", ""]
    assert spm.decode(ids) == "hello world the  hello"


def test_sentencepiece_byte_fallback_is_held_until_complete(spm):
    snowman = [3 + 0xE2, 3 + 0x98, 3 + 0x83]  # ☃ as three <0xNN> tokens
    ids = [SPM_ID["▁hello"], *snowman, SPM_ID["▁world"]]
    assert stream(spm, ids) == ["hello", "", "", "☃", " world", ""]
    assert stream(spm, [1, *snowman]) == ["", "", "", "☃", ""]  # after a skipped BOS, no space to strip


def test_sentencepiece_invalid_byte_run_keeps_what_was_shown(spm):
    # tokenizers' ByteFallback turns a whole run of byte tokens into U+FFFD once any byte in it is
    # invalid; the stream already showed "ʗ" (0xCA 0x97) before the bad 0xFF arrived. Documented.
    ids = [SPM_ID["▁hello"], 3 + 0xCA, 3 + 0x97, 3 + 0xFF, SPM_ID["▁world"]]
    assert stream(spm, ids) == ["hello", "", "ʗ", "", "\ufffd\ufffd world", ""]
    assert spm.decode(ids) == "hello\ufffd\ufffd\ufffd world"


def random_smollm_ids(rng, tokenizer):
    # low ids are specials, 100..300 are single bytes (emoji pieces among them), then anything
    return [
        rng.choice([rng.randrange(20), rng.randrange(100, 300), rng.randrange(tokenizer.vocab_size)])
        for _ in range(rng.randrange(1, 30))
    ]


def random_spm_ids(rng, tokenizer):
    # pieces, specials, and valid characters spelled as <0xNN> byte tokens
    ids = []
    for _ in range(rng.randrange(1, 15)):
        if rng.random() < 0.4:
            ids.extend(3 + byte for byte in rng.choice("é☃😀中ʗa\n ").encode("utf-8"))
        else:
            ids.append(rng.choice([*range(3), *range(259, tokenizer.vocab_size)]))
    return ids


@pytest.mark.parametrize("which", ["smollm", "spm"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_in_random_chunks(request, which, skip_special_tokens):
    tokenizer = request.getfixturevalue(which)
    rng = random.Random(f"{which}-{skip_special_tokens}")
    for _ in range(300):
        ids = random_smollm_ids(rng, tokenizer) if which == "smollm" else random_spm_ids(rng, tokenizer)
        chunks = tuple(rng.randrange(1, 4) for _ in range(3))
        deltas = stream(tokenizer, ids, chunks, skip_special_tokens)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), ids


class _CountingBackend:
    """Wraps a tokenizers.Tokenizer and records how many ids each decode call gets."""

    def __init__(self, backend):
        self._backend, self.window_sizes = backend, []

    def decode(self, ids, skip_special_tokens):
        self.window_sizes.append(len(ids))
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_step_decodes_a_small_window(smollm):
    counting = _CountingBackend(smollm.backend)
    spy = type("SpyTokenizer", (), {"backend": counting})()
    ids = smollm.encode("The quick brown fox 😀 jumps over the lazy dog. " * 50)
    detok = IncrementalDetokenizer(spy, prompt_token_ids=[], skip_special_tokens=True)
    text = "".join(detok.push([token_id]) for token_id in ids) + detok.flush()
    assert text == smollm.decode(ids)
    assert len(ids) > 500 and max(counting.window_sizes) <= 5  # emoji = 3 held tokens + 1 + context
