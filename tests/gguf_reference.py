"""The reference implementation the fidelity tests compare against: transformers reading a GGUF,
and transformers' own greedy decoding (`hf_greedy`)."""

import contextlib
import os


def hf_from_gguf(path: str):
    """transformers' model (float32, eval) and tokenizer read from a GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    with _one_parse_per_file():
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, tok


@contextlib.contextmanager
def _one_parse_per_file():
    """transformers parses the file's metadata anew for the tokenizer, the config and the weights
    (gguf's GGUFReader, field by field): 16 s each for Gemma's 262k-token vocabulary. The reader
    only reads the file, which does not change, so the three loads share one; what transformers
    does with it is unchanged."""
    import gguf

    parse, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = parse(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = parse


def hf_greedy(model, token_ids: list[int], max_new: int) -> list[int]:
    """Greedy decoding with transformers' own KV cache, EOS not special (like ignore_eos). Only
    the last position's logits are computed (`logits_to_keep=1`, as transformers' generate does):
    the same numbers, where the prompt's other positions through the LM head were most of a long
    prompt's step (Gemma's 262k-token vocabulary)."""
    import torch

    out, past, cur = [], None, torch.tensor([token_ids])
    with torch.inference_mode():
        for _ in range(max_new):
            step = model(input_ids=cur, past_key_values=past, use_cache=True, logits_to_keep=1)
            past = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            cur = torch.tensor([[out[-1]]])
    return out
