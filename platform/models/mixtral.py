"""Mixtral: Mistral's attention (sliding window where the config sets one) with a sparse
mixture-of-experts MLP on every layer (models/moe.py), top-k weights always renormalised.
Its checkpoints name the experts `block_sparse_moe.experts.<e>.w1/w3/w2` (gate, up, down)
and the router `block_sparse_moe.gate`; own_name maps them onto the shared MoE block."""

import re

from splitserve.platform.models.llama import LlamaForCausalLM

_MIXTRAL_NAME = re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.(gate|experts\.\d+\.(w1|w2|w3))\.weight$")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralForCausalLM(LlamaForCausalLM):
    def own_name(self, name: str) -> str:
        m = _MIXTRAL_NAME.match(name)
        if m is None:
            return name
        prefix, part, proj = m.groups()
        if proj is None:
            return f"{prefix}.mlp.gate.weight"
        return f"{prefix}.mlp.{part[:-2]}{_PROJ[proj]}.weight"
