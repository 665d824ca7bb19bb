"""Phi-3: the Llama block whose checkpoint stores q|k|v as one `self_attn.qkv_proj` and gate|up
as one `mlp.gate_up_proj` (the same row order as our fused linears, so each is copied whole),
with sliding-window attention on every layer where the config sets `sliding_window`.
Phi-3's long-context `longrope` and partial rotary (Phi-3.5 / Phi-4-mini) are rejected when
the config is read (weights/hf.py)."""

from splitserve.platform.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    CHECKPOINT_FUSED = {"qkv_proj": "self_attn.qkv_proj", "gate_up_proj": "mlp.gate_up_proj"}
