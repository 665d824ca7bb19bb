"""Building blocks shared by the model families: RMSNorm, rotary embedding, fused linears.

Fused projections (q|k|v and gate|up) turn three and two matmuls into one each; their
`load_weight(shard, tensor)` copies a checkpoint tensor into its slice, so a layer owns the
mapping from checkpoint names to its own parameters.

Under a fast `--quantization` mode (platform/quant) a linear keeps no float weight: it collects
its shards as they stream in (float tensors or GGUF blocks) and `finalize()` packs them, once,
into the kernel of that mode. The embedding is then an int8 table with a scale per group of
32 (GGUF Q8_0's own format) and the LM head a 4-bit pass re-scored exactly at the top
(quant.kernels.RescoredHead).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from splitserve.platform.config import RopeScaling
from splitserve.platform.parallel.group import current as current_group
from splitserve.platform.quant import formats
from splitserve.platform.quant.formats import RawQuant
from splitserve.platform.quant.kernels import LinearKernel, build_head, build_kernel


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 like the reference."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = nn.functional.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: y = x / sqrt(mean(x^2) + eps) * (1 + weight), the product in float32.
    Checkpoints (and our HF-named tensors) store `weight`; GGUF files store 1 + weight.

    With the fused CPU kernels handed in (`use_ops`, the fast modes on a CPU in float32), one C
    call per norm (kernels/cpu_ops.c `ss_rms_norm`, over 1 + weight computed once) instead of
    torch's seven small ops: Gemma 3 runs six norms per layer. `none` keeps torch's."""

    ops = None
    offset_weight: torch.Tensor | None = None

    def use_ops(self, ops) -> None:
        """Call after the weights are loaded (1 + weight is taken then); None: torch's ops."""
        self.ops = ops
        self.offset_weight = None if ops is None else (1.0 + self.weight.detach().float()).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return self.ops.rms_norm(rows, self.offset_weight, self.eps).view(x.shape)
        normed = nn.functional.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class MergedLinear(nn.Module):
    """One matmul for several projections of the same input; outputs are concatenated.

    `quantization` "none": a float `weight` parameter, shards copied into their rows. A fast
    mode: shards are kept as they arrive until `finalize()` builds the packed kernel.
    LoRA (platform/lora/batch.py): the rows of a step that run an adapter get its delta added
    on top of the base output, whatever the kernel; `lora_context` is set by lora.batch.attach.
    """

    lora_context = None  # a lora.batch.LoraContext shared by the model's linears, once attached
    lora_key = ""

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool,
        quantization: str = "none",
        row_parallel: bool = False,
    ):
        """Sizes are this rank's (platform/parallel/layout.py). `row_parallel`: the input is split
        over the ranks, so each output is a partial sum, all-reduced here (the bias added once,
        after it); otherwise (column-parallel, or no parallelism) each rank owns its rows."""
        super().__init__()
        self.tp = current_group() if row_parallel else None
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        self.in_features, self.out_features = in_features, offset
        self.quantization = quantization
        self.has_bias = bias
        self.kernel = None
        self._pending: dict[tuple[str, str], torch.Tensor | RawQuant] = {}
        if quantization == "none":
            self.weight = nn.Parameter(torch.empty(offset, in_features))
            self.bias = nn.Parameter(torch.zeros(offset)) if bias else None
        else:
            self.weight = self.bias = None  # the kernel owns the values after finalize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduce = self.tp is not None and self.tp.is_parallel
        if self.kernel is not None:
            y = self.kernel(x)
        else:
            y = nn.functional.linear(x, self.weight, None if reduce else self.bias)
        if self.lora_context is not None and self.lora_context.batch is not None:
            self.lora_context.add_delta(self.lora_key, x, y)  # a partial sum too when reduced
        if reduce:
            self.tp.all_reduce(y)
            if self.bias is not None:
                y += self.bias
        return y

    def load_weight(self, shard: str, kind: str, tensor: torch.Tensor | RawQuant) -> None:
        start, size = self.shard_offsets[shard]
        assert tensor.shape[0] == size, f"{shard}.{kind}: expected {size} rows, got {tuple(tensor.shape)}"
        if self.quantization != "none":
            assert kind == "weight" or self.has_bias, f"checkpoint has a {shard} bias but the layer has none"
            self._pending[(shard, kind)] = tensor
            return
        target = self.weight if kind == "weight" else self.bias
        assert target is not None, f"checkpoint has a {shard} bias but the layer has none"
        target.data[start : start + size].copy_(tensor)

    def finalize(self, name: str, dtype: torch.dtype) -> None:
        """Pack the collected shards into this layer's kernel (fast modes; no-op for "none")."""
        if self.quantization == "none":
            return
        weight = _concat_rows([self._pending[(s, "weight")] for s in self.shard_offsets])
        bias = None
        if self.has_bias:
            bias = torch.cat([formats.as_float(self._pending[(s, "bias")]) for s in self.shard_offsets])
        self.kernel = build_kernel(self.quantization, name, weight, bias, dtype)
        self._pending.clear()


def _concat_rows(parts: list[torch.Tensor | RawQuant]) -> torch.Tensor | RawQuant:
    """Stack shards row-wise, keeping GGUF blocks when every shard has the same stored type."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, RawQuant) for p in parts) and {p.tensor_type for p in parts} == {Q.Q5_0, Q.Q8_0}:
        parts = [formats.as_q8_0(p) for p in parts]  # Gemma 3's qkv: the same values, codes kept
    first = parts[0]
    if all(isinstance(p, RawQuant) and p.tensor_type == first.tensor_type for p in parts):
        rows = sum(p.shape[0] for p in parts)
        return RawQuant(first.tensor_type, np.concatenate([p.blocks for p in parts]), (rows, first.shape[1]))
    return torch.cat([formats.as_float(p) for p in parts])


class VocabParallelEmbedding(nn.Module):
    """A token table split by vocabulary (vLLM's VocabParallelEmbedding and ParallelLMHead):
    this rank holds rows [vocab_start, vocab_start + rows) of `vocab_size`, padded with zeros to
    ceil(vocab_size / tp) rows so every rank's logits have one width.

    As the embedding: a token outside the rank's rows looks up a zero row; the all-reduce sums
    the one rank that has it with zeros, which is exact. As the LM head (`logits`): each rank's
    logits for its rows, gathered in rank order and cut to vocab_size."""

    def __init__(self, vocab_size: int, hidden_size: int, vocab_start: int, rows: int):
        super().__init__()
        self.tp = current_group()
        self.vocab_size, self.vocab_start = vocab_size, vocab_start
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(nn.functional.linear(hidden, self.weight))[:, : self.vocab_size]

    def load(self, tensor: torch.Tensor) -> None:
        """This rank's rows of the checkpoint's table (fewer than weight's rows on the last rank
        when the vocabulary does not split evenly; the rest stay zero)."""
        self.weight.data.zero_()
        self.weight.data[: tensor.shape[0]].copy_(tensor)


class QuantizedEmbedding(nn.Module):
    """The token embedding of a fast mode: int8 codes with a float scale per group of 32
    (GGUF Q8_0 read exactly, anything else re-quantized); `finalize(tied=True)` also gives the
    tied LM head (kernels.RescoredHead) over the same table."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.codes = self.scale = None
        self._values: torch.Tensor | RawQuant | None = None

    def load(self, tensor: torch.Tensor | RawQuant) -> None:
        self._values = tensor

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.codes.index_select(0, ids).view(ids.shape[0], -1, formats.GROUP).float()
        return (rows * self.scale.index_select(0, ids)[..., None]).view(ids.shape[0], self.embedding_dim)

    def finalize(self, mode: str, tied: bool) -> LinearKernel | None:
        """Build the int8 table (and the tied LM head of `mode` when `tied`) and drop the loaded values."""
        groups, _ = formats.int8_groups(self._values)
        self.codes, self.scale = groups.codes, groups.scale
        self._values = None
        return build_head(mode, self.codes, self.scale) if tied else None

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies of rotary embedding, with Llama-3 or linear scaling if configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the rotate-half layout (Hugging Face convention).

    cos/sin are precomputed for every position up to max_position in float32 and gathered per
    token each step.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] cos and sin for the given positions, ready to broadcast over heads."""
        return (self.cos_cache[positions].unsqueeze(1).to(dtype), self.sin_cache[positions].unsqueeze(1).to(dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]. cos/sin narrower than the head (partial rotary, GLM-4.5) turn
    the leading dimensions and pass the rest through."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
