"""Engine configuration: one frozen dataclass per concern, validated where declared.

Torch-free: the router and the operator import these too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from splitserve.platform.errors import ConfigError
from splitserve.platform.quant import QUANTIZATION_MODES

SUPPORTED_ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "phi3",
    "qwen3_moe",
    "gemma3",
    "mixtral",
    "glm4_moe",
    "gpt_oss",
    "deepseek_v3",
)
HIDDEN_ACTS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", *SUPPORTED_DTYPES)


ROPE_TYPES = ("llama3", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type == "llama3"`); `linear` divides positions;
    `yarn` (gpt-oss, DeepSeek-V3) blends interpolated and original frequencies between the
    `beta_fast` and `beta_slow` rotations and scales cos/sin by its attention factor
    (models/yarn.py); `mscale_all_dim` also scales DeepSeek's attention."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"rope_scaling.rope_type={self.rope_type!r} is not supported; allowed: {', '.join(ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise ConfigError(f"rope_scaling.factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, as read from GGUF metadata or config.json.

    `model_id` names the weights (the alias or path the user gave); it seeds the block hashes
    and the KV layout descriptor, so two workers only share KV when they run the same weights.
    """

    model_id: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    eos_token_ids: tuple[int, ...] = ()
    # Sliding-window attention: a "sliding_attention" layer's query at position p sees keys
    # p - sliding_window < j <= p (the transformers convention); `layer_types` has one entry per
    # layer, or is empty when every layer attends to the full context.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before rotary
    # Mixture of experts (Qwen3-MoE): layer i is sparse when num_experts > 0, i is not in
    # mlp_only_layers and (i + 1) % decoder_sparse_step == 0; each token runs its
    # num_experts_per_tok best experts, weights renormalised to sum 1 when norm_topk_prob.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the MLP's gate activation: SwiGLU or GeGLU (gelu_tanh)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)
    rope_local_theta: float | None = None  # rope base of sliding-window layers (None: rope_theta)
    # The 2026 families (models/glm4_moe.py, gpt_oss.py, deepseek_v3.py). Rotary over the first
    # partial_rotary_factor of each head (GLM-4.5: 0.5). Sigmoid-routed experts (GLM-4.5,
    # DeepSeek-V3): n_shared_experts always-on experts beside the routed ones, experts chosen
    # within the topk_group best of n_group groups, weights times routed_scaling_factor; the
    # first first_k_dense_replace layers are dense.
    partial_rotary_factor: float = 1.0
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    swiglu_limit: float = 7.0  # gpt-oss's clamp of the expert SwiGLU (its alpha is swiglu_alpha)
    swiglu_alpha: float = 1.702
    # Multi-head latent attention (DeepSeek-V3): kv_lora_rank > 0. Then num_kv_heads (1) and
    # head_dim describe the KV cache, not the attention: one latent head of kv_lora_rank +
    # qk_rope_head_dim per token, its halves in the K and V planes (models/mla.py).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # DeepSeek: rotary over interleaved pairs (x0, x1), (x2, x3), ...

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architecture {self.architecture!r} is not supported; allowed: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        self._check_windows()
        self._check_routing_and_latent()
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported; allowed: {', '.join(HIDDEN_ACTS)}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}"
            )
        if self.num_experts and (self.moe_intermediate_size <= 0 or self.decoder_sparse_step < 1):
            raise ConfigError("a mixture-of-experts model needs moe_intermediate_size > 0 and decoder_sparse_step >= 1")

    def _check_windows(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"layer type(s) {bad} are not supported; allowed: {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ConfigError(f"sliding_attention layers need sliding_window > 0, got {self.sliding_window}")

    def _check_routing_and_latent(self) -> None:
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ConfigError(
                f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and turn an even number "
                f"of the {self.head_dim} head dimensions"
            )
        if self.num_experts and (self.n_group < 1 or self.num_experts % self.n_group):
            raise ConfigError(f"n_group={self.n_group} must divide num_experts={self.num_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.kv_lora_rank and (
            self.num_kv_heads != 1 or 2 * self.head_dim != self.kv_lora_rank + self.qk_rope_head_dim
        ):
            raise ConfigError(
                "a latent-attention model caches one head of kv_lora_rank + qk_rope_head_dim = "
                f"{self.kv_lora_rank + self.qk_rope_head_dim} values in two halves; got num_kv_heads="
                f"{self.num_kv_heads}, head_dim={self.head_dim} (the sum must be even)"
            )

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` in tokens, or None for full attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def is_moe_layer(self, layer: int) -> bool:
        """True when decoder layer `layer` has a sparse mixture-of-experts MLP."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
            and layer >= self.first_k_dense_replace
        )

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head rotary turns (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    `kv_cache_memory_bytes` is the budget for K and V of all layers; the number of blocks is
    derived from it (or given directly with `num_blocks`, for tests).
    """

    block_size: int = 16
    kv_cache_memory_bytes: int = 512 * 1024**2
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ConfigError(f"block_size must be a power of two in [1, 256], got {self.block_size}")
        if self.kv_cache_memory_bytes <= 0:
            raise ConfigError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching: how many sequences and tokens one step may carry.

    `max_num_batched_tokens` is the per-step token budget; a prompt longer than what is left of
    it is prefilled in chunks over several steps (chunked prefill), so decodes keep flowing.
    None: 512 with chunked prefill; without it, max_model_len, since then a whole prompt must fit
    one step (the engine resolves it and rejects a smaller explicit budget, as vLLM does).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    # A waiting request whose prefix another request is computing waits a step to reuse it
    # (the scheduler's rule 3) instead of computing the same prefix twice.
    share_prefix_in_flight: bool = True
    # vLLM's --scheduling-policy: "fcfs" (arrival order) or "priority" (waiting requests by band,
    # higher first, then the body's priority, lower first, then arrival; see platform/sched).
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"scheduling policy {self.policy!r} is unknown; allowed: {', '.join(SCHEDULING_POLICIES)}"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")

    def resolved(self, max_model_len: int) -> SchedulerConfig:
        """This config with the token budget decided for a model of `max_model_len`."""
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_CHUNKED_BUDGET if self.enable_chunked_prefill else max_model_len
        elif not self.enable_chunked_prefill and budget < max_model_len:
            # Unchunked, a prompt longer than the budget could never be scheduled.
            raise ConfigError(
                f"max_num_batched_tokens={budget} is below max_model_len={max_model_len} with chunked prefill "
                f"off, so longer prompts could never run; allowed: max_num_batched_tokens >= {max_model_len}, "
                "a smaller max_model_len, or chunked prefill on"
            )
        return dataclasses.replace(self, max_num_batched_tokens=budget)


DEFAULT_CHUNKED_BUDGET = 512


@dataclass(frozen=True)
class DeviceConfig:
    """Where and in which precision the model runs; `num_threads` 0 keeps torch's default.

    `quantization` (platform/quant): "none" dequantizes every weight to `dtype` (the reference);
    "auto" serves each weight in the fast packed format nearest its stored type on a CPU with
    AVX2 (elsewhere it means "none"); "int4", "w4a16", "w4a8", "int8", "fp16" force one format
    (CPU only).
    `dtype` stays the activation and residual precision in every mode.
    `kv_cache_dtype` (vLLM's --kv-cache-dtype): "auto" stores K/V as float16 where a fast CPU mode
    serves the weights (half the bytes each decode step reads, twice the blocks per GiB; llama.cpp's
    default too) and in `dtype` otherwise, so "none" stays the float32 reference; or one of
    SUPPORTED_DTYPES. On CUDA the cache takes the model dtype.
    `enforce_eager` (vLLM's --enforce-eager): on CUDA, run every step eagerly instead of replaying
    decode steps from CUDA graphs captured at start-up (engine/cuda_graphs.py); no effect on a CPU.
    """

    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int = 0
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ConfigError(
                f"quantization {self.quantization!r} is not supported; allowed: {', '.join(QUANTIZATION_MODES)}"
            )
        if self.quantization not in ("none", "auto") and self.device != "cpu":
            raise ConfigError(
                f"quantization {self.quantization!r} runs on the CPU only; on {self.device} allowed: none, auto"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported; allowed: {', '.join(SUPPORTED_DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; allowed: {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.device != "cpu" and self.kv_cache_dtype not in ("auto", self.dtype):
            raise ConfigError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} differs from dtype {self.dtype!r}, which "
                f"{self.device} does not support; allowed there: auto, {self.dtype}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device {self.device!r} is not supported; allowed: 'cpu', 'cuda', 'cuda:N'")
        if self.num_threads < 0:
            raise ConfigError(f"num_threads must be >= 0, got {self.num_threads}")


def resolve_kv_cache_dtype(device: DeviceConfig, quantization: str) -> str:
    """The KV cache's dtype for `device` with its weights served in `quantization` (as resolved)."""
    if device.kv_cache_dtype != "auto":
        return device.kv_cache_dtype
    if device.device == "cpu" and quantization != "none" and device.dtype == "float32":
        return "float16"
    return device.dtype


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA serving (platform/lora): PEFT adapters on the attention and MLP projections.

    `max_loras`: distinct adapters one engine step may mix (a waiting request whose adapter would
    be one too many waits a step; vLLM's knob). `max_lora_rank`: the largest adapter rank accepted.
    `max_cpu_loras`: adapters kept loaded in host memory, least recently used evicted first
    (None: `max_loras`). `modules`: adapters known at start, as (name, path) pairs (--lora-modules).
    """

    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                "every adapter of a step must be loaded; raise max_cpu_loras or lower max_loras"
            )
        names = [name for name, _ in self.modules]
        for name in names:
            check_lora_name(name)
        if len(set(names)) != len(names):
            raise ConfigError(f"lora modules name an adapter twice: {names}")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def check_lora_name(name: str) -> str:
    """An adapter name is what a client puts in `model`: 1-128 printable characters, no ',' or
    whitespace (the `vllm:lora_requests_info` labels are comma-separated lists of names)."""
    if (
        not isinstance(name, str)
        or not 0 < len(name) <= 128
        or not name.isprintable()
        or any(c in name for c in ", \t")
    ):
        raise ConfigError(
            f"adapter name {name!r} is invalid; allowed: 1-128 printable characters without spaces or commas"
        )
    return name


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's `--speculative-config` shape (platform/spec/).

    `method` "ngram" proposes up to `num_speculative_tokens` tokens per step from the request's
    own prompt and output: the tokens that followed the most recent earlier occurrence of its
    last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`. Speculation switches
    itself off for a step whose batch has more than `max_batch_size` running requests, and for
    a request whose acceptance rate, after `min_proposals` verification rounds, is below
    `min_acceptance_rate` (verifying tokens that are thrown away costs more than it saves).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    max_batch_size: int = 8
    min_acceptance_rate: float = 0.2
    min_proposals: int = 8

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative method {self.method!r} is not supported; allowed: {', '.join(SPECULATIVE_METHODS)}"
            )
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "max_batch_size",
            "min_proposals",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"speculative {name}={value!r} is invalid; allowed: an integer >= 1")
        if self.num_speculative_tokens > 16:
            raise ConfigError(
                f"speculative num_speculative_tokens={self.num_speculative_tokens} is too large; allowed: 1 to 16"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative prompt_lookup_min={self.prompt_lookup_min} is above prompt_lookup_max="
                f"{self.prompt_lookup_max}; allowed: min <= max"
            )
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ConfigError(
                f"speculative min_acceptance_rate={self.min_acceptance_rate!r} is invalid; allowed: 0 to 1"
            )

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse `--speculative-config '{"method": "ngram", ...}'`; ConfigError says what is wrong."""
        import json

        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(
                f"--speculative-config is not valid JSON ({exc}); example: "
                '\'{"method": "ngram", "num_speculative_tokens": 4}\''
            ) from None
        if not isinstance(data, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"--speculative-config has unknown keys {unknown}; allowed: {sorted(known)}")
        return cls(**data)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (platform/parallel): one process per rank, `tensor_parallel_size` ranks
    in all, spread over `nnodes` nodes of tensor_parallel_size // nnodes ranks each.

    Rank 0 (node 0) owns the scheduler and starts its node's other ranks; a node `node_rank` > 0
    starts its own. Ranks meet at `master_addr`:`master_port` (torchrun's and vLLM's names; port 0:
    rank 0 picks a free one, single node only). In a LeaderWorkerSet pod the worker's flags
    default to the controller's environment (platform/settings/worker_args.py).
    """

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.tensor_parallel_size % self.nnodes:
            raise ConfigError(
                f"tensor_parallel_size={self.tensor_parallel_size} does not split evenly over nnodes={self.nnodes}; "
                "allowed: a multiple of --nnodes (the same number of ranks on every node)"
            )
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if not isinstance(self.master_port, int) or not 0 <= self.master_port <= 65535:
            raise ConfigError(f"master_port must be in [0, 65535] (0: pick a free one), got {self.master_port!r}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ConfigError("a group over several nodes needs --master-port (the port rank 0 listens on)")
        if not self.master_addr:
            raise ConfigError("master_addr must name rank 0's host")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine instance needs; `model` is an alias, a path or `random:<preset>`."""

    model: str = "smollm2-135m"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    seed: int = 0
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    kv_tier: KVTierConfig | None = None  # None: no second KV tier (platform/kv/tier.py)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


@dataclass(frozen=True)
class KVTierConfig:
    """The second KV tier: blocks evicted from the cache are kept here, in their own LRU.

    `max_bytes`: the tier's size limit (block payloads; file headers are not counted).
    `directory`: a local folder for a file tier (the tier creates a subfolder of its own and
    removes it on close); None keeps the blocks in host memory (pinned on CUDA).
    `secret`: the service's KV secret (the worker's `--kv-secret-file`), which keys the file
    tier's MACs; None: a random key for this process.
    """

    max_bytes: int
    directory: str | None = None
    secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_bytes, int) or self.max_bytes <= 0:
            raise ConfigError(
                f"the KV tier size must be a positive number of bytes (--kv-tier-bytes), got {self.max_bytes!r}"
            )
        if self.directory is not None and not self.directory:
            raise ConfigError("--kv-tier-dir must name a folder (or be left out for a host-memory tier)")
        if self.secret is not None and (not isinstance(self.secret, bytes) or len(self.secret) < 16):
            raise ConfigError("the KV tier's secret must be at least 16 bytes (the service's --kv-secret-file)")


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
}


def parse_byte_size(text: str) -> int:
    """A size as `--kv-tier-bytes` takes it: bytes, or a number with a unit (KiB ... TB); ConfigError
    naming what is allowed. Here (torch-free) so that the router's `up` checks it as the worker does."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _SIZE_UNITS or float(m.group(1)) * _SIZE_UNITS[unit] < 1:
        raise ConfigError(
            f"{text!r} is not a size; allowed: a positive number of bytes, or a number "
            "with one of the units KiB, MiB, GiB, TiB, KB, MB, GB, TB (e.g. 4GiB)"
        )
    return int(float(m.group(1)) * _SIZE_UNITS[unit])
