"""The reference implementation the fidelity tests compare against: transformers reading a GGUF."""

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
