"""PEFT LoRA adapter folders written by hand for SmolLM2-135M's shapes (adapter_config.json +
adapter_model.safetensors, PEFT's tensor names), so tests can make good and bad adapters exactly."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

OUT = {"q_proj": 576, "k_proj": 192, "v_proj": 192, "o_proj": 576, "gate_proj": 1536, "up_proj": 1536, "down_proj": 576}
IN = {**{k: 576 for k in OUT}, "down_proj": 1536}


def write_adapter(folder, r=8, alpha=16, modules=("q_proj", "v_proj"), seed=0, layers=range(30), **config):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(modules), **config}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in layers:
        for m in modules:
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            base = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(r, IN.get(m, 576), generator=gen) / 24
            tensors[f"{base}.lora_B.weight"] = torch.randn(OUT.get(m, 576), r, generator=gen) * 0.02
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)
