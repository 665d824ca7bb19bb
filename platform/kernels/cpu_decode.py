"""A decode step's decoder layers in one C call (cpu_decode.c), for models whose every linear is a
`w4a8`/`w4a16` kernel: the plan (pointers to each layer's packed weights, norms and KV cache) is
built once after load; `run()` takes one new token per sequence and returns the final hidden
states, bit for bit what the Python fused path gives (the same kernels in the same order).

A step with LoRA adapters stays on this path: the step's adapter set (lora.batch.PackedSet) gets
a table of its per-linear kernel entries, built once per set and kept on it, and each linear
makes the ss_lora_delta call that LoraContext.add_delta makes on the Python path.
"""

from __future__ import annotations

import ctypes

import torch

from splitserve.platform.kernels.cpu_ops import CpuOps, _p

_P = ctypes.c_void_p


class _Linear(ctypes.Structure):
    _fields_ = [("w", _P), ("d", _P), ("mn", _P), ("bias", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", _P),
        ("v_cache", _P),
    ]


class _LoraStep(ctypes.Structure):
    _fields_ = [("linears", _P), ("groups", ctypes.c_int64), ("row_group", _P)]


def _linears(layer) -> tuple:
    """A decoder layer's fused linears in the order of the C structs: qkv, o, gate_up, down."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _lora_table(model, packed) -> ctypes.Array:
    """[layer][qkv, o, gate_up, down] -> that linear's LoraEntry array of the adapter set `packed`
    (lora.batch.PackedSet.entries; NULL where no adapter touches it)."""
    table = (_P * (len(model.layers) * 4))()
    for i, layer in enumerate(model.layers):
        for j, module in enumerate(_linears(layer)):
            entries = packed.entries(module.lora_key)
            table[i * 4 + j] = None if entries is None else ctypes.addressof(entries)
    return table


class _Dims(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("max_blocks", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("digits", ctypes.c_int),
        ("threads", ctypes.c_int),
        ("kv16", ctypes.c_int),
    ]


def _linear(kernel) -> _Linear | None:
    from splitserve.platform.quant.a8 import Int4A8Kernel

    if not isinstance(kernel, Int4A8Kernel):
        return None
    return _Linear(_p(kernel.tiles), _p(kernel.d), _p(kernel.mn), None if kernel.bias is None else _p(kernel.bias))


class DecodePlan:
    """Built by `plan_for(model)`; holds pointers into the model's tensors, so it lives with it."""

    def __init__(self, model, ops: CpuOps, digits: int):
        self.model, self.ops, self.digits = model, ops, digits
        self._layers = None
        self._caches: list | None = None

    def _bind(self, kv_caches) -> None:
        """(Re)build the per-layer table when the KV cache tensors change (allocated after load)."""
        if self._caches is not None and all(a[0] is b[0] for a, b in zip(self._caches, kv_caches)):
            return
        layers = (_Layer * len(self.model.layers))()
        for i, (layer, (k, v)) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            layers[i] = _Layer(
                _p(layer.input_layernorm.weight),
                _p(layer.post_attention_layernorm.weight),
                *(_linear(module.kernel) for module in _linears(layer)),
                _p(k),
                _p(v),
            )
        self._layers, self._caches = layers, list(kv_caches)

    def run(self, x: torch.Tensor, positions: torch.Tensor, kv_caches, meta, lora=None) -> torch.Tensor:
        """x [B, hidden] embeddings of one new token per sequence -> final normed hidden [B, hidden].
        `lora`: the step's lora.batch.LoraBatch, or None."""
        self._bind(kv_caches)
        step = None
        if lora is not None:
            if lora.packed.decode_table is None:
                lora.packed.decode_table = _lora_table(self.model, lora.packed)
            step = _LoraStep(ctypes.addressof(lora.packed.decode_table), len(lora.packed.adapters), _p(lora.row_group))
        m, c = self.model, self.model.config
        k_cache = kv_caches[0][0]
        dims = _Dims(
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
            k_cache.shape[1],
            meta.decode_block_table.shape[1],
            c.rms_norm_eps,
            c.head_dim**-0.5,
            self.digits,
            torch.get_num_threads(),
            k_cache.dtype == torch.float16,
        )
        residual = x.contiguous()
        out = torch.empty_like(residual)
        rc = self.ops.lib.ss_decode_layers(
            ctypes.addressof(self._layers),
            len(m.layers),
            _p(m.norm.weight),
            ctypes.addressof(dims),
            residual.shape[0],
            _p(residual),
            _p(out),
            _p(positions),
            _p(m.rotary.cos_cache),
            _p(m.rotary.sin_cache),
            _p(meta.slot_mapping),
            _p(meta.decode_block_table),
            _p(meta.decode_context_lens),
            None if step is None else ctypes.addressof(step),
        )
        if rc != 0:
            raise MemoryError("ss_decode_layers could not allocate its scratch buffers")
        return out


def plan_for(model, ops: CpuOps | None) -> DecodePlan | None:
    """A DecodePlan when every decoder linear is an int-activation kernel of one digit count and
    only q/k/v carry a bias (Llama, Qwen2); None otherwise (the Python fused path runs)."""
    from splitserve.platform.quant.a8 import Int4A8Kernel

    if ops is None:
        return None
    digits = set()
    for layer in model.layers:
        kernels = tuple(module.kernel for module in _linears(layer))
        if not all(isinstance(k, Int4A8Kernel) for k in kernels) or any(k.bias is not None for k in kernels[1:]):
            return None
        digits.update(k.digits for k in kernels)
    return DecodePlan(model, ops, digits.pop()) if len(digits) == 1 else None
