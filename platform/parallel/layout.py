"""What each rank holds, and the checks that refuse a size that cannot split the model.

The split follows vLLM's (model_executor/layers/linear.py):

    weight                      split           rank r holds
    embed_tokens, lm_head       vocabulary      rows [r * V', (r + 1) * V'), V' = ceil(V / tp)
    q_proj (and bias)           heads, rows     its num_heads / tp query heads
    k_proj, v_proj (and bias)   KV heads, rows  num_kv_heads / tp heads; when tp > num_kv_heads,
                                                KV head r // (tp / num_kv_heads) (replicated)
    o_proj                      columns         the columns of its query heads
    gate_proj, up_proj          rows            intermediate / tp rows
    down_proj                   columns         the matching columns
    experts' gate/up/down       as gate/up/down, inside every expert (moe_intermediate / tp)
    norms, router, q/k norms    replicated

Fused checkpoint tensors (Phi-3's qkv_proj, gate_up_proj) are cut into their parts' slices and
concatenated. `slices(name)` says what to read of a checkpoint tensor as (dim, ranges); the
safetensors reader reads only those ranges, other sources cut after reading.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from splitserve.platform.config import ModelConfig, ParallelConfig
from splitserve.platform.errors import ConfigError

# families whose every layer has a sharded form here; a family outside it refuses tp > 1
TP_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "qwen3_moe", "gemma3", "mixtral")

Slices = tuple[int, tuple[tuple[int, int], ...]]  # (dimension, [start, stop) ranges in order)

_PROJ = re.compile(r"model\.layers\.\d+\.(?:self_attn|mlp)\.(?:experts\.\d+\.)?(\w+)\.(weight|bias)$")


@dataclass(frozen=True)
class ShardLayout:
    """Rank `rank` of `size` over the model `config`: its heads, rows and vocabulary range."""

    config: ModelConfig
    rank: int = 0
    size: int = 1

    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        n_kv = self.config.num_kv_heads
        if n_kv >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank // (self.size // n_kv)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        start = self.rank * self.vocab_per_rank
        return min(start, self.config.vocab_size), min(start + self.vocab_per_rank, self.config.vocab_size)

    def rows(self, total: int) -> tuple[int, int]:
        """This rank's [start, stop) of a dimension of `total` split evenly (intermediate sizes)."""
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def local_model_config(self) -> ModelConfig:
        """The config of this rank's attention: its heads (what its KV cache holds)."""
        return self.config.replace(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)

    def slices(self, name: str) -> Slices | None:
        """What this rank reads of the checkpoint tensor `name` (our HF names); None: all of it."""
        if self.size == 1:
            return None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, (self.vocab_range,)
        m = _PROJ.match(name)
        if m is None:
            return None
        c, hd = self.config, self.config.head_dim
        q = (self.rank * self.num_heads * hd, (self.rank + 1) * self.num_heads * hd)
        kv = (self.kv_head_start * hd, (self.kv_head_start + self.num_kv_heads) * hd)
        inter = self.rows(c.moe_intermediate_size if ".experts." in name else c.intermediate_size)
        q_size, kv_size = c.num_heads * hd, c.num_kv_heads * hd
        proj = m.group(1)
        table = {
            "q_proj": (0, (q,)),
            "k_proj": (0, (kv,)),
            "v_proj": (0, (kv,)),
            "o_proj": (1, (q,)),
            "qkv_proj": (0, (q, _shift(kv, q_size), _shift(kv, q_size + kv_size))),
            "gate_proj": (0, (inter,)),
            "up_proj": (0, (inter,)),
            "gate_up_proj": (0, (inter, _shift(inter, c.intermediate_size))),
            "down_proj": (1, (inter,)),
        }
        return table.get(proj)


def _shift(r: tuple[int, int], by: int) -> tuple[int, int]:
    return r[0] + by, r[1] + by


def cut(tensor: torch.Tensor, slices: Slices | None) -> torch.Tensor:
    """The ranges of `tensor` named by `slices`, concatenated (a copy; `tensor` itself if None)."""
    if slices is None:
        return tensor
    dim, ranges = slices
    parts = [tensor.narrow(dim, start, stop - start) for start, stop in ranges]
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=dim)


def sliced_shape(shape: tuple[int, ...], slices: Slices | None) -> tuple[int, ...]:
    if slices is None:
        return shape
    dim, ranges = slices
    out = list(shape)
    out[dim] = sum(stop - start for start, stop in ranges)
    return tuple(out)


def check_tensor_parallel(model: ModelConfig, parallel: ParallelConfig, device: str, quantization: str) -> None:
    """ConfigError, with what is allowed, when `parallel.tensor_parallel_size` cannot run `model`
    here. Reads no weights and starts nothing: called before any rank exists."""
    tp = parallel.tensor_parallel_size
    if tp == 1:
        return
    allowed = [n for n in range(1, model.num_heads + 1) if _splits(model, n)]
    name = f"model {model.model_id!r}"
    if model.architecture not in TP_ARCHITECTURES:
        raise ConfigError(
            f"architecture {model.architecture!r} has no tensor-parallel form yet; allowed with "
            f"--tensor-parallel-size > 1: {', '.join(TP_ARCHITECTURES)}"
        )
    if model.num_heads % tp:
        raise ConfigError(
            f"--tensor-parallel-size {tp} does not divide the {model.num_heads} attention heads of {name}; "
            f"allowed: {allowed}"
        )
    n_kv = model.num_kv_heads
    if (n_kv >= tp and n_kv % tp) or (n_kv < tp and tp % n_kv):
        raise ConfigError(
            f"--tensor-parallel-size {tp} and the {n_kv} KV heads of {name} do not split: the KV heads "
            f"must divide evenly over the ranks or the ranks over the KV heads; allowed: {allowed}"
        )
    for field in ("intermediate_size", "moe_intermediate_size"):
        size = getattr(model, field)
        if size and size % tp:
            raise ConfigError(
                f"--tensor-parallel-size {tp} does not divide {field}={size} of {name}; allowed: {allowed}"
            )
    if quantization != "none":
        raise ConfigError(
            f"--quantization {quantization} packs weights for one CPU process and has no tensor-parallel "
            f"form; use --quantization none with --tensor-parallel-size {tp} (or --tensor-parallel-size 1)"
        )
    _check_devices(tp // parallel.nnodes, device)


def _splits(model: ModelConfig, tp: int) -> bool:
    n_kv = model.num_kv_heads
    kv_ok = (n_kv >= tp and n_kv % tp == 0) or (n_kv < tp and tp % n_kv == 0)
    inter_ok = all(not s or s % tp == 0 for s in (model.intermediate_size, model.moe_intermediate_size))
    return model.num_heads % tp == 0 and kv_ok and inter_ok


def _check_devices(ranks_per_node: int, device: str) -> None:
    if device == "cpu":
        return
    if device != "cuda":
        raise ConfigError(
            f"--device {device} names one GPU; with --tensor-parallel-size > 1 use --device cuda "
            "(rank r of a node runs on cuda:r)"
        )
    visible = torch.cuda.device_count()
    if ranks_per_node > visible:
        raise ConfigError(
            f"--tensor-parallel-size needs {ranks_per_node} GPUs on this node but {visible} are visible; "
            f"allowed: at most {visible} ranks per node (CUDA_VISIBLE_DEVICES, or more --nnodes)"
        )
