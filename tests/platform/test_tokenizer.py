"""The torch-free tokenizer against transformers' own GGUF loader: same ids, text and prompts."""

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import tokenizers

from splitserve.platform.errors import ConfigError, InvalidRequestError, UnsupportedModelError
from splitserve.platform.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Hello, world!",
    "12345",
    "Pi is 3.14159 and 1,000,000 is big; x2 = 7e10",
    "  leading spaces",
    "trailing spaces   ",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\n\nline five\r\nwindows",
    "def f(x):\n    return x ** 2  # square\n",
    "emoji 😀👍🏽 and 🇫🇷 flags",
    "中文字符和日本語のテキスト",
    "Ünïcödé àccénts: façade, naïve, Ångström",
    "<|im_start|>user\nhi<|im_end|>",
    "text with <|endoftext|> inside and <repo_name>",
    "not special: <|im_start and im_end|>",
    "",
    " ",
    "a" * 300,
]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is 2+2?"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    "multi_turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! 😀"},
        {"role": "user", "content": "Write code:\n```py\nprint(1)\n```"},
    ],
    "system_multi_turn": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
}


@pytest.fixture(scope="module")
def ours(smollm2_gguf_path):
    return Tokenizer.from_gguf(smollm2_gguf_path)


@pytest.fixture(scope="module")
def reference(smollm2_gguf_path):
    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf_path
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


# ---- SmolLM2 (byte-level BPE, pre "smollm") ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(ours, reference, text):
    for add_special_tokens in (True, False):
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == reference.encode(text, add_special_tokens=add_special_tokens)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, reference, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    assert ours.encode_chat(messages, add_generation_prompt) == reference.encode(expected, add_special_tokens=False)


def test_smollm2_hand_checked_ids(ours):
    assert ours.encode("12345") == [33, 34, 35, 36, 37]  # one token per digit
    assert ours.encode("<|im_start|>hi<|im_end|>") == [1, 6004, 2]  # specials stay whole
    assert ours.decode([1, 6004, 2]) == "hi"
    assert ours.decode([1, 6004, 2], skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    assert ours.encode_chat([{"role": "user", "content": "hi"}])[:3] == [1, 9690, 198]  # "<|im_start|>system\n"


def test_smollm2_vocabulary(ours):
    assert (ours.vocab_size, ours.bos_token_id, ours.eos_token_id) == (49152, 1, 2)
    assert ours.eos_token_ids == frozenset({2})  # <|endoftext|> (0) is not used by the template
    assert ours.all_special_ids == list(range(17))  # the 17 control tokens
    assert ours.id_to_token(1) == "<|im_start|>"
    assert ours.convert_ids_to_tokens([6004, 216, 198]) == ["hi", "Ġ", "Ċ"]


@pytest.mark.parametrize(
    "template, eos_ids",
    [
        ("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}", {0, 2}),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", {0}),
    ],
)
def test_eos_ids_add_end_of_turn_tokens_the_template_uses(ours, template, eos_ids):
    tok = Tokenizer(ours.backend, special_tokens={"eos": "<|endoftext|>"}, chat_template=template)
    assert tok.eos_token_ids == frozenset(eos_ids)


@pytest.mark.parametrize(
    "messages, error",
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\]\['role'\] must be a non-empty string"),
        ([{"role": "", "content": "hi"}], r"messages\[0\]\['role'\]"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], r"messages\[1\]\['content'\] must be a string"),
        ([{"role": "user", "content": ["parts"]}], r"messages\[0\]\['content'\] must be a string, got list"),
    ],
)
def test_invalid_messages_are_rejected(ours, messages, error):
    with pytest.raises(InvalidRequestError, match=error):
        ours.apply_chat_template(messages)


def test_template_errors_and_missing_template(ours):
    strict = Tokenizer(ours.backend, special_tokens={}, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        strict.encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer(ours.backend, special_tokens={}).apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ConfigError, match="does not parse"):
        Tokenizer(ours.backend, special_tokens={}, chat_template="{% if %}").apply_chat_template(
            [{"role": "user", "content": "hi"}]
        )


def test_template_helpers_render_like_transformers(ours):
    template = (
        "{{ bos_token }}{{ messages | tojson }}{% for m in messages %}{% if loop.index > 1 %}{% break %}"
        "{% endif %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}{{ extra }}"
    )
    tok = Tokenizer(ours.backend, special_tokens={"bos": "<|im_start|>"}, chat_template=template)
    messages = [{"role": "user", "content": "é<b>"}, {"role": "user", "content": "no"}]
    assert tok.apply_chat_template(messages, extra="!") == (
        '<|im_start|>[{"role": "user", "content": "é<b>"}, {"role": "user", "content": "no"}]é<b>!'
    )


def test_invalid_inputs(ours):
    with pytest.raises(InvalidRequestError, match="must be a string"):
        ours.encode(["not", "text"])
    with pytest.raises(InvalidRequestError, match=r"\[0, 49152\)"):
        ours.decode([5, 49152])


def test_saved_tokenizer_json_encodes_identically(ours, tmp_path):
    path = str(tmp_path / "tokenizer.json")
    ours.save_tokenizer_json(path)
    reloaded = tokenizers.Tokenizer.from_file(path)
    for text in TEXTS:
        assert reloaded.encode(text).ids == ours.encode(text)


def test_hf_folder_round_trip(ours, tmp_path):
    ours.save_tokenizer_json(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": {"content": "<|im_end|>"},
                "add_bos_token": True,
                "chat_template": ours.chat_template,
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "config.json").write_text("{}")
    tok = Tokenizer.from_model(str(tmp_path))
    assert tok.encode("hi there") == [1, *ours.encode("hi there")]  # add_bos_token=True from the config
    assert tok.encode("hi there", add_special_tokens=False) == ours.encode("hi there")
    assert tok.eos_token_ids == frozenset({0, 2})
    messages = CONVERSATIONS["system"]
    assert tok.apply_chat_template(messages) == ours.apply_chat_template(messages)


def test_model_names(smollm2_gguf_path):
    assert load_tokenizer("random:tiny") is None
    with pytest.raises(ConfigError, match="random preset"):
        Tokenizer.from_model("random:tiny")
    assert load_tokenizer("smollm2-135m").encode("12345") == [33, 34, 35, 36, 37]


def test_unreadable_gguf_files(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"NOTAGGUF" + bytes(64))
    with pytest.raises(UnsupportedModelError, match="not a GGUF file"):
        Tokenizer.from_gguf(str(tmp_path / "bad.gguf"))
    writer = gguf.GGUFWriter(str(tmp_path / "weights-only.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="no tokenizer metadata"):
        Tokenizer.from_gguf(str(tmp_path / "weights-only.gguf"))


def test_modules_do_not_import_torch():
    code = (
        "import sys, splitserve.platform.tokenizer, splitserve.platform.engine.detokenizer, "
        "splitserve.platform.engine.stop; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ---- Byte-level BPE with other pre-tokenizers, written to a GGUF here ---------------------------
BPE_MERGES = ["Ġ t", "h e", "Ġt he", "Ġ 1", "1 2", "12 3", "Ġ a", "' s", "i n", "Ġ in"]
BPE_TEXTS = ["the 123 in it's", " 12345 the<|endoftext|>", "😀 x", "I'M here'S\n\n  \tok", "a,b;;c... ???"]
# How each pre-tokenizer cuts " 12345 it's" (llama3 groups digits by three, qwen2 one by one).
BPE_SPLITS = {
    "llama-bpe": ["Ġ", "123", "45", "Ġit", "'s"],
    "qwen2": ["Ġ", "1", "2", "3", "4", "5", "Ġit", "'s"],
    "gpt-2": ["Ġ12345", "Ġit", "'s"],
}


def write_byte_level_gguf(path: str, pre: str) -> None:
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|endoftext|>", *alphabet, *("".join(merge.split()) for merge in BPE_MERGES)]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_token_merges(BPE_MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow
@pytest.mark.parametrize("pre", sorted(BPE_SPLITS))
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, pre):
    transformers = pytest.importorskip("transformers")
    write_byte_level_gguf(str(tmp_path / "bpe.gguf"), pre)
    ours = Tokenizer.from_gguf(str(tmp_path / "bpe.gguf"))
    pieces = [piece for piece, _ in ours.backend.pre_tokenizer.pre_tokenize_str(" 12345 it's")]
    assert pieces == BPE_SPLITS[pre]
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="bpe.gguf")
    for text in BPE_TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


# ---- A SentencePiece ("llama") vocabulary, written to a GGUF here -------------------------------
# Scores make BPE merge h+e, l+l, ll+o, he+llo, ▁+hello (and the same for "world"), best first.
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
SPM_TOKENS = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *SPM_PIECES, "<|user|>", "<think>"]
SPM_ID = {token: index for index, token in enumerate(SPM_TOKENS)}
SPM_TEXTS = [
    "hello world",
    " hello",
    "hello  world",
    "<s>hello<|user|>the world</s>",
    "héllo ☃ 😀",
    "hello<think>world",
    "",
    " ",
    "the\nworld\t",
    "<unk>x",
    "world hello the",
]


def write_spm_gguf(path: str) -> None:
    """A tokenizer-only "llama" GGUF: unk/bos/eos, 256 byte tokens, pieces, a control and a user token."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(SPM_TOKENS)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0, 0.0])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [3, 4])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}<|user|>{{ m['content'] }}</s>{% endfor %}")
    writer.add_tensor("token_embd.weight", np.zeros((len(SPM_TOKENS), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def spm_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spm") / "tiny-spm.gguf")
    write_spm_gguf(path)
    return path


@pytest.fixture(scope="module")
def spm(spm_path):
    return Tokenizer.from_gguf(spm_path)


def test_spm_hand_checked_ids(spm):
    assert spm.encode("hello world") == [1, SPM_ID["▁hello"], SPM_ID["▁world"]]  # BOS added by default
    byte = lambda b: 3 + b  # noqa: E731  <0x00> is id 3
    assert spm.encode("hé", add_special_tokens=False) == [SPM_ID["▁"], SPM_ID["h"], byte(0xC3), byte(0xA9)]
    assert spm.encode("<s>hello<|user|>", add_special_tokens=False) == [1, SPM_ID["hello"], SPM_ID["<|user|>"]]
    assert spm.decode([1, SPM_ID["▁hello"], SPM_ID["▁world"], 2]) == "hello world"
    assert spm.decode([SPM_ID["hello"], SPM_ID["<|user|>"], SPM_ID["<think>"]]) == "hello<think>"
    assert (spm.bos_token_id, spm.eos_token_id, spm.eos_token_ids) == (1, 2, frozenset({2}))
    assert spm.all_special_ids == [0, 1, 2, SPM_ID["<|user|>"]]


@pytest.mark.parametrize("text", [text for text in SPM_TEXTS if not text.startswith(" ")])
def test_spm_round_trip(spm, text):
    ids = spm.encode(text, add_special_tokens=False)
    assert spm.decode(ids, skip_special_tokens=False) == text


def test_spm_leading_space_joins_the_dummy_prefix(spm):
    # Metaspace does not prepend "▁" to text that already starts with a space (transformers agrees).
    assert spm.encode(" hello", add_special_tokens=False) == [SPM_ID["▁hello"]]
    assert spm.decode(spm.encode(" hello")) == "hello"


@pytest.mark.slow
def test_spm_matches_transformers(spm, spm_path):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(spm_path), gguf_file=os.path.basename(spm_path)
    )
    for text in SPM_TEXTS:
        ids = spm.encode(text)
        assert ids == reference.encode(text), text
        for skip in (True, False):
            assert spm.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    messages = CONVERSATIONS["multi_turn"]
    assert spm.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_spm_saved_tokenizer_json_keeps_bos(spm, tmp_path):
    spm.save_tokenizer_json(str(tmp_path / "tokenizer.json"))
    reloaded = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in SPM_TEXTS:
        assert reloaded.encode(text).ids == spm.encode(text)
