"""The Llama block, which the other families reuse: Llama 2/3 (incl. Llama-3 rope scaling), SmolLM2.

Decoder-only transformer with pre-norm residual blocks: RMSNorm -> attention (GQA, RoPE,
paged KV) -> RMSNorm -> SwiGLU MLP. Activations are flat [num_tokens, hidden]: a step's
sequences are concatenated and the attention metadata says where each one starts.
Only the rows that sample run through the LM head.

What a family changes is read from its ModelConfig, layer by layer, so a family file only
names its checkpoint layout: q/k/v biases (Qwen2), RMSNorm over each head of q and k before
rotary (Qwen3, `qk_norm`), a sliding window per layer (Mistral, Phi-3, Qwen with
`use_sliding_window`; `layer_window`), a mixture-of-experts MLP (`is_moe_layer`, models/moe.py)
and fused q|k|v and gate|up tensors in the checkpoint (Phi-3, `CHECKPOINT_FUSED`).

The fused CPU graph (use_fused_ops) is the plain Llama graph: a model with q/k norm, a window
or experts keeps the torch graph, its linears still in the fast mode's kernels.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from splitserve.platform.config import ModelConfig
from splitserve.platform.kernels.cpu_decode import DecodePlan, plan_for
from splitserve.platform.kernels.cpu_ops import CpuOps
from splitserve.platform.models.attention import AttentionMetadata, paged_attention, paged_attention_fused
from splitserve.platform.models.layers import (
    MergedLinear,
    QuantizedEmbedding,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    apply_rotary,
)
from splitserve.platform.models.moe import SparseMoeBlock
from splitserve.platform.parallel.group import current as current_group
from splitserve.platform.parallel.layout import ShardLayout
from splitserve.platform.quant import formats
from splitserve.platform.quant.formats import RawQuant
from splitserve.platform.quant.kernels import LinearKernel, build_head


def local_shard(config: ModelConfig) -> ShardLayout:
    """The heads and rows of the rank whose model is being built (platform/parallel)."""
    group = current_group()
    return ShardLayout(config, group.rank, group.size)


def _vocab_parallel(config: ModelConfig) -> VocabParallelEmbedding:
    shard = local_shard(config)
    return VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard.vocab_range[0], shard.vocab_per_rank)


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, quantization: str = "none", layer: int = 0, norm_class: type[RMSNorm] = RMSNorm
    ):
        super().__init__()
        self.window = config.layer_window(layer)
        self.q_norm = norm_class(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm_class(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        shard = local_shard(config)  # this rank's heads (all of them without tensor parallelism)
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        q_size = self.num_heads * config.head_dim
        kv_size = self.num_kv_heads * config.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q": q_size, "k": kv_size, "v": kv_size},
            bias=config.attention_bias,
            quantization=quantization,
        )
        self.o_proj = MergedLinear(
            q_size, {"o": config.hidden_size}, bias=False, quantization=quantization, row_parallel=True
        )

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata):
        n = x.shape[0]
        qkv = self.qkv_proj(x).view(n, -1, self.head_dim)
        qk = qkv[:, : self.num_heads + self.num_kv_heads]
        if self.q_norm is not None:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # Rotate q and k heads together: one set of ops instead of two.
        qk = apply_rotary(qk, cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        sinks = getattr(self, "sinks", None)  # a logit per head in the softmax (gpt-oss's parameter)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window, sinks)
        return self.o_proj(out.reshape(n, -1))

    def forward_fused(self, x, positions, rotary, kv_cache, meta: AttentionMetadata, ops: CpuOps):
        """forward() with rotary, the KV write and decode attention in the fused CPU kernels."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        ops.rope_write_kv(
            qkv,
            positions,
            rotary.cos_cache,
            rotary.sin_cache,
            kv_cache[0],
            kv_cache[1],
            meta.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        qkv = qkv.view(n, -1, self.head_dim)
        q, k, v = qkv.split((self.num_heads, self.num_kv_heads, self.num_kv_heads), dim=1)
        out = paged_attention_fused(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, ops)
        return self.o_proj(out.reshape(n, -1))


_ACTIVATIONS = {"silu": nn.functional.silu, "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, quantization: str = "none"):
        super().__init__()
        self.intermediate_size = inter = config.intermediate_size // current_group().size
        self.act = _ACTIVATIONS[config.hidden_act]
        self.gate_up_proj = MergedLinear(
            config.hidden_size, {"gate": inter, "up": inter}, bias=False, quantization=quantization
        )
        self.down_proj = MergedLinear(
            inter, {"down": config.hidden_size}, bias=False, quantization=quantization, row_parallel=True
        )

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def forward_fused(self, x, ops: CpuOps):
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, quantization: str = "none", layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, quantization, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoeBlock(config) if config.is_moe_layer(layer) else LlamaMLP(config, quantization)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


# checkpoint name -> (module path, shard) for tensors that land in (fused) MergedLinear projections
_FUSED = {
    "q_proj": ("self_attn.qkv_proj", "q"),
    "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", "o"),
    "gate_proj": ("mlp.gate_up_proj", "gate"),
    "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", "down"),
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class LlamaForCausalLM(nn.Module):
    # checkpoint projection -> module path of a MergedLinear that takes it whole, all shards in
    # order (Phi-3's qkv_proj and gate_up_proj); empty: every projection is stored separately
    CHECKPOINT_FUSED: dict[str, str] = {}
    DECODER_LAYER: type[nn.Module] = LlamaDecoderLayer
    NORM: type[RMSNorm] = RMSNorm

    def __init__(self, config: ModelConfig, quantization: str = "none"):
        """`quantization`: "none" (float weights in the model dtype) or a fast mode of
        platform/quant; a fast mode's weights exist only after load_weights()."""
        super().__init__()
        self.config = config
        self.quantization = quantization
        self.tp = current_group()
        if self.tp.is_parallel:  # split by vocabulary (platform/parallel/layout.py)
            self.embed_tokens = _vocab_parallel(config)
        elif quantization == "none":
            # Left empty, not drawn at random: load_weights fills every row (check_weights refuses a
            # checkpoint without it), and Gemma's 262k x 640 normal_ took 2 s of each cold start.
            shape = (config.vocab_size, config.hidden_size)
            self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        else:
            self.embed_tokens = QuantizedEmbedding(config.vocab_size, config.hidden_size)
        self.lm_head_kernel: LinearKernel | None = None
        # The fused CPU kernels (kernels/cpu_ops.py), set by use_fused_ops(); None: the torch path.
        self.fused_ops: CpuOps | None = None
        self.decode_plan: DecodePlan | None = None
        self.layers = nn.ModuleList(self.DECODER_LAYER(config, quantization, i) for i in range(config.num_layers))
        self.norm = self.NORM(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        if config.tie_word_embeddings:
            self.lm_head = None
        elif self.tp.is_parallel:
            self.lm_head = _vocab_parallel(config)
        elif quantization == "none":
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        else:
            self.lm_head = QuantizedEmbedding(config.vocab_size, config.hidden_size)  # its int8 table

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, hidden] (normed).

        `layer_hook(i)` runs right after layer i has written its K/V (KV export per layer).
        """
        x = self.embed_tokens(input_ids)
        if self.fused_ops is not None:
            return self._forward_fused(x, positions, kv_caches, meta, layer_hook)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = layer(x, cos, sin, kv_cache, meta.for_layer(i))
            if layer_hook is not None:
                layer_hook(i)
        return self.norm(x)

    def use_fused_ops(self, ops: CpuOps | None) -> None:
        """Run forward() through the fused CPU kernels (float32 on a CPU), or the torch path (None).
        A step of decodes only (with or without LoRA adapters) then runs all layers in one C call
        where the model allows it (kernels/cpu_decode.py: every linear w4a8/w4a16); call after
        load_weights()."""
        if not self.is_plain_llama_graph():
            ops = None
        self.fused_ops = ops
        self.decode_plan = plan_for(self, ops) if self.quantization != "none" else None

    def is_plain_llama_graph(self) -> bool:
        """True when the fused CPU graph computes this model: no q/k norm, window or experts."""
        c = self.config
        return not (
            c.qk_norm
            or c.layer_types
            and "sliding_attention" in c.layer_types
            or c.num_experts
            or c.hidden_act != "silu"
            or self.NORM is not RMSNorm
        )

    def _forward_fused(self, x, positions, kv_caches, meta, layer_hook):
        """The same graph as forward(), with each residual add fused into the next norm:
        per layer qkv -> rope+KV write -> attention -> o -> add+norm -> gate_up -> silu*up -> down -> add+norm."""
        ops = self.fused_ops
        lora = getattr(self, "lora_context", None)  # the step's adapters (platform/lora), if any
        if self.decode_plan is not None and layer_hook is None and not meta.prefills:
            return self.decode_plan.run(x, positions, kv_caches, meta, lora=None if lora is None else lora.batch)
        residual = x.contiguous()
        h = ops.rms_norm(residual, self.layers[0].input_layernorm.weight, self.config.rms_norm_eps)
        eps = self.config.rms_norm_eps
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            attn = layer.self_attn.forward_fused(h, positions, self.rotary, kv_cache, meta, ops)
            h = ops.add_rms_norm(attn, residual, layer.post_attention_layernorm.weight, eps)
            if layer_hook is not None:
                layer_hook(i)
            mlp = layer.mlp.forward_fused(h, ops)
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h = ops.add_rms_norm(mlp, residual, next_norm.weight, eps)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab]; under tensor parallelism every rank gets all of them (a gather)."""
        if self.lm_head_kernel is not None:
            return self.lm_head_kernel(hidden)
        if self.tp.is_parallel:
            return (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(hidden, weight)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | RawQuant]]) -> None:
        """Copy Hugging Face-named tensors into this model; every parameter must be covered.
        Under a fast mode, then pack every linear (MergedLinear.finalize)."""
        params = dict(self.named_parameters())
        loaded = {key for name, tensor in weights for key in self._load_one(self.own_name(name), tensor, params)}
        missing = self._expected_keys(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:4]}")
        if self.quantization != "none":
            dtype = self.norm.weight.dtype
            for name, module in self.named_modules():
                if isinstance(module, MergedLinear):
                    module.finalize(name, dtype)
            self.lm_head_kernel = self.embed_tokens.finalize(self.quantization, tied=self.lm_head is None)
            if self.lm_head is not None:
                self.lm_head.finalize(self.quantization, tied=False)
                self.lm_head_kernel = build_head(self.quantization, self.lm_head.codes, self.lm_head.scale)

    def own_name(self, name: str) -> str:
        """A checkpoint tensor's name in this module's vocabulary (a family whose checkpoints
        name things differently translates here)."""
        return name

    def _expected_keys(self, params: dict[str, nn.Parameter]) -> set[str]:
        keys = {
            name
            for name in params
            if not isinstance(self.get_submodule(name.rsplit(".", 1)[0]), (MergedLinear, SparseMoeBlock))
        }
        for name, module in self.named_modules():
            if isinstance(module, SparseMoeBlock):
                keys.update(module.checkpoint_keys(name))
            if isinstance(module, MergedLinear):
                keys.update(f"{name}.weight#{shard}" for shard in module.shard_offsets)
                if module.has_bias:
                    keys.update(f"{name}.bias#{shard}" for shard in module.shard_offsets)
        if isinstance(self.embed_tokens, QuantizedEmbedding):
            keys.add("embed_tokens.weight")
        if isinstance(self.lm_head, QuantizedEmbedding):
            keys.add("lm_head.weight")
        return keys

    def _load_one(self, name: str, tensor: torch.Tensor | RawQuant, params: dict[str, nn.Parameter]) -> list[str]:
        """Copy one checkpoint tensor in; returns the keys of _expected_keys it covered."""
        m = _LAYER_NAME.match(name)
        if m and m.group(3) in self.CHECKPOINT_FUSED:
            layer, _, proj, kind = m.groups()
            module_path = self.CHECKPOINT_FUSED[proj]
            module = self.layers[int(layer)].get_submodule(module_path)
            tensor = formats.as_float(tensor)
            for shard, (start, size) in module.shard_offsets.items():
                module.load_weight(shard, kind, tensor[start : start + size])
            return [f"layers.{layer}.{module_path}.{kind}#{shard}" for shard in module.shard_offsets]
        if m and m.group(3) in _FUSED:
            layer, _, proj, kind = m.groups()
            module_path, shard = _FUSED[proj]
            module = self.layers[int(layer)].get_submodule(module_path)
            module.load_weight(shard, kind, tensor)
            return [f"layers.{layer}.{module_path}.{kind}#{shard}"]
        m = _EXPERT_NAME.match(name)
        if m:
            layer, expert, proj = m.groups()
            self.layers[int(layer)].mlp.load_expert(int(expert), proj, formats.as_float(tensor))
            return [f"layers.{layer}.mlp.experts.{expert}.{proj}"]
        own = name.removeprefix("model.")
        table = {"embed_tokens.weight": self.embed_tokens, "lm_head.weight": self.lm_head}.get(own)
        if isinstance(table, VocabParallelEmbedding):
            table.load(formats.as_float(tensor))
            return [own]
        if own == "embed_tokens.weight" and isinstance(self.embed_tokens, QuantizedEmbedding):
            self.embed_tokens.load(tensor)
            return [own]
        if own == "lm_head.weight" and isinstance(self.lm_head, QuantizedEmbedding):
            self.lm_head.load(tensor)
            return [own]
        if isinstance(tensor, RawQuant):
            tensor = tensor.dequantize()
        if own not in params:
            raise ValueError(f"unexpected checkpoint tensor {name!r}")
        assert params[own].shape == tensor.shape, (
            f"{name}: expected {tuple(params[own].shape)}, got {tuple(tensor.shape)}"
        )
        params[own].data.copy_(tensor)
        return [own]
