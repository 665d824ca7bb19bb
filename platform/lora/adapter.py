"""One PEFT LoRA adapter, read from disk, checked, and packed for the model's fused linears.

A PEFT adapter folder holds `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
`use_rslora`, ...) and `adapter_model.safetensors` with, per adapted projection,
`base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]. The projection then computes

    y = W x + scale * B (A x),   scale = lora_alpha / r   (lora_alpha / sqrt(r) with rsLoRA)

Our model fuses q|k|v and gate|up into one linear each (models/layers.MergedLinear), so an
adapter is packed per fused linear (`LoraLinear`): A_T = [A_s1; A_s2; ...]^T  [in, S*r] over the
adapted shards s (one shrink for all of them), and per shard (scale * B_s)^T [r, size_s] with
the column offset of that shard's output slice. The CPU kernel expands each shard into its own
slice; the torch form (`b_t()`) lays the shards out block-structured in one [S*r, out] matrix,
zeros elsewhere, so a fused linear takes its whole delta in two matmuls: y += (x @ A_T) @ B_T.
Only the compact shards are kept (the zeros would be two thirds of a q|k|v linear's B bytes).

Weight layout: our GGUF loader already undoes llama.cpp's q/k row permutation
(weights/gguf.py), so q/k are in Hugging Face's row order, the order PEFT adapters are trained
in: lora_B rows are used as they are (the transformers + PEFT equality test pins this).

Identity: `digest` is sha256 over the canonical (sorted-key) JSON config and the bytes of the
weight file; with the name it keys the prefix cache (platform/hashing.lora_extra_keys), so two
different adapters loaded under one name never share KV.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.parallel.layout import ShardLayout, cut

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT module name -> (our fused linear, its shard); the same fusion as models/llama.py
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", "q"),
    "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", "o"),
    "gate_proj": ("mlp.gate_up_proj", "gate"),
    "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", "down"),
}
# adapter_config.json fields that change the math beyond plain LoRA: refused when set
_UNSUPPORTED = (
    "use_dora",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "lora_bias",
    "use_qalora",
    "trainable_token_indices",
    "layer_replication",
    "target_parameters",
    "use_bdlora",
)
_TENSOR = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(InvalidRequestError):
    """An adapter folder cannot be served: says which file or field and what is allowed."""


class AdapterFolderNotFoundError(AdapterError):
    """The adapter path is not a folder on this worker (HTTP 404, as vLLM answers a missing adapter)."""


@dataclass(frozen=True)
class LinearLayout:
    """What packing needs of one fused linear: input width and shard -> (row offset, rows)."""

    in_features: int
    shard_offsets: dict[str, tuple[int, int]]

    @property
    def out_features(self) -> int:
        return sum(size for _, size in self.shard_offsets.values())


@dataclass(frozen=True, eq=False)
class LoraLinear:
    """One adapter's part of one fused linear: A_T [in, S*r] and, for shard s (rows s*r.. of
    x @ A_T), (scale * B_s)^T [r, size_s] added into output columns start_s.. (shard order)."""

    a_t: torch.Tensor
    blocks: tuple[tuple[int, torch.Tensor], ...]  # (start, B_s^T scaled) per adapted shard
    out_features: int

    @property
    def rank(self) -> int:
        return self.blocks[0][1].shape[0]

    @property
    def nbytes(self) -> int:
        return self.a_t.nbytes + sum(b.nbytes for _, b in self.blocks)

    def b_t(self) -> torch.Tensor:
        """The block-structured B_T [S*r, out] of the torch form (built on demand)."""
        r = self.rank
        b_t = self.a_t.new_zeros(len(self.blocks) * r, self.out_features)
        for i, (start, b) in enumerate(self.blocks):
            b_t[i * r : (i + 1) * r, start : start + b.shape[1]] = b
        return b_t


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A loaded adapter: its identity, its hyper-parameters and its packed weights.

    `weights[key]` = the LoraLinear of each fused linear the adapter touches, `key` as in the
    model ("layers.3.self_attn.qkv_proj"); scale is folded into its B blocks.
    """

    name: str
    path: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    digest: bytes
    weights: dict[str, LoraLinear] = field(repr=False)

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def lora_id(self) -> str:
        """name@digest: what the scheduler counts and the P/D layout check compares."""
        return f"{self.name}@{self.digest.hex()}"

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())


def read_adapter(
    name: str,
    path: str,
    layout: dict[str, LinearLayout],
    max_rank: int,
    dtype: torch.dtype = torch.float32,
    shard: ShardLayout | None = None,
) -> LoraAdapter:
    """Read, check and pack the PEFT adapter in folder `path`. Raises AdapterError.
    `shard` (tensor parallelism): `layout` is this rank's; each pair is cut to match its base
    layer (`shard_pair`) after the full shapes were checked. The digest is of the whole files."""
    if not isinstance(path, str) or not os.path.isdir(path):
        raise AdapterFolderNotFoundError(
            f"adapter {name!r}: {path!r} is not a folder; allowed: a PEFT adapter folder "
            f"with {CONFIG_FILE} and {WEIGHTS_FILE}"
        )
    config_bytes = _read(path, CONFIG_FILE)
    weight_bytes = _read(path, WEIGHTS_FILE)
    config = _parse_config(name, config_bytes)
    rank, alpha, use_rslora = _hyper_parameters(name, config, max_rank)
    tensors = _load_tensors(name, weight_bytes)
    shards = _group_tensors(name, tensors, rank, layout if shard is None else _full_layout(layout, shard))
    if shard is not None:
        shards = {
            key: {proj: shard_pair(shard, key, proj, pair) for proj, pair in p.items()} for key, p in shards.items()
        }
    scale = alpha / (math.sqrt(rank) if use_rslora else rank)
    weights = {key: _pack(parts, layout[key], scale, dtype) for key, parts in shards.items()}
    targets = sorted({proj for key, parts in shards.items() for proj in parts})
    hasher = hashlib.sha256(json.dumps(config, sort_keys=True).encode() + b"\0")
    hasher.update(weight_bytes)  # not concatenated: a rank-64 adapter's 78 MB would be copied once more
    return LoraAdapter(name, path, rank, alpha, use_rslora, tuple(targets), hasher.digest(), weights)


def shard_pair(shard: ShardLayout, key: str, proj: str, pair: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One projection's (A, B) cut like its base layer: a column-parallel base (q/k/v, gate/up)
    keeps its output rows, so B is cut by rows and A is whole; a row-parallel one (o, down) keeps
    input columns, so A is cut by columns and B is whole (each rank adds its partial delta
    before the layer's all-reduce)."""
    slices = shard.slices(f"model.{key.rsplit('.', 1)[0]}.{proj}.weight")
    if slices is None:
        return pair
    half = "B" if slices[0] == 0 else "A"
    return {**pair, half: cut(pair[half], slices)}


def _full_layout(layout: dict[str, LinearLayout], shard: ShardLayout) -> dict[str, LinearLayout]:
    """The unsharded layout of each linear (what a PEFT adapter's shapes are checked against)."""
    c = shard.config
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    full = {
        "self_attn.qkv_proj": LinearLayout(c.hidden_size, {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}),
        "self_attn.o_proj": LinearLayout(q, {"o": (0, c.hidden_size)}),
        "mlp.gate_up_proj": LinearLayout(c.hidden_size, {"gate": (0, inter), "up": (inter, inter)}),
        "mlp.down_proj": LinearLayout(inter, {"down": (0, c.hidden_size)}),
    }
    return {key: full[key.split(".", 2)[2]] for key in layout}


def _read(path: str, filename: str) -> bytes:
    try:
        with open(os.path.join(path, filename), "rb") as f:
            return f.read()
    except OSError as e:
        raise AdapterError(
            f"{path}: cannot read {filename} ({e.strerror}); a PEFT adapter folder has {CONFIG_FILE} and {WEIGHTS_FILE}"
        ) from None


def _parse_config(name: str, raw: bytes) -> dict:
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {config['peft_type']!r} is not supported; allowed: LORA")
    unsupported = [(k, config.get(k)) for k in _UNSUPPORTED if config.get(k)]
    if config.get("bias", "none") != "none":
        unsupported.append(("bias", config["bias"]))
    if config.get("fan_in_fan_out"):
        unsupported.append(("fan_in_fan_out", True))
    if unsupported:
        raise AdapterError(
            f"adapter {name!r}: unsupported settings {dict(unsupported)}; allowed: plain LoRA on "
            f"{', '.join(TARGETS)} (none of {', '.join(_UNSUPPORTED)}, bias)"
        )
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise AdapterError(
                f"adapter {name!r}: target_modules {unknown} are not supported; allowed: {', '.join(TARGETS)}"
            )
    elif not isinstance(targets, str):  # PEFT also takes a regex string; the tensors then say what is adapted
        raise AdapterError(f"adapter {name!r}: target_modules must be a list of module names or a regex string")
    return config


def _hyper_parameters(name: str, config: dict, max_rank: int) -> tuple[int, float, bool]:
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter {name!r}: r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(
            f"adapter {name!r}: rank {rank} is over this server's max_lora_rank {max_rank}; allowed: r <= {max_rank}"
        )
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"adapter {name!r}: lora_alpha must be a finite number, got {alpha!r}")
    return rank, float(alpha), bool(config.get("use_rslora", False))


def _load_tensors(name: str, raw: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    try:
        return load(raw)
    except Exception as e:  # safetensors raises its own SafetensorError and others on a bad header
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is not a readable safetensors file ({e})") from None


def _group_tensors(
    name: str, tensors: dict[str, torch.Tensor], rank: int, layout: dict[str, LinearLayout]
) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """fused linear key -> PEFT projection -> {"A": [r, in], "B": [out, r]}, shapes checked."""
    grouped: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for tensor_name, tensor in tensors.items():
        m = _TENSOR.match(tensor_name)
        if m is None or m.group(2) not in TARGETS:
            raise AdapterError(
                f"adapter {name!r}: tensor {tensor_name!r} adapts a module we do not have; "
                f"allowed: lora_A/lora_B of {', '.join(TARGETS)} in model.layers.N"
            )
        layer, proj, half = m.groups()
        key = f"layers.{int(layer)}.{TARGETS[proj][0]}"
        if key not in layout:
            raise AdapterError(f"adapter {name!r}: {tensor_name!r} names layer {layer}, which this model lacks")
        grouped.setdefault(key, {}).setdefault(proj, {})[half] = tensor
    if not grouped:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    for key, parts in grouped.items():
        for proj, pair in parts.items():
            _check_pair(name, key, proj, pair, rank, layout[key])
    return grouped


def _check_pair(name: str, key: str, proj: str, pair: dict[str, torch.Tensor], rank: int, lin: LinearLayout) -> None:
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"adapter {name!r}: {key} {proj} has lora_{'A' if 'A' not in pair else 'B'} missing")
    _, rows = lin.shard_offsets[TARGETS[proj][1]]
    want = {"A": (rank, lin.in_features), "B": (rows, rank)}
    for half, shape in want.items():
        if tuple(pair[half].shape) != shape:
            raise AdapterError(
                f"adapter {name!r}: {key} {proj}.lora_{half} has shape {tuple(pair[half].shape)}; "
                f"this model needs {shape} for r={rank}"
            )


def _pack(parts: dict[str, dict[str, torch.Tensor]], lin: LinearLayout, scale: float, dtype: torch.dtype) -> LoraLinear:
    """One fused linear's LoraLinear, shards in the linear's order."""
    order = [proj for proj in TARGETS if proj in parts]
    order.sort(key=lambda p: lin.shard_offsets[TARGETS[p][1]][0])
    a_t = torch.cat([parts[p]["A"].float() for p in order]).t().contiguous()
    blocks = tuple(
        (lin.shard_offsets[TARGETS[p][1]][0], (parts[p]["B"].float().t() * scale).to(dtype).contiguous()) for p in order
    )
    return LoraLinear(a_t.to(dtype), blocks, lin.out_features)
