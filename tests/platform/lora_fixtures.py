"""Random PEFT adapters on the real SmolLM2 weights, and transformers + PEFT as their reference.

The reference model is transformers' LlamaForCausalLM read from the same GGUF as our engine
(the session's `hf_smollm2`, as in test_engine_vs_transformers.py), deep-copied here because
PEFT injects its layers into the model it wraps. Adapters are made by PEFT itself (get_peft_model / add_adapter), their
lora_B (zero when PEFT creates them: a no-op) and lora_A re-drawn from seeded normals, and saved
with save_pretrained: exactly the folders a user would hand us.
"""

from __future__ import annotations

import copy

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (LoraConfig kwargs, seed): ranks 8 and 16, one rsLoRA, different module sets
ADAPTERS = {
    "all-r8": (dict(r=8, lora_alpha=16, target_modules=ALL), 1),
    "qv-down-r16": (dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"]), 2),
    "rslora-r16": (
        dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"]),
        3,
    ),
}


def make_peft_adapters(hf_model, tok, folder, names=tuple(ADAPTERS), std: float = 0.02):
    """Save the named adapters under folder/<name>; returns (PeftModel with all of them, tokenizer).
    `hf_model` (transformers' SmolLM2, the session's reference) is copied first: PEFT injects its
    layers into the model it wraps, and the other tests need the reference untouched."""
    from peft import LoraConfig, get_peft_model

    base = copy.deepcopy(hf_model).eval()
    model = None
    for name in names:
        kwargs, seed = ADAPTERS[name]
        config = LoraConfig(lora_dropout=0.0, **kwargs)
        if model is None:
            model = get_peft_model(base, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if f".lora_B.{name}." in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
                elif f".lora_A.{name}." in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    model.save_pretrained(str(folder), selected_adapters=list(names))
    model.eval()
    return model, tok


def peft_greedy(model, adapter: str | None, token_ids: list[int], max_new: int) -> list[int]:
    """Greedy tokens of transformers + PEFT for one adapter (None: adapters disabled)."""
    from test_engine_vs_transformers import hf_greedy

    if adapter is None:
        with model.disable_adapter():
            return hf_greedy(model, token_ids, max_new)
    model.set_adapter(adapter)
    return hf_greedy(model, token_ids, max_new)


def run_mixed(engine, requests, params):
    """Add (token_ids, lora_name) requests together, step to the end; output token ids in order."""
    ids = [engine.add_request(params=params, prompt_token_ids=t, lora_name=lora) for t, lora in requests]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.req_id] = out
    return [final[i].output_token_ids for i in ids]
