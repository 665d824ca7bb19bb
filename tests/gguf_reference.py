"""The reference implementation the fidelity tests compare against: transformers reading a GGUF."""

import os


def hf_from_gguf(path: str):
    """transformers' model (float32, eval) and tokenizer read from a GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, tok
